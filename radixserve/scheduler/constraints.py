"""Requests whose output constraint is still compiling: they wait here, outside the
scheduler's queue, until their grammar is ready (or refused), so a slow compile never holds
up the loop (scheduler/grammar_compiler.py). Made by the scheduler for its first request
with a constraint (one without costs nothing of this), and a step feature from the first
that waits: its hook `start_step` queues those whose grammar is ready and refuses, through
the scheduler's outbox, those whose constraint did not compile."""

from __future__ import annotations

from radixserve.messages import ControlReply, RequestRejected, TokenizedRequest
from radixserve.results.errors import ErrorCode
from radixserve.scheduler.features import StepFeature
from radixserve.scheduler.grammar import Grammar
from radixserve.scheduler.grammar_compiler import Compile, CompilerBusy, GrammarCompiler
from radixserve.scheduler.request import SeqGroup
from radixserve.scheduler.state import SchedulerState
from radixserve.tenants import DEFAULT_TENANT


class ConstraintWaits(StepFeature):
    def __init__(self, compiler: GrammarCompiler, state: SchedulerState,
                 outbox: list[ControlReply | RequestRejected]) -> None:
        """`outbox`: the scheduler's, where a request refused after it was taken goes."""
        self.compiler, self.state, self.outbox = compiler, state, outbox
        self._compiling: dict[str, tuple[SeqGroup, Compile]] = {}
        """Requests waiting for their constraint to compile, by rid."""

    def lookup(self, request: TokenizedRequest, constraint: tuple[str, str]) -> Grammar | Compile:
        """`request`'s compiled `constraint` (its `sampling.constraint`), or the compile it
        must wait for (`wait`). Raises CompilerBusy when no compile can start."""
        kind, text = constraint
        grammar = self.compiler.cached(kind, text, namespace=request.namespace)
        if grammar is not None:
            return grammar
        # The default tenant is every caller of a server without tenant keys (and the
        # Engine's): one tenant has no share to keep from the others.
        tenant = None if request.tenant == DEFAULT_TENANT else request.tenant
        return self.compiler.start(kind, text, namespace=request.namespace, tenant=tenant)

    def wait(self, group: SeqGroup, compiling: Compile) -> None:
        self._compiling[group.rid] = (group, compiling)

    def start_step(self) -> None:
        self.state.waiting.extend(group.seqs[0] for group in self.take_ready(self.state.groups))

    def take_ready(self, groups: dict[str, SeqGroup]) -> list[SeqGroup]:
        """The requests whose constraint has compiled, their grammar set. Those whose
        constraint failed are dropped from `groups` and refused (a `RequestRejected` in the
        outbox: invalid_request, or overloaded when no compile thread was free in time;
        nothing else is said about them, no RequestUpdate); those no longer in `groups`
        (aborted meanwhile) are forgotten."""
        ready = []
        for rid, (group, handle) in list(self._compiling.items()):
            if groups.get(rid) is not group:  # aborted while it compiled
                del self._compiling[rid]
                continue
            try:
                grammar = self.compiler.outcome(handle)
            except (ValueError, CompilerBusy) as e:
                del self._compiling[rid], groups[rid]
                code = (ErrorCode.OVERLOADED if isinstance(e, CompilerBusy)
                        else ErrorCode.INVALID_REQUEST)
                self.outbox.append(RequestRejected(rid, code, str(e)))
                continue
            if grammar is not None:
                del self._compiling[rid]
                group.set_grammar(grammar)
                ready.append(group)
        return ready

    @property
    def pending(self) -> int:
        """Requests waiting for their constraint."""
        return len(self._compiling)
