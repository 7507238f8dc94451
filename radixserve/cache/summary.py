"""A summary of a radix tree for people (`GET /cache`, `Client.cache_info`): its largest
and hottest prefixes, with just enough structure to draw them as a tree.

Token ids only: the cache has no tokenizer, so whoever shows the summary decodes
``head_ids`` (the first tokens of the whole prefix) and ``edge_ids`` (the first tokens of
the node's own edge) into text. O(tree), like `check_invariants`: for an occasional look,
not for the serving path.

Every node reports its ``tier`` (``"memory"``, or ``"disk"`` for a node the disk tier
holds), and ``totals`` has one entry per tier.
"""

from __future__ import annotations

import heapq
import time
from array import array
from typing import Any, Callable

from radixserve.cache.node import Namespace, RadixNode
from radixserve.cache.tree import RadixTree

HEAD_TOKENS = 24
"""Tokens of a prefix's start (and of an edge's) that a summary carries, for its text."""
TIERS = ("memory", "disk")
"""Every tier a summary's totals name."""


def summarize(tree: RadixTree, top: int, visible: Callable[[Namespace], bool]) -> dict:
    """The `top` largest prefixes (most tokens from the root) and the `top` hottest (most
    hits) among the nodes of the namespaces `visible` accepts, with their ancestors, in
    tree order (each node after its parent), and totals over all visible nodes.

    Returns ``{"nodes": [...], "totals": {tier: {"nodes", "tokens", "pinned_tokens",
    "hits"}}}``. A node entry: ``id``, ``parent`` (None right below a namespace's root),
    ``depth`` (0 there), ``namespace``, ``tokens`` (its edge), ``prefix_tokens`` (from the
    root to its end), ``hits``, ``last_use`` (Unix time), ``idle_seconds``, ``tier``,
    ``pinned``, ``locked`` (a running request holds it), ``head_ids``, ``edge_ids``."""
    if top < 0:
        raise ValueError(f"top must be >= 0, got {top}")
    now_mono, now_wall = time.monotonic(), time.time()
    entries: dict[int, dict[str, Any]] = {}
    order: list[int] = []
    totals = {tier: {"nodes": 0, "tokens": 0, "pinned_tokens": 0, "hits": 0} for tier in TIERS}
    # Depth-first from each visible namespace's start, carrying the prefix's head.
    stack: list[tuple[RadixNode, Namespace, int | None, int, int, array[int]]] = []
    for child in tree.root.children.values():
        ns = child.namespace
        if not visible(ns):
            continue
        if child.is_namespace:
            stack.extend((c, ns, None, 0, 0, array("q")) for c in child.children.values())
        else:
            stack.append((child, None, None, 0, 0, array("q")))
    while stack:
        node, ns, parent, depth, start, head = stack.pop()
        n = len(node.tokens)
        tier = "disk" if node.on_disk else "memory"
        if len(head) < HEAD_TOKENS:
            head = head + node.tokens[:HEAD_TOKENS - len(head)]
        entries[node.id] = {
            "id": node.id, "parent": parent, "depth": depth, "namespace": ns, "tokens": n,
            "prefix_tokens": start + n, "hits": node.hits,
            "last_use": now_wall - (now_mono - node.last_used),
            "idle_seconds": now_mono - node.last_used, "tier": tier,
            "pinned": node.pin_count > 0, "locked": node.lock_count > node.pin_count,
            "head_ids": head.tolist(), "edge_ids": node.tokens[:HEAD_TOKENS].tolist()}
        order.append(node.id)
        total = totals[tier]
        total["nodes"] += 1
        total["tokens"] += n
        total["hits"] += node.hits
        if node.pin_count:
            total["pinned_tokens"] += n
        stack.extend((c, ns, node.id, depth + 1, start + n, head)
                     for c in node.children.values())
    chosen = set(heapq.nlargest(top, order, key=lambda i: entries[i]["prefix_tokens"]))
    chosen.update(heapq.nlargest(top, order, key=lambda i: entries[i]["hits"]))
    for nid in list(chosen):  # with their ancestors, so the tree can be drawn
        parent = entries[nid]["parent"]
        while parent is not None and parent not in chosen:
            chosen.add(parent)
            parent = entries[parent]["parent"]
    return {"nodes": [entries[i] for i in order if i in chosen], "totals": totals}
