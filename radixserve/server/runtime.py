"""Start the three-process server: from the command line (`serve`) or from Python
(`Runtime`, which runs the front door in a child process and hands out its address)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
from typing import Any, Callable

from radixserve.config import ServerConfig
from radixserve.model.loader import load_tokenizer, resolve_model
from radixserve.server.front_door import FrontDoor
from radixserve.server.http import HttpServer
from radixserve.server.processes import die_with_parent
from radixserve.server.supervisor import Supervisor
from radixserve.tokenizer.requests import eos_token_ids


def run_server(config: ServerConfig, on_ready: Callable[[str, str], None],
               should_stop: Callable[[], bool]) -> int:
    """Run the front door (RPC, and HTTP in a thread) here and the scheduler and worker as
    children until `should_stop()`; `on_ready(rpc_address, http_url)` once the model is
    loaded and both servers answer. Returns the exit status (1 if the children could not
    be kept alive)."""
    logging.basicConfig(level=config.log_level.upper(), format="[radixserve] %(message)s")
    model_dir = resolve_model(config.model)
    tokenizer = load_tokenizer(model_dir)
    supervisor = Supervisor(config, model_dir, eos_token_ids(tokenizer, model_dir))
    front = FrontDoor(config, tokenizer, supervisor)  # bind first: a busy port fails fast
    http = None
    try:
        front.bind_local(supervisor.paths.http_gateway)
        http = HttpServer(config, model_dir, supervisor.paths.http_gateway)
        supervisor.start()
        http.start()

        def ready(rpc_address: str) -> None:
            http.wait_ready()
            on_ready(rpc_address, http.url)

        front.serve(ready, lambda: should_stop() or supervisor.state == "dead")
    finally:
        if http is not None:
            http.stop()
        front.close()
        supervisor.shutdown()
    return 1 if supervisor.state == "dead" else 0


class StopFlag:
    """Set by SIGINT / SIGTERM; the server loop polls it."""

    def __init__(self) -> None:
        self.stop = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._set)

    def _set(self, *_: object) -> None:
        self.stop = True

    def __call__(self) -> bool:
        return self.stop


def _runtime_main(config: ServerConfig, conn: Any) -> None:
    die_with_parent()
    flag = StopFlag()
    try:
        code = run_server(config, lambda rpc, http: conn.send(("ready", (rpc, http))), flag)
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        raise
    raise SystemExit(code)


class Runtime:
    """The server's processes, started from Python. `rpc_address` is what a `Client` needs;
    `http_url` is the base URL of the HTTP API (e.g. `http_url + "/v1"` for the openai
    client).

    Options are those of `radixserve serve` (ServerConfig); `rpc_port` and `port` (HTTP)
    default to free ports here."""

    def __init__(self, model: str | None = None, *, startup_timeout: float = 600.0,
                 **options: Any) -> None:
        if model is not None:
            options["model"] = model
        options.setdefault("rpc_port", 0)
        options.setdefault("port", 0)
        self.config = ServerConfig.from_kwargs(**options)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_runtime_main, args=(self.config, child),
                                   name="radixserve-front-door")
        self.process.start()
        child.close()
        if not parent.poll(startup_timeout):
            self.shutdown()
            raise TimeoutError(f"server not ready after {startup_timeout:.0f}s")
        try:
            status, detail = parent.recv()
        except EOFError:
            self.shutdown()
            raise RuntimeError("server process exited during start-up") from None
        if status != "ready":
            self.shutdown()
            raise RuntimeError(f"server failed to start: {detail}")
        self.rpc_address: str = detail[0]
        self.http_url: str = detail[1]

    def shutdown(self, timeout: float = 15.0) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
