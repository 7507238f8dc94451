"""`@function` programs: `run` one, `run_batch` many at once.

A program is `def prog(s, ...)`; running it makes a fresh state, calls the function with
it and waits for everything it queued. `run_batch` runs the programs on a thread pool, so
their requests meet in the runtime's continuous batch and share cached prefixes; a
program that raises does not sink the batch: its state carries the error (`error()`).
"""

from __future__ import annotations

import inspect
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from radixserve.lang.backends import Backend, as_backend, get_default_backend
from radixserve.lang.interpreter import StreamExecutor
from radixserve.lang.ir import SETTINGS, GenParams
from radixserve.lang.state import ProgramState


def _resolve_backend(backend: Any) -> Backend:
    chosen = backend if backend is not None else get_default_backend()
    if chosen is None:
        raise ValueError("no backend: pass backend=... or call set_default_backend(...)")
    return as_backend(chosen)


class SglFunction:
    """What `@function` returns. `prog(...)` is `prog.run(...)`."""

    def __init__(self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None,
                 num_api_spec_tokens: int | None = None) -> None:
        self.func = func
        self.bind_arguments = bind_arguments or {}
        params = list(inspect.signature(func).parameters)
        if not params or params[0] != "s":
            raise TypeError(f"a program's first argument must be named 's', got {params[:1]}")
        self.arg_names = params[1:]

    def bind(self, **kwargs: Any) -> SglFunction:
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"unknown argument(s) {sorted(unknown)}")
        return SglFunction(self.func, {**self.bind_arguments, **kwargs})

    def run(self, *args: Any, stream: bool = False, backend: Any = None,
            **kwargs: Any) -> ProgramState:
        """Run once. Keyword arguments named as a `SamplingParams` field or a logprob
        argument (`ir.SETTINGS`; SGLang's `max_new_tokens=128, temperature=1.0, ...`) are
        defaults that each gen may override, unless the program takes an argument of that
        name; the rest are the program's. With `stream=True` this returns at once; read the
        output with `state.text_iter()`. An exception raised by the program itself
        propagates (not with `stream=True`: there it lands in `state.error()`); a failed
        call is in `state.error()`."""
        settings = {k: kwargs.pop(k) for k in list(kwargs)
                    if k in SETTINGS and k not in self.arg_names}
        return run_program(self, _resolve_backend(backend), args, kwargs,
                           GenParams.of(**settings), stream, catch=stream)

    def run_batch(self, batch_kwargs: list[dict[str, Any]] | list[tuple], *,
                  backend: Any = None, num_threads: int | str = "auto",
                  progress_bar: bool = False, **settings: Any) -> list[ProgramState]:
        """Run once per argument dict (or tuple), concurrently; states in input order.
        `settings` are run()'s defaults for every gen."""
        if not batch_kwargs:
            return []
        batch = [dict(zip(self.arg_names, a)) if isinstance(a, (list, tuple)) else dict(a)
                 for a in batch_kwargs]
        defaults = GenParams.of(**settings)
        chosen = _resolve_backend(backend)
        if num_threads == "auto":
            num_threads = max(64, (os.cpu_count() or 1) * 16)
        workers = max(1, min(int(num_threads), len(batch)))
        bar = None
        if progress_bar:
            from tqdm import tqdm
            bar = tqdm(total=len(batch))
        lock = threading.Lock()

        def one(kwargs: dict[str, Any]) -> ProgramState:
            try:
                return run_program(self, chosen, (), kwargs, defaults, False, catch=True)
            finally:
                if bar is not None:
                    with lock:
                        bar.update()

        with ThreadPoolExecutor(workers, thread_name_prefix="radixserve-lang") as pool:
            states = list(pool.map(one, batch))
        if bar is not None:
            bar.close()
        return states

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def run_program(program: SglFunction, backend: Backend, args: tuple, kwargs: dict[str, Any],
                defaults: GenParams, stream: bool, catch: bool) -> ProgramState:
    """Make a state, call the function, wait for its queue. With `catch`, an exception
    from the program is stored in the state instead of raised."""
    executor = StreamExecutor(backend, defaults, stream)
    state = ProgramState(executor)
    kwargs = {**program.bind_arguments, **kwargs}

    def body() -> None:
        try:
            state.ret_value = program.func(state, *args, **kwargs)
            executor.sync()
        except BaseException as e:
            if isinstance(e, Exception):  # what it queued before it raised still runs
                executor.sync()
            if not catch:
                raise
            if executor.error_ is None:
                executor.error_ = e
            for event in [*executor.events.values(), *executor.stream_events.values()]:
                event.set()
        finally:
            executor.end()

    if stream:
        threading.Thread(target=body, daemon=True, name="radixserve-lang-program").start()
    else:
        body()
    return state
