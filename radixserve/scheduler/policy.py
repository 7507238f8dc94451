"""In which order waiting requests are offered a place in the next batch, and which of them
wait a little for a prefix another request is about to compute."""

from __future__ import annotations

from radixserve.cache.radix import RadixCache
from radixserve.scheduler.request import Req

# Past this many waiting requests, prefix matching every one of them each step costs more
# than the better ordering gains (SGLang makes the same cut).
LPM_MAX_QUEUE = 128
# A shared prefix shorter than this is cheaper to recompute than to wait for.
MIN_SHARED_PREFIX = 32


def order_waiting(policy: str, waiting: list[Req], tree: RadixCache) -> list[Req]:
    """`fcfs`: arrival order. `lpm`: longest cached prefix first (ties keep arrival order),
    so requests that share a prefix run while it is still cached. Each request's length is
    matched in its own namespace: another tenant's prefixes never move it up (but its
    place still depends on how much the others' requests hit in theirs; `fcfs` does not)."""
    if policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE or not tree.enabled:
        return list(waiting)
    lengths = {id(r): tree.match_prefix(r.tokens(0, r.seq_len), r.prefix_limit, peek=True,
                                        namespace=r.namespace).length
               for r in waiting}
    return sorted(waiting, key=lambda r: -lengths[id(r)])


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def waits_for_shared_prefix(req: Req, computing: list[Req], tree: RadixCache) -> bool:
    """True when a request still computing its prompt shares a prefix with `req` that is
    not cached yet: `req` then waits a step or a few and gets that prefix from the cache
    instead of computing the same tokens a second time (requests that arrive together with
    one system prompt, or the `n` samples of one prompt). Only requests of the same
    namespace count: another tenant's would never give `req` its prefix, and holding `req`
    back for it would tell `req`'s sender what that tenant is computing."""
    if not computing:
        return False
    cached = tree.match_prefix(req.input_ids, req.prefix_limit, peek=True,
                               namespace=req.namespace).length
    threshold = max(tree.page_size, MIN_SHARED_PREFIX)
    for other in computing:
        if other.namespace != req.namespace:
            continue  # its prefix will never be ours to take: waiting would only leak
        shared = common_prefix_len(req.input_ids, other.input_ids)
        if shared - cached >= threshold and other.kv.kv_len < shared:
            return True
    return False
