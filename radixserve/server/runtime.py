"""Start the three-process server: from the command line (`serve`) or from Python
(`Runtime`, which runs the front door in a child process and hands out its address)."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import weakref
from collections import deque
from functools import partial
from typing import IO, Any, Callable, NoReturn

from radixserve.config import ServerConfig
from radixserve.model.loader import load_tokenizer, resolve_model
from radixserve.server.http.server import HttpServer
from radixserve.server.processes import die_with_parent
from radixserve.server.spawn import Child, describe_exit
from radixserve.server.supervisor import Supervisor
from radixserve.disk_layout import pin
from radixserve.tenants import load_cache_secret
from radixserve.front_door.process import FrontDoor
from radixserve.front_door.requests import eos_token_ids
from radixserve.transport.in_process import InProcessCalls, LocalClient
from radixserve.transport.sockets import exposure_warning

log = logging.getLogger(__name__)


def run_server(config: ServerConfig, on_ready: Callable[[str, str], None],
               stop: StopFlag) -> int:
    """Run the front door (RPC, and HTTP in a thread that calls it in-process) here and the
    scheduler and worker as children until `stop` is set; `on_ready(rpc_address,
    http_url)` once the model is loaded and both servers answer. Returns the exit status
    (1 if the children could not be kept alive)."""
    logging.basicConfig(level=config.log_level.upper(), format="[radixserve] %(message)s")
    model_dir = resolve_model(config.model)
    tokenizer = load_tokenizer(model_dir)
    # The disk tier's directory is checked and opened once, here: the children get this
    # descriptor, and no one opens its path again (disk_layout.pin).
    disk = pin(config.kv_disk_dir) if config.kv_disk_dir is not None else None
    supervisor = Supervisor(config, model_dir, eos_token_ids(tokenizer, model_dir),
                            load_cache_secret(config.cache_secret_file, config.kv_disk_dir),
                            None if disk is None else disk.fd)
    front = FrontDoor(config, tokenizer, supervisor)  # bind first: a busy port fails fast
    warning = exposure_warning(config)
    if warning:
        log.warning("WARNING: %s", warning)
    http = None
    try:
        http = HttpServer(config, model_dir, partial(local_client, front.local))
        supervisor.start()
        http.start()

        def ready(rpc_address: str) -> None:
            http.wait_ready()
            on_ready(rpc_address, http.url)

        front.serve(ready, stop.fd)
    finally:
        if http is not None:
            http.stop()
        front.close()
        supervisor.shutdown()
    return 1 if supervisor.state == "dead" else 0


def local_client(door: InProcessCalls, config: ServerConfig) -> LocalClient:
    """The HTTP routes' client: the front door's handlers, in this process."""
    return LocalClient(door, max_frame_bytes=config.max_frame_bytes,
                       stream_backlog=config.http_stream_backlog)


class StopFlag:
    """Set by SIGINT / SIGTERM. `fd` turns readable then, so that a loop waiting on file
    descriptors wakes at once (a signal's handler runs between waits, not during one); a
    loop that polls on a timer calls the flag instead."""

    def __init__(self) -> None:
        self.stop = False
        self.fd, self._wake = os.pipe()
        os.set_blocking(self._wake, False)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._set)

    def _set(self, *_: object) -> None:
        self.stop = True
        try:
            os.write(self._wake, b"\0")
        except BlockingIOError:  # the pipe is full: the loop has been woken already
            pass

    def __call__(self) -> bool:
        return self.stop


def _runtime_main(run: Callable[..., int], config: Any, status_fd: int) -> None:
    """The front door's process under `Runtime` (or the router's, `run` says which): says on
    `status_fd` (one JSON line) that it is ready, or why it could not start."""
    die_with_parent()
    flag = StopFlag()
    status = os.fdopen(status_fd, "w")
    ready = False

    def report(**message: Any) -> None:
        status.write(json.dumps(message) + "\n")
        status.flush()

    def on_ready(rpc_address: str, http_url: str) -> None:
        nonlocal ready
        report(status="ready", rpc_address=rpc_address, http_url=http_url)
        ready = True
        status.close()

    try:
        code = run(config, on_ready, flag)
    except BaseException as e:
        if not ready:
            report(status="error", detail=f"{type(e).__name__}: {e}")
        raise
    if not ready and code:
        report(status="error", detail="the scheduler and worker processes exited during "
               f"start-up {config.max_worker_restarts + 1} time(s) (max_worker_restarts="
               f"{config.max_worker_restarts})")
    raise SystemExit(code)


def _pump(pipe: IO[bytes], tail: deque[str]) -> None:
    """Copy the server's stderr to ours, keeping its last lines for start-up errors."""
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace")
            tail.append(line)
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except Exception:  # our stderr is gone (interpreter exit, closed capture)
                pass


def _stop(process: Child, timeout: float) -> None:
    if process.is_alive():
        process.terminate()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()


class Runtime:
    """The server's processes, started from Python. `rpc_address` is what a `Client` needs;
    `http_url` is the base URL of the HTTP API (e.g. `http_url + "/v1"` for the openai
    client).

    Options are those of `radixserve serve` (ServerConfig); `rpc_port` and `port` (HTTP)
    default to free ports here.

    The front door runs as `python -c` (`spawn.Child`), so the caller's main module is never
    re-imported: a script on stdin, `python -c`, a notebook or an unguarded script all work.
    Its stderr (and its children's) is copied to `sys.stderr`; a failed start-up raises
    RuntimeError with the reason and the last lines of that output.

    The server's process is killed when the thread that started it ends (Linux delivers
    PR_SET_PDEATHSIG when the creating thread exits, not only the process), so start a
    Runtime from a thread that outlives it: the main thread, not a pool's worker."""

    TAIL_LINES = 40
    run: Callable[..., int] = staticmethod(run_server)
    """What the child runs: `run(config, on_ready, stop)`, `stop` a StopFlag (the router has
    its own)."""
    config_class: Any = ServerConfig
    process_name = "radixserve-front-door"

    def __init__(self, model: str | None = None, *, startup_timeout: float = 600.0,
                 **options: Any) -> None:
        if model is not None:
            options["model"] = model
        options.setdefault("rpc_port", 0)
        options.setdefault("port", 0)
        self.config = self.config_class.from_kwargs(**options)
        self._tail: deque[str] = deque(maxlen=self.TAIL_LINES)
        read_fd, write_fd = os.pipe()
        try:
            self.process = Child(_runtime_main, (type(self).run, self.config, write_fd),
                                 name=self.process_name, stderr=subprocess.PIPE,
                                 pass_fds=(write_fd,))
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._finalizer = weakref.finalize(self, _stop, self.process, 15.0)  # also at exit
        assert self.process.popen.stderr is not None
        self._pump = threading.Thread(target=_pump, args=(self.process.popen.stderr, self._tail),
                                      name="radixserve-stderr", daemon=True)
        self._pump.start()
        try:
            with os.fdopen(read_fd, "rb") as status:
                if not select.select([status], [], [], startup_timeout)[0]:
                    self._fail(TimeoutError, f"server not ready after {startup_timeout:.0f}s")
                line = status.readline()
            if not line:
                self.process.join(10)
                self._fail(RuntimeError, "server process exited during start-up "
                           f"({describe_exit(self.process.exitcode)})")
            message = json.loads(line)
            if message["status"] != "ready":
                self.process.join(10)
                self._fail(RuntimeError, f"server failed to start: {message['detail']}")
        except BaseException:  # Ctrl-C while waiting, too: leave nothing running
            self.shutdown()
            raise
        self.rpc_address: str = message["rpc_address"]
        self.http_url: str = message["http_url"]

    def _fail(self, kind: type[Exception], reason: str) -> NoReturn:
        self.shutdown()
        self._pump.join(2)  # the last lines of its output
        tail = "".join(self._tail).rstrip()
        raise kind(f"{reason}; the last lines of its output:\n{tail}" if tail else reason)

    def shutdown(self, timeout: float = 15.0) -> None:
        if self._finalizer.detach() is not None:  # once; the finalizer would do it at exit
            _stop(self.process, timeout)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
