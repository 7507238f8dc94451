"""Full recount of a radix cache's structure, for tests and idle-time debug assertions
(`RadixCache.check_invariants`).

Kept apart from the tree because it reads every node (O(tree)): the tree itself only ever
does incremental bookkeeping, and this is the independent check of that bookkeeping. It
reads the tree, the disk tier's books and the allocator through their public API only.
"""

from __future__ import annotations

from radixserve.cache.allocator import BlockAllocator
from radixserve.cache.disk import DiskTier
from radixserve.cache.events import page_hashes
from radixserve.cache.lru import order_of
from radixserve.cache.node import DISK_LRU, MEMORY_LRU, ROOT_ID, RadixNode
from radixserve.cache.tree import RadixTree


def _fail(msg: str) -> None:
    raise AssertionError(msg)


def check_radix_invariants(tree: RadixTree, allocator: BlockAllocator, disk: DiskTier | None,
                           pinned_tokens: int) -> None:
    """Raise AssertionError naming the first broken invariant of ``tree``, whose blocks are
    ``allocator``'s, whose disk nodes are ``disk``'s entries and whose pins hold
    ``pinned_tokens`` tokens."""
    ps = tree.page_size
    root = tree.root
    nodes = {node.id: node for node in tree.nodes()}
    if nodes.get(ROOT_ID) is not root or len(root.tokens) or len(root.blocks) or len(root.hashes):
        _fail("root missing from the node table, or root holds tokens")
    if root.lock_count:
        _fail(f"root has lock count {root.lock_count}")

    # Walk down from the root (iteratively: trees can be deep) and check each edge.
    seen: dict[int, RadixNode] = {ROOT_ID: root}
    evictable = locked = tokens = pinned = disk_tokens = 0
    leaves: set[tuple[int, int]] = set()
    disk_leaves: set[tuple[int, int]] = set()
    disk_entries: dict[int, int] = {}
    blocks: list[int] = []
    stack = [root]
    while stack:
        parent = stack.pop()
        child_locks = child_pins = resident = 0
        for key, child in parent.children.items():
            if child.id in seen:
                _fail(f"node {child.id} reached twice")
            seen[child.id] = child
            stack.append(child)
            child_locks += child.lock_count
            child_pins += child.pin_count
            n_tok, n_blk = len(child.tokens), len(child.blocks)
            if child.parent_id != parent.id:
                _fail(f"node {child.id} has parent_id {child.parent_id}, is under {parent.id}")
            if child.namespace is not None:  # a namespace node: empty edge, under the root
                if parent.id != ROOT_ID or n_tok or n_blk or len(child.hashes):
                    _fail(f"namespace node {child!r} is not an empty child of the root")
                if key != child.namespace or not isinstance(key, str):
                    _fail(f"namespace node {child.id} filed under key {key!r}")
            elif child.on_disk:  # whole pages, no blocks, one entry of its own
                if n_tok == 0 or n_tok % ps or n_blk or len(child.hashes) * ps != n_tok:
                    _fail(f"disk node {child!r}: {n_tok} tokens, {n_blk} blocks")
                if child.disk_id in disk_entries:
                    _fail(f"disk entry {child.disk_id} belongs to two nodes")
                disk_entries[child.disk_id] = len(child.hashes)
                if any(not c.on_disk for c in child.children.values()):
                    _fail(f"disk node {child.id} has a child in memory")
                disk_tokens += n_tok
            else:
                resident += 1
                if n_tok == 0:
                    _fail(f"empty non-root node {child!r}")
                if n_tok % ps or n_blk * ps != n_tok:
                    _fail(f"node {child.id}: {n_tok} tokens / {n_blk} blocks, page_size {ps}")
                first = child.tokens[0] if ps == 1 else tuple(child.tokens[:ps])
                if key != first:
                    _fail(f"node {child.id} filed under key {key!r}, first page is {first!r}")
                # By induction from the root, this checks every node against its whole path.
                path_hashes = (
                    page_hashes(child.tokens, ps, parent=parent.hashes[-1]) if parent.hashes
                    else page_hashes(child.tokens, ps, parent.namespace, key=tree.hash_key))
                if child.hashes.tolist() != path_hashes:
                    _fail(f"node {child.id}: page hashes differ from those of its path")
            if child.lock_count < 0:
                _fail(f"node {child.id} lock count {child.lock_count}")
            if not 0 <= child.pin_count <= child.lock_count:  # a pin is one of its locks
                _fail(f"node {child.id} pin count {child.pin_count}, lock {child.lock_count}")
            if child.pin_count:
                pinned += n_tok
            if parent.id != ROOT_ID and child.last_access > parent.last_access:
                _fail(f"node {child.id} accessed after its parent {parent.id} (LRU order)")
            if not child.on_disk:
                tokens += n_tok
            blocks.extend(child.blocks)
            if child.lock_count:
                locked += n_blk
            else:
                evictable += n_blk
            order = order_of(child)
            if child.filed != order:
                _fail(f"node {child!r} filed in order {child.filed}, belongs in {order}")
            if order == MEMORY_LRU:
                leaves.add((child.last_access, child.id))
            elif order == DISK_LRU:
                disk_leaves.add((child.last_access, child.id))
        if parent.id != ROOT_ID and parent.lock_count < child_locks:
            _fail(f"node {parent.id} lock {parent.lock_count} < children's sum {child_locks}")
        if parent.id != ROOT_ID and parent.pin_count < child_pins:
            _fail(f"node {parent.id} pin {parent.pin_count} < children's sum {child_pins}")
        if parent.resident_children != resident:
            _fail(f"node {parent.id}: {parent.resident_children} children in memory counted, "
                  f"{resident} found")

    if (seen.keys() != nodes.keys() or any(nodes[i] is not n for i, n in seen.items())
            or len(nodes) != tree.num_nodes + 1 or not all(map(tree.is_live, seen.values()))):
        _fail(f"node table ({tree.num_nodes + 1}) != nodes reachable from root ({len(seen)})")
    if (evictable, locked, tokens) != (tree.evictable_blocks, tree.locked_blocks,
                                       tree.cached_tokens):
        _fail(f"counters evictable/locked/tokens {tree.evictable_blocks}/"
              f"{tree.locked_blocks}/{tree.cached_tokens}, recount "
              f"{evictable}/{locked}/{tokens}")
    if pinned != pinned_tokens:
        _fail(f"pinned_tokens {pinned_tokens}, recount {pinned}")
    if disk_tokens != tree.disk_tokens:
        _fail(f"disk_tokens {tree.disk_tokens}, recount {disk_tokens}")
    for name, filed, want in (("evictable", MEMORY_LRU, leaves),
                              ("disk evictable", DISK_LRU, disk_leaves)):
        in_set = tree.eviction_order(filed)
        if len(in_set) != len(want) or set(in_set) != want:
            _fail(f"{name} set {sorted(set(in_set) ^ want)[:8]} differs from the nodes "
                  "that can go")
    if disk is None:
        if disk_entries:
            _fail("disk nodes in a tree without a disk tier")
    else:
        if disk.entries != disk_entries:
            extra = sorted(disk.entries.keys() ^ disk_entries.keys())[:8]
            _fail(f"disk entries and disk nodes differ: {extra} (or their sizes)")
        if disk.used_bytes != sum(disk_entries.values()) * disk.bytes_per_block:
            _fail(f"disk used_bytes {disk.used_bytes}, recount "
                  f"{sum(disk_entries.values()) * disk.bytes_per_block}")
        if disk.used_bytes > disk.capacity_bytes:
            _fail(f"disk tier over its capacity: {disk.used_bytes} > {disk.capacity_bytes}")
    if len(set(blocks)) != len(blocks):
        _fail("a block appears twice in the tree")
    hashes = tree.page_hashes_in_tree()
    if len(set(hashes)) != len(hashes):
        _fail("a page hash appears twice in the tree (one prefix cached twice, or a collision)")
    for b in blocks:
        if allocator.refcount(b) < 1:
            _fail(f"block {b} is in the tree but free in the allocator")
