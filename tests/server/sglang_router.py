"""SGLang's own router (`sglang-router` from PyPI, its `smg` gateway) started in front of
HTTP servers on loopback, and a server that records what it forwards."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import httpx

ROUTER_TIMEOUT = 60.0
"""Seconds the router has to start and find its workers healthy."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smg() -> str | None:
    """The router's binary in this environment (the `test` extra installs it beside this
    Python), or None."""
    return shutil.which("smg", path=str(Path(sys.executable).parent))


class Router:
    """`smg launch` on a free loopback port in front of `worker_urls`; `url` is its base.
    Health checks every second, one failure taking a worker out, so that a stopped
    replica is out within a test's patience."""

    def __init__(self, worker_urls: list[str], log: Path, policy: str = "cache_aware"
                 ) -> None:
        binary = smg()
        assert binary is not None, "sglang-router is not installed (the test extra)"
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log, "wb")
        self.process = subprocess.Popen(
            [binary, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
             "--worker-urls", *worker_urls, "--health-check-interval-secs", "1",
             "--health-failure-threshold", "1", "--log-level", "warn",
             # its own metrics' port: fixed by default, so a second router could not start
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self.wait_healthy(len(worker_urls))
        except BaseException:
            self.stop()
            raise

    def workers(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.url}/workers", timeout=10).json()["workers"]

    def wait_healthy(self, count: int, timeout: float = ROUTER_TIMEOUT) -> None:
        """Until exactly `count` of the router's workers are healthy."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, "the router exited; see its log"
            try:
                if sum(w["is_healthy"] for w in self.workers()) == count:
                    return
            except (httpx.HTTPError, KeyError, ValueError):
                pass  # not listening yet
            assert time.monotonic() < deadline, f"not {count} healthy workers in {timeout}s"
            time.sleep(0.2)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


MODEL_INFO = {"model_path": "tiny", "tokenizer_path": None, "is_generation": True}


class Recorder:
    """An HTTP server that records each request's method, path and JSON body and answers
    with a minimal body of the shape the route's callers expect."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        recorded = self.requests

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def answer(self) -> None:
                size = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(size)
                recorded.append((self.command, self.path, json.loads(raw) if raw else None))
                data = json.dumps(MODEL_INFO if "info" in self.path else {}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def bodies(self, path: str) -> Iterator[dict[str, Any]]:
        return (body for _, p, body in self.requests if p == path)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
