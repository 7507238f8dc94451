"""Naming requests, for every surface (RPC front door, HTTP, OpenAI, Engine, router).

A request's rid is the caller's to choose; one it does not name gets `mint_rid`'s. Inside a
server and in a router's books a rid goes by `scoped_rid(tenant, rid)`, so that two
tenants may pick the same one and neither reaches the other's, and `RidsInFlight` is the
one place that refuses a rid already in flight within a tenant.
"""

from __future__ import annotations

import uuid
from typing import Generic, Hashable, Iterable, TypeVar

Owner = TypeVar("Owner", bound=Hashable)


def mint_rid(kind: str = "req") -> str:
    """A fresh rid no caller has chosen: `kind-<32 hex digits>` (random, so that a rid
    seen in a log or a result tells nothing about any other request)."""
    return f"{kind}-{uuid.uuid4().hex}"


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

    def check_free(self, tenant: str, rids: Iterable[str]) -> None:
        """ValueError naming the first of `rids` (the caller's names) in flight already."""
        taken = next((r for r in rids if scoped_rid(tenant, r) in self.owners), None)
        if taken is not None:
            raise ValueError(f"rid {taken!r} is already in use")

    def claim(self, tenant: str, rids: Iterable[str], owner: Owner) -> list[str]:
        """Record `rids` (free: `check_free` first) as `owner`'s; returns their scoped names."""
        scoped = [scoped_rid(tenant, r) for r in rids]
        for name in scoped:
            self.owners[name] = owner
        return scoped

    def owner(self, tenant: str, rid: str) -> Owner | None:
        return self.owners.get(scoped_rid(tenant, rid))

    def owner_of_scoped(self, scoped: str) -> Owner | None:
        return self.owners.get(scoped)

    def release(self, scoped: Iterable[str], owner: Owner) -> None:
        """Forget the scoped rids still recorded as `owner`'s."""
        for name in scoped:
            if self.owners.get(name) == owner:
                del self.owners[name]
