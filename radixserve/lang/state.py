"""`ProgramState` (the `s` of a program) and the group of branches `s.fork(n)` returns.

The state is a thin handle on its executor: `s += expr` queues, `s["x"]` waits for `x`,
`s.text()` waits for everything queued. Names follow SGLang's frontend.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from radixserve.lang.interpreter import ProgramError, StreamExecutor
from radixserve.lang.ir import (ConcatBranches, Expr, ExprList, RoleBegin, RoleEnd,
                                VarScopeBegin, VarScopeEnd, as_expr)


class ProgramState:
    def __init__(self, executor: StreamExecutor) -> None:
        self.stream_executor = executor
        self.ret_value: Any = None
        """What the program function returned."""

    # -- building ------------------------------------------------------------------------
    def __iadd__(self, other: Expr | str) -> ProgramState:
        if other is None:
            raise ValueError("tried to append None to a program state")
        self.stream_executor.submit(other)
        return self

    def _role(self, name: str, expr: Expr | str | None) -> Any:
        if expr is not None:
            self.stream_executor.submit(ExprList([RoleBegin(name), as_expr(expr), RoleEnd(name)]))
            return None

        @contextmanager
        def scope() -> Iterator[None]:
            self.stream_executor.submit(RoleBegin(name))
            yield
            self.stream_executor.submit(RoleEnd(name))

        return scope()

    def system(self, expr: Expr | str | None = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Expr | str | None = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Expr | str | None = None) -> Any:
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """`with s.var_scope("x"): s += ...` captures the text appended inside as `x`."""
        self.stream_executor.submit(VarScopeBegin(name))
        yield
        self.stream_executor.submit(VarScopeEnd(name))

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        """`size` branches from the current text. With more than one branch the shared
        prefix is first committed to the runtime, so every branch hits the radix cache."""
        branches = [ProgramState(ex) for ex in self.stream_executor.fork(size)]
        return ProgramStateGroup(branches, self)

    @contextmanager
    def copy(self) -> Iterator[ProgramState]:
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    # -- reading -------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """The runtime's meta_info for a gen (cached_tokens, finish_reason, logprobs...) or
        select's scores (normalized_prompt_logprobs, scores, input_token_logprobs...)."""
        self.stream_executor.get_var(name)
        return self.stream_executor.meta_info.get(name)

    def text(self) -> str:
        self.stream_executor.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, str]]:
        self.stream_executor.sync()
        return self.stream_executor.messages_

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        self.stream_executor.sync()
        return self.stream_executor.error_

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """New text as it is produced (the whole text, or one variable's), until the
        program ends. Without `stream=True`, one piece once it is done."""
        ex = self.stream_executor
        if not ex.stream:
            yield self.text() if var_name is None else self[var_name]
            return
        sent = 0
        if var_name is None:
            while True:
                ex.text_event.wait()
                ex.text_event.clear()
                done = ex.finished and ex._queue.unfinished_tasks == 0
                new = ex.text_[sent:]
                sent += len(new)
                if new:
                    yield new
                if done:
                    return
        with ex.announced:  # the program may not have appended it yet
            ex.announced.wait_for(lambda: var_name in ex.events or ex.finished)
        event, final = ex.stream_events.get(var_name), ex.events.get(var_name)
        if event is None or final is None:
            raise KeyError(f"no gen named {var_name!r} was appended to this state")
        while True:
            event.wait()
            event.clear()
            done = final.is_set()
            new = str(ex.variables.get(var_name, ""))[sent:]
            sent += len(new)
            if new:
                yield new
            if done:
                return

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The branches of a fork; `+=` appends to every branch (a callable gets the index)."""

    def __init__(self, states: list[ProgramState], source: ProgramState) -> None:
        self.states = states
        self.source = source

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Expr | str | list | tuple | Callable[[int], Any]
                 ) -> ProgramStateGroup:
        for i, state in enumerate(self.states):
            if callable(other) and not isinstance(other, Expr):
                state += other(i)
            elif isinstance(other, (list, tuple)):
                state += other[i]
            else:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch. `gather_variable`: each variable a branch set becomes, in
        the source, the list of its values across branches. `concate_and_append`: append
        each branch's new text to the source, in order. A failed branch makes join raise
        ProgramError (from the branch's error)."""
        for state in self.states:
            error = state.error()
            if error is not None:
                for other in self.states:
                    other.stream_executor.end()
                raise ProgramError(f"a forked branch failed: {error!r}") from error
        if mode == "gather_variable":
            src = self.source.stream_executor
            src.sync()
            before = set(src.variables)
            for state in self.states:
                state.sync()
                for name, value in state.stream_executor.variables.items():
                    if name not in before:
                        src.variables.setdefault(name, []).append(value)
        elif mode == "concate_and_append":
            self.source += ConcatBranches(self.states)
            self.source.sync()
        else:
            raise ValueError(f"join mode must be gather_variable or concate_and_append, "
                             f"got {mode!r}")
        for state in self.states:
            state.stream_executor.end()
