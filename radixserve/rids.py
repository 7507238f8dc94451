"""Naming a call's requests, for every surface (RPC front door, HTTP, OpenAI, Engine,
router): decided here only.

A generate call passes one prompt or a batch (`is_single`), of at most `MAX_BATCH`
(`check_batch_size`). A request's rid is the caller's to choose; one it does not name gets
`mint_rid`'s (`name_prompts` names every prompt of a call, so that each can be aborted).
An output is named `output_name(rid, index, count)` in results (`answer_names`: a call's). Inside a
server and in a router's books a rid goes by `scoped_rid(tenant, rid)`, so that two tenants may pick
the same one and neither reaches the other's, and `RidsInFlight` is the one place that
refuses a rid already in flight within a tenant.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Generic, Hashable, Iterable, TypeVar

from radixserve.messages.fields import MAX_BATCH
from radixserve.messages.sampling import SamplingParams

Owner = TypeVar("Owner", bound=Hashable)


def mint_rid(kind: str = "req") -> str:
    """A fresh rid no caller has chosen: `kind-<32 hex digits>` (random, so that a rid
    seen in a log or a result tells nothing about any other request)."""
    return f"{kind}-{uuid.uuid4().hex}"


def is_single(prompt: Any, input_ids: Any) -> bool:
    """Whether a call passes one prompt (a string, or a flat list of token ids) rather than
    a batch."""
    if prompt is not None:
        return isinstance(prompt, str)
    return isinstance(input_ids, list) and all(isinstance(t, int) for t in input_ids)


def check_batch_size(count: int, where: str = "the batch") -> None:
    """Refuse a batch of more than `MAX_BATCH` prompts before anything is made per prompt
    (rids, requests). The decoder bounds every list of a call so but one: a batch of
    token-id lists, whose outer list may instead be one prompt's ids (`MAX_INPUT_IDS`)."""
    if count > MAX_BATCH:
        raise ValueError(f"{where} holds {count} prompts, more than the {MAX_BATCH} a call "
                         "may pass")


def output_name(rid: str, index: int, count: int) -> str:
    """An output's id in results: the request's rid, or `rid:index` when it has several.
    Only ever formatted, never parsed: updates carry `(rid, index)`."""
    return rid if count == 1 else f"{rid}:{index}"


def answer_names(rids: list[str], sampling_params: SamplingParams | list[SamplingParams] | None,
                 batch: bool) -> tuple[list[str], bool]:
    """Every answer's id in a call's result (`output_name` of each prompt's rid) and
    whether the result is a list (a batch, or a prompt with several answers). A prompt
    gives `n` answers, but one for SGLang's beam search (`beam_width`), whose beams come
    inside that one. Only for a call the server accepted: `n` is then within its limits."""
    params = sampling_params if isinstance(sampling_params, list) else (
        [sampling_params] * len(rids))
    counts = [1 if p is None or p.beam_search else p.n for p in params]
    names = [output_name(r, j, n) for r, n in zip(rids, counts) for j in range(n)]
    return names, batch or any(n > 1 for n in counts)


class NamingError(ValueError):
    """A call's prompts cannot be named: `field` is the argument at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class NamedPrompts:
    """A call's prompts, each named."""

    single: bool
    rids: list[str]
    """One per prompt: the caller's, or minted."""
    rid_arg: str | list[str]
    """The call's `rid` argument naming them (a list for a batch, or as the caller gave)."""


def name_prompts(prompt: Any, input_ids: Any, rid: str | list[str] | None,
                 kind: str) -> NamedPrompts:
    """Name every prompt of a call (minting `kind-...` rids where the caller gave none), so
    that each can be aborted; the batch's size is checked before a rid is made.
    NamingError naming the field at fault."""
    if (prompt is None) == (input_ids is None):
        raise NamingError("text", "pass exactly one of text or input_ids")
    field, prompts = ("text", prompt) if prompt is not None else ("input_ids", input_ids)
    single = is_single(prompt, input_ids)
    count = 1 if single else len(prompts)
    if not single:
        try:
            check_batch_size(count, field)
        except ValueError as e:
            raise NamingError(field, str(e)) from None
    if rid is None:
        rids = [mint_rid(kind) for _ in range(count)]
    elif isinstance(rid, list):
        rids = rid
    elif not single:
        raise NamingError("rid", "rid must be a list with one entry per prompt")
    else:
        rids = [rid]
    return NamedPrompts(single, rids, rids if not single or isinstance(rid, list) else rids[0])


def scoped_rid(tenant: str, rid: str) -> str:
    """The name a tenant's request goes by inside a server (scheduler, front door) and in a
    router's books: rids are the caller's to choose, so two tenants may pick the same one,
    and neither may reach the other's by it (an abort finds only `scoped_rid(its caller's
    tenant, rid)`). Tenant names never contain `/`, so no two (tenant, rid) pairs share a
    name; callers only ever see their own rid."""
    return f"{tenant}/{rid}"


class RidsInFlight(Generic[Owner]):
    """Which call owns each request in flight, by scoped rid: the one place a rid already
    in use within a tenant is refused (a server's front door and a router alike; an abort
    could not tell which call it means)."""

    def __init__(self) -> None:
        self.owners: dict[str, Owner] = {}
        """The owner of each request in flight, by its scoped rid."""

    def check_free(self, tenant: str, rids: Iterable[str]) -> None:
        """ValueError naming the first of `rids` (the caller's names) in flight already: for
        a caller that must know before it can claim them (`claim` checks too)."""
        for rid in rids:
            if scoped_rid(tenant, rid) in self.owners:
                raise ValueError(f"rid {rid!r} is already in use")

    def claim(self, tenant: str, rids: list[str], owner: Owner) -> list[str]:
        """Record `rids` (the caller's names) as `owner`'s; returns their scoped names
        (`scoped_rid`). ValueError naming the first in flight already, and none recorded."""
        scoped = [scoped_rid(tenant, r) for r in rids]
        for rid, name in zip(rids, scoped):
            if name in self.owners:
                raise ValueError(f"rid {rid!r} is already in use")
        for name in scoped:
            self.owners[name] = owner
        return scoped

    def owner(self, tenant: str, rid: str) -> Owner | None:
        return self.owners.get(scoped_rid(tenant, rid))

    def of_tenant(self, tenant: str | None) -> list[str]:
        """The scoped rids in flight of `tenant`, or of every tenant (None)."""
        prefix = "" if tenant is None else scoped_rid(tenant, "")
        return [name for name in self.owners if name.startswith(prefix)]

    def release(self, scoped: Iterable[str], owner: Owner) -> None:
        """Forget the scoped rids still recorded as `owner`'s."""
        for name in scoped:
            if self.owners.get(name) == owner:
                del self.owners[name]
