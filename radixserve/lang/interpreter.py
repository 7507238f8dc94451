"""Executes a program's expressions against a backend, one executor per program state.

`s += gen(...)` must not block the program (SGLang semantics): a fork's branches are
filled in a loop, and they should then run at the same time. So each state owns an
executor with a queue and a thread that runs its expressions in order; reading a
variable (`s["x"]`, `s.text()`) waits for what it depends on. Branches thus run
concurrently, and the runtime batches their requests into one continuous batch.

A failure stops the executor's program, not the process: the error is kept (`error()`),
later expressions are skipped, and reading a variable that was never set raises
ProgramError from it.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from radixserve.lang.backends import Backend
from radixserve.lang.ir import (ConcatBranches, Expr, ExprList, Gen, GenParams, RoleBegin,
                                RoleEnd, Select, Text, VarScopeBegin, VarScopeEnd)


class ProgramError(RuntimeError):
    """A program's call failed; `__cause__` is the original error."""


class StreamExecutor:
    def __init__(self, backend: Backend, defaults: GenParams, stream: bool = False) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.text_ = ""
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.events: dict[str, threading.Event] = {}
        """Set when a variable is final (or the program failed)."""
        self.stream_events: dict[str, threading.Event] = {}
        """Set on every new piece of a streamed variable."""
        self.announced = threading.Condition()
        """Notified when a variable's events are registered, and at the end: a streaming
        reader may ask for a variable before the program (on its own thread) appends it."""
        self.text_event = threading.Event()
        self.messages_: list[dict[str, str]] = []
        self.cur_role: str | None = None
        self.cur_role_begin_pos = 0
        self.fork_start_pos = 0
        self.error_: BaseException | None = None
        self.finished = False
        self.children: list[StreamExecutor] = []
        self._queue: queue.Queue[Expr | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._ended = False

    # -- queueing ------------------------------------------------------------------------
    def submit(self, expr: Expr | str) -> None:
        expr = Text(expr) if isinstance(expr, str) else expr
        if not isinstance(expr, Expr):
            raise TypeError(f"cannot append {type(expr).__name__} to a program state")
        if self._ended:
            raise RuntimeError("this program state has ended; fork or run a new program")
        with self.announced:
            self._announce(expr)
            self.announced.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name="radixserve-lang-executor")
            self._thread.start()
        self._queue.put(expr)

    def _announce(self, expr: Expr) -> None:
        """Register events for the variables `expr` will set, so readers wait for them."""
        if isinstance(expr, ExprList):
            for item in expr.items:
                self._announce(item)
        elif isinstance(expr, (Gen, Select, VarScopeBegin)) and expr.name is not None:
            self.events[expr.name] = threading.Event()
            self.stream_events[expr.name] = threading.Event()

    def _loop(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is None:
                    return
                if self.error_ is None:
                    try:
                        self._execute(expr)
                    except BaseException as e:  # keep the program's error, wake readers
                        self.error_ = e
                        for event in [*self.events.values(), *self.stream_events.values()]:
                            event.set()
            finally:
                self._queue.task_done()
                self.text_event.set()

    def sync(self) -> None:
        self._queue.join()

    def end(self) -> None:
        """Finish what is queued, then stop the thread (children too)."""
        for child in self.children:
            child.end()
        if not self._ended:
            self._ended = True
            if self._thread is not None:
                self._queue.put(None)
            self.finished = True
            self.text_event.set()
            with self.announced:
                self.announced.notify_all()

    # -- reading -------------------------------------------------------------------------
    def get_var(self, name: str) -> Any:
        event = self.events.get(name)
        if event is not None:
            event.wait()
        if name not in self.variables:
            if self.error_ is not None:
                raise ProgramError(f"variable {name!r} was not set: the program failed "
                                   f"({self.error_!r})") from self.error_
            raise KeyError(name)
        return self.variables[name]

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value

    def fork(self, size: int) -> list[StreamExecutor]:
        """Branches that start from this state's text, variables and role."""
        self.sync()
        if size > 1 and self.text_:  # the shared prefix, cached once for all
            self.backend.commit(self.text_, self.lora_name)
        branches = []
        for _ in range(int(size)):
            b = StreamExecutor(self.backend, self.defaults, self.stream)
            b.text_, b.variables = self.text_, dict(self.variables)
            b.messages_, b.cur_role = list(self.messages_), self.cur_role
            b.cur_role_begin_pos, b.fork_start_pos = self.cur_role_begin_pos, len(self.text_)
            branches.append(b)
        self.children.extend(branches)
        return branches

    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter run() set for the whole program (None: the base model)."""
        return self.defaults.settings.get("lora_name")

    # -- execution -----------------------------------------------------------------------
    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self._fill(expr.value)
        elif isinstance(expr, ExprList):
            for item in expr.items:
                self._execute(item)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, VarScopeBegin):
            self.variables[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            self._set(expr.name, self.text_[self.variables[expr.name]:], None)
        elif isinstance(expr, ConcatBranches):
            for state in expr.states:
                ex = state.stream_executor
                ex.sync()
                self._fill(ex.text_[ex.fork_start_pos:])
        else:
            raise TypeError(f"unknown expression {expr!r}")

    def _fill(self, text: str) -> None:
        self.text_ += str(text)
        self.text_event.set()

    def _set(self, name: str | None, value: Any, meta: Any) -> None:
        if name is None:
            return
        self.variables[name] = value
        self.meta_info[name] = meta
        self.events[name].set()
        self.stream_events[name].set()

    def _gen(self, expr: Gen) -> None:
        params = expr.params.over(self.defaults)
        # int / float regexes allow trailing whitespace (so a number can end naturally);
        # the stop strings trim it unless max_tokens cut first: trim it here too
        numeric = params.dtype in (int, "int", float, "float")
        meta: dict[str, Any] | None
        if not self.stream:
            text, meta = self.backend.generate(self.text_, params)
            text = text.rstrip(" \n") if numeric else text
            self._fill(text)
            self._set(expr.name, text, meta)
            return
        start, value, meta = len(self.text_), "", None
        if expr.name is not None:
            self.variables[expr.name] = ""
        for piece, final in self.backend.generate_stream(self.text_, params):
            if final is not None:
                meta = final
                answer = final["text"].rstrip(" \n") if numeric else final["text"]
                if answer != value:  # the final answer is the authority
                    self.text_ = self.text_[:start] + answer
                    value = answer
                break
            value += piece
            self._fill(piece)
            if expr.name is not None:
                self.variables[expr.name] = value
                self.stream_events[expr.name].set()
        self._set(expr.name, value, meta)

    def _select(self, expr: Select) -> None:
        decision = self.backend.select(self.text_, expr.choices, expr.temperature,
                                       expr.choices_method, self.lora_name)
        self._fill(decision.decision)
        self._set(expr.name, decision.decision, decision.meta_info)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {role!r} begins inside role {self.cur_role!r}: roles "
                             "do not nest")
        template = self.backend.chat_template
        if not self.messages_ and role != "system" and template.default_system_prompt:
            self._role_begin("system")
            self._fill(template.default_system_prompt)
            self._role_end("system")
        self.cur_role = role
        self._fill(template.prefix_and_suffix(role)[0])
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"role {role!r} ends, but the current role is {self.cur_role!r}")
        content = self.text_[self.cur_role_begin_pos:]
        self._fill(self.backend.chat_template.prefix_and_suffix(role)[1])
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None
