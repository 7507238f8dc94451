"""Run a radixserve function in a fresh Python process, without re-importing `__main__`.

`multiprocessing`'s spawn method makes each child re-import the parent's main module, by
path (`__main__.__file__`) or by module name, before it runs the target. Some main
modules cannot be re-imported: a script read from standard input (`python - <<EOF`, whose
`__file__` is "<stdin>") kills every child before it runs a line of radixserve, and a
script without an `if __name__ == "__main__"` guard would start its servers again in each
child. The children here never import it: they run `python -c` with a bootstrap that sets
the parent's `sys.path` and imports only radixserve; the target and its arguments come
pickled over the child's standard input, a pipe that only its parent holds. Both the
`Runtime` (its front door) and the front door's supervisor (scheduler, worker) use this.

`Child` offers the part of `multiprocessing.Process` the server uses: `pid`, `exitcode`,
`is_alive()`, `terminate()`, `kill()`, `join(timeout)`, and `sentinel`, a file descriptor
that turns readable when the child exits (a pidfd: Linux 5.3 or later)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import weakref
from typing import IO, Any, Callable, Sequence

_BOOTSTRAP = ("import sys; sys.path[:] = {path!r}; "
              "from radixserve.server.spawn import _bootstrap; _bootstrap()")


class Child:
    """`target(*args)` in a new interpreter (`sys.executable`). `target` must be a
    module-level function outside `__main__`; `args` must pickle. `stderr` is passed to
    `subprocess.Popen` (None: inherited); `pass_fds` are kept open in the child."""

    def __init__(self, target: Callable[..., Any], args: Sequence[Any] = (), *, name: str,
                 stderr: int | IO[Any] | None = None, pass_fds: Sequence[int] = ()) -> None:
        if getattr(target, "__module__", "__main__") == "__main__":
            raise ValueError(f"{name}: the target must be importable outside __main__")
        self.name = name
        payload = pickle.dumps((target, tuple(args)), protocol=pickle.HIGHEST_PROTOCOL)
        code = _BOOTSTRAP.format(path=[str(p) for p in sys.path])
        # The interpreter's flags (-O, -X ..., -W ...) carry over, as multiprocessing does.
        flags: list[str] = getattr(subprocess, "_args_from_interpreter_flags", list)()
        self.popen = subprocess.Popen([sys.executable, *flags, "-c", code],
                                      stdin=subprocess.PIPE, stderr=stderr,
                                      pass_fds=tuple(pass_fds))
        # Readable once the child has exited, however it ended: a loop waits on it beside
        # its sockets rather than polling exit codes. Closed with this object.
        self.sentinel = os.pidfd_open(self.popen.pid)
        weakref.finalize(self, os.close, self.sentinel)
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write(payload)
            self.popen.stdin.close()
        except BrokenPipeError:  # it died before reading: its exit code and stderr say why
            pass

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit status, or -N if killed by signal N."""
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def __repr__(self) -> str:
        return f"<Child {self.name} pid={self.pid} exitcode={self.exitcode}>"


def describe_exit(code: int | None) -> str:
    """An exit status in words: 'exit code 1', 'killed by SIGKILL', 'still running'."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            import signal

            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _bootstrap() -> None:
    """The child's side: read the target from stdin, let go of the pipe, run it. An
    exception ends the process with its traceback on stderr and exit code 1."""
    target, args = pickle.load(sys.stdin.buffer)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    target(*args)
