"""`RadixServer`: one Ray Serve replica that is a whole radixserve server (its front door,
scheduler and worker processes: `Runtime`), started in the replica's constructor on free
ports and stopped when Ray stops the replica (after it drained: Ray waits up to
`graceful_shutdown_timeout_s` for the calls in flight, then calls `__del__`).

Calls come from the ingress (ingress.py) as the HTTP request it received, and go to the
server's own HTTP API, so every route (OpenAI's, SGLang's /generate, radixserve's) is the
server's own; the response streams back as it is made. Ray imports nothing here: the
ray-facing hooks are plain methods (`check_health`, `record_replica_metadata`,
`record_routing_stats`)."""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
import threading
import time
from typing import Any, AsyncIterator

import httpx

from radixserve.client import Client
import json

from radixserve.ray.keys import REPLICA_HEADER, RouteKey, bearer
from radixserve.server.runtime import Runtime

log = logging.getLogger("ray.serve")

HOP_HEADERS = frozenset({"host", "content-length", "connection", "transfer-encoding",
                         "keep-alive", "upgrade"})


class RadixServer:
    name = "radixserve"
    """This replica's name in Ray (its replica id), on every answer's REPLICA_HEADER."""

    def __init__(self, model: str, options: dict[str, Any], cache_secret: str | None,
                 operator_key: str | None = None, host: str | None = None) -> None:
        """`options`: radixserve server options (`radixserve serve`'s, as keywords);
        `cache_secret`: the fleet's (the router hashes prompts with it; None: the
        `cache_secret_file` option names it, on every node); `host`:
        where the RPC and cache-events sockets bind (this node's address, for a router on
        another node; default: loopback)."""
        self._dir = tempfile.TemporaryDirectory(prefix="radixserve-ray-")
        if cache_secret is not None:
            secret_file = os.path.join(self._dir.name, "cache.secret")
            with open(os.open(secret_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(cache_secret)
            options = {**options, "cache_secret_file": secret_file}
        if host is not None:
            options.setdefault("rpc_host", host)
        self.operator_key = operator_key
        start = time.monotonic()
        self.runtime = self._start(model, options)
        self.http = httpx.AsyncClient(base_url=self.runtime.http_url, timeout=None)
        with Client(self.runtime.rpc_address, timeout=60, api_key=operator_key) as client:
            self.info = client.model_info()
        log.info("radixserve replica ready in %.1f s: rpc %s, http %s",
                 time.monotonic() - start, self.runtime.rpc_address, self.runtime.http_url)

    def _start(self, model: str, options: dict[str, Any]) -> Runtime:
        """The server, started from a thread of its own that lives as long as it does (its
        processes die with the thread that started them: `Runtime`'s note)."""
        started: list[Any] = []
        ready = threading.Event()
        self._stopped = threading.Event()

        def keep() -> None:
            try:
                started.append(Runtime(model, **options))
            except BaseException as e:  # start-up failed: the constructor raises it
                started.append(e)
            ready.set()
            self._stopped.wait()

        self._keeper = threading.Thread(target=keep, name="radixserve-ray-server",
                                        daemon=True)
        self._keeper.start()
        ready.wait()
        if isinstance(started[0], BaseException):
            self._stopped.set()
            raise started[0]
        runtime: Runtime = started[0]
        return runtime

    async def forward(self, key: RouteKey, method: str, path: str, query: str,
                      headers: dict[str, str], body: bytes) -> AsyncIterator[Any]:
        """The server's answer to one HTTP request: first `(status, headers)`, then its body
        in the chunks the server sends (an SSE stream's events as they come). `key` is the
        request router's (router.py)."""
        if path == "/ray/replica":
            yield self._describe(headers)
            return
        request = self.http.build_request(
            method, path + (f"?{query}" if query else ""), content=body,
            headers={k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS})
        response = await self.http.send(request, stream=True)
        try:
            yield response.status_code, {
                **{k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS},
                REPLICA_HEADER: self.name}
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()

    def _describe(self, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        """GET /ray/replica: which replica this is and where its server listens (the
        operator's: with keys, it takes the operator key)."""
        given = (bearer(headers) or "").encode()
        if self.operator_key is not None and not secrets.compare_digest(
                given, self.operator_key.encode()):
            return 403, {REPLICA_HEADER: self.name}, b'{"error": "the operator key only"}'
        body = json.dumps({"replica": self.name, **self.record_replica_metadata()})
        return 200, {REPLICA_HEADER: self.name, "content-type": "application/json"}, \
            body.encode()

    async def check_health(self) -> None:
        """Ray's health check: the server's processes alive and its /health `ok` (a dead
        scheduler or worker, being restarted or given up on, answers 503). Raising tells
        Ray to replace this replica."""
        if not self.runtime.process.is_alive():
            raise RuntimeError("the radixserve front door exited "
                               f"(exit code {self.runtime.process.exitcode})")
        response = await self.http.get("/health", timeout=10)
        if response.status_code != 200:
            raise RuntimeError(f"radixserve /health answered {response.status_code}: "
                               f"{response.text[:200]}")

    def record_replica_metadata(self) -> dict[str, Any]:
        """What the request router needs of this replica, once: where its tree's events
        are published and its RPC address (for snapshots)."""
        return {"rpc_address": self.runtime.rpc_address,
                "events_address": self.info["cache_events_address"],
                "page_size": self.info["page_size"], "http_url": self.runtime.http_url}

    def __del__(self) -> None:
        """Ray's graceful shutdown, once the calls in flight have ended (or its timeout)."""
        runtime = getattr(self, "runtime", None)
        if runtime is not None:
            runtime.shutdown()
        stopped = getattr(self, "_stopped", None)
        if stopped is not None:
            stopped.set()
        directory = getattr(self, "_dir", None)
        if directory is not None:
            directory.cleanup()
