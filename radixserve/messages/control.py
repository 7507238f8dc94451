"""Control operations on their way to the scheduler (ipc): the operation's own struct, as
the RPC call carries it, inside the envelope the transport adds (`Control`: the id its
answer names, and the caller as the front door resolved it from its key), and the answer.

There is no second, scheduler-side copy of an operation: the front door passes the
client's call on (its `api_key` dropped, prompts tokenized, paths resolved), and the
Engine builds the same structs in-process. Generate requests are not control operations:
they travel tokenized (`TokenizedRequest`).
"""

from __future__ import annotations

from msgspec import Struct

from radixserve.tenants import tenant_part

from radixserve.messages.fields import JsonObject
from radixserve.messages.rpc import (AbortCall, CacheInfoCall, CacheSnapshotCall,
                                     FlushCacheCall, LoadLoraCall, LorasCall, PinCall,
                                     ProfileCall, StatsCall, UnloadLoraCall, UnpinCall)


class CacheScope(Struct, array_like=True, frozen=True):
    """The cache namespaces a caller may see: every one when `prefix` is None, else those
    whose name starts with it (a tenant's: tenants.tenant_namespace_prefix), and the
    default namespace when `include_default`."""

    prefix: str | None = None
    include_default: bool = True

    def admits(self, namespace: str | None) -> bool:
        """Whether the caller sees `namespace` (a LoRA adapter's of a tenant's: the
        tenant's, tenants.tenant_part)."""
        if self.prefix is None:
            return True
        namespace = tenant_part(namespace)
        return self.include_default if namespace is None else namespace.startswith(self.prefix)



class Caller(Struct, array_like=True, frozen=True):
    """Who a control operation is for, resolved by the front door from the caller's key
    (radixserve/tenants.py); the Engine's caller is the operator, with every default."""

    namespace: str | None = None
    """The cache namespace of the operation's prefix (pin, unpin): the caller's tenant and
    the call's `cache_salt`."""
    scope: CacheScope = CacheScope()
    """The namespaces the caller may see (the cache view, unpin all)."""
    owner: str | None = None
    """The tenant a pin counts against (the front door's tag for it), or None: the
    operator's, bounded by `max_pinned_tokens` alone. Answers give the owner's total."""
    quota: int | None = None
    """Most tokens the owner's pins may hold together (`--max-pinned-tokens-per-tenant`)."""


ControlOp = (AbortCall | FlushCacheCall | StatsCall | CacheSnapshotCall | ProfileCall
             | PinCall | UnpinCall | CacheInfoCall | LoadLoraCall | UnloadLoraCall | LorasCall)
"""The operations the scheduler serves. Past the front door an op's `call_id` and
`api_key` mean nothing (the key is dropped); an abort's `rid` is scoped (`scoped_rid`), a
pin's and an unpin's prefix is `input_ids` (tokenized), a pin's `ttl` is within the
tenant's bounds, and a profile's `output_dir` is the resolved folder (None: a temp one)."""


class Control(Struct, tag=True):
    """A control operation for the scheduler, answered by a `ControlReply` naming
    `call_id` (an abort is not answered). A pin is answered once its prefix is prefilled
    (the scheduler prefills it first if it is not cached whole)."""

    call_id: int
    op: ControlOp
    caller: Caller = Caller()


class ControlReply(Struct, tag=True):
    call_id: int
    payload: JsonObject
    error: str | None = None
    """Set when the control call was refused (e.g. a profile stopped that never started)."""
