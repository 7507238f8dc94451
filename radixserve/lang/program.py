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
from radixserve.lang.ir import GenParams
from radixserve.lang.state import ProgramState


def _defaults(max_new_tokens: int, stop: Any, stop_token_ids: Any, stop_regex: Any,
              temperature: float, top_p: float, top_k: int, min_p: float,
              frequency_penalty: float, presence_penalty: float, ignore_eos: bool,
              return_logprob: bool | None, logprob_start_len: int | None,
              top_logprobs_num: int | None, return_text_in_logprobs: bool | None) -> GenParams:
    return GenParams(
        max_new_tokens=max_new_tokens, stop=stop or None, stop_token_ids=stop_token_ids or None,
        stop_regex=stop_regex or None, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        ignore_eos=ignore_eos, return_logprob=return_logprob,
        logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs)


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

    def run(self, *args: Any, max_new_tokens: int = 128, stop: Any = None,
            stop_token_ids: Any = None, stop_regex: Any = None, temperature: float = 1.0,
            top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
            frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
            ignore_eos: bool = False,
            return_logprob: bool | None = None, logprob_start_len: int | None = None,
            top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None,
            stream: bool = False, backend: Any = None, **kwargs: Any) -> ProgramState:
        """Run once. The sampling settings are defaults that each gen may override. With
        `stream=True` this returns at once; read the output with `state.text_iter()`.
        An exception raised by the program itself propagates (not with `stream=True`:
        there it lands in `state.error()`); a failed call is in `state.error()`."""
        defaults = _defaults(max_new_tokens, stop, stop_token_ids, stop_regex, temperature,
                             top_p, top_k, min_p, frequency_penalty, presence_penalty,
                             ignore_eos, return_logprob, logprob_start_len, top_logprobs_num,
                             return_text_in_logprobs)
        return run_program(self, _resolve_backend(backend), args, kwargs, defaults, stream,
                           catch=stream)

    def run_batch(self, batch_kwargs: list[dict[str, Any]] | list[tuple], *,
                  max_new_tokens: int = 128, stop: Any = None, stop_token_ids: Any = None,
                  stop_regex: Any = None, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                  min_p: float = 0.0, frequency_penalty: float = 0.0,
                  presence_penalty: float = 0.0, ignore_eos: bool = False,
                  return_logprob: bool | None = None, logprob_start_len: int | None = None,
                  top_logprobs_num: int | None = None,
                  return_text_in_logprobs: bool | None = None, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False
                  ) -> list[ProgramState]:
        """Run once per argument dict (or tuple), concurrently; states in input order."""
        if not batch_kwargs:
            return []
        batch = [dict(zip(self.arg_names, a)) if isinstance(a, (list, tuple)) else dict(a)
                 for a in batch_kwargs]
        defaults = _defaults(max_new_tokens, stop, stop_token_ids, stop_regex, temperature,
                             top_p, top_k, min_p, frequency_penalty, presence_penalty,
                             ignore_eos, return_logprob, logprob_start_len, top_logprobs_num,
                             return_text_in_logprobs)
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
