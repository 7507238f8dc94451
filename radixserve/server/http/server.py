"""Run the HTTP app with uvicorn in a thread of the front door's process.

The socket is bound in the constructor, so a busy port fails start-up at once (like the
RPC port) and port 0 resolves to a real port before anything is announced. uvicorn runs
its own asyncio loop in a daemon thread; it talks to the front door only through the client
that `connect` makes (`AppState`). Its connections are bounded in number and time
(server/http/connections.py)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

from radixserve.config import ServerConfig
from radixserve.server.http.state import Connect

log = logging.getLogger(__name__)
LISTEN_BACKLOG = 2048
"""Connections the kernel queues before they are accepted (they hold no descriptor)."""


class HttpServer:
    def __init__(self, config: ServerConfig, model_dir: Path, connect: Connect) -> None:
        self.config, self.model_dir, self.connect = config, model_dir, connect
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        # proto=IPPROTO_TCP matters: accepted sockets copy it, and asyncio sets TCP_NODELAY
        # only on sockets that say they are TCP. Without it, every response written in two
        # parts (headers, body) waits ~40 ms for the client's delayed ACK (Nagle).
        self.sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((config.host, config.port))
        except OSError as e:
            self.sock.close()
            raise OSError(f"cannot bind the HTTP port {config.host}:{config.port}: {e}") from e
        self.sock.listen(LISTEN_BACKLOG)
        port = self.sock.getsockname()[1]
        host = f"[{config.host}]" if family == socket.AF_INET6 else config.host
        self.url = f"http://{host}:{port}"
        self.server: Any = None
        self.app: Any = None
        self.thread: threading.Thread | None = None
        self._error: BaseException | None = None
        from radixserve.server.http.connections import Connections, connection_limit

        self.connections = Connections(
            connection_limit(config.http_max_connections, config.http_fd_reserve),
            config.http_header_timeout, config.http_body_timeout)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="radixserve-http", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            import uvicorn

            from radixserve.server.http.app import create_app
            from radixserve.server.http.connections import ACCEPT_BATCH, guarded_protocol

            class Server(uvicorn.Server):
                async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                    await super().startup(sockets)
                    for sock in sockets or ():  # asyncio set it to the accept batch
                        sock.listen(LISTEN_BACKLOG)

            app = self.app = create_app(self.config, self.model_dir, self.connect)
            uv_config = uvicorn.Config(
                app, log_level="warning", access_log=False, loop="asyncio", ws="none",
                lifespan="on", timeout_graceful_shutdown=2,
                timeout_keep_alive=self.config.http_idle_timeout,  # type: ignore[arg-type]
                http=guarded_protocol(self.connections), backlog=ACCEPT_BATCH)
            self.server = Server(uv_config)
            self.server.run(sockets=[self.sock])
        except BaseException as e:  # reported to the thread that waits for readiness
            self._error = e
            log.exception("the HTTP server failed")

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until uvicorn serves (raises if it failed to start)."""
        deadline = time.monotonic() + timeout
        while not getattr(self.server, "started", False):
            if self._error is not None or (self.thread and not self.thread.is_alive()):
                raise RuntimeError(f"the HTTP server failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the HTTP server did not start in {timeout:.0f}s")
            time.sleep(0.02)

    def stop(self, timeout: float = 5.0) -> None:
        if self.app is not None:
            self.app.state.radix.closing = True
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
        self.sock.close()
