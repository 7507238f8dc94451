"""Hypothesis state machine: random insert/match/lock/unlock/pin/unpin/evict/flush against a
model.

The model is brute force and independent of the tree: a dict from every cached
page-aligned prefix (as a tuple: its namespace, then its tokens) to the block holding its
last page. Sequences come from a tiny alphabet and extend earlier ones, so prefixes
collide and edges split often; each operation picks one of a few namespaces (tenants), so
the same tokens are cached in several and must never be matched across them.

A subscriber (a router's view) keeps a set of page hashes from the tree's events alone,
drained at random moments and sometimes reset from a snapshot taken between two drains;
after each drain it must equal the hashes of the model's prefixes.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.cache import BlockAllocator, RadixCache, RadixNode
from radixserve.cache.events import page_hashes

NUM_BLOCKS = 40
Prefix = tuple  # (namespace, *tokens)
NAMESPACES = st.sampled_from([None, None, "a", "b"])


def path_of(cache: RadixCache, node: RadixNode) -> Prefix:
    parts, namespace = [], None
    while not node.is_root:
        parts.append(node.tokens.tolist())
        namespace = node.namespace if node.is_namespace else namespace
        node = cache.tree.parent(node)
    return (namespace, *(t for part in reversed(parts) for t in part))


def key(ns: str | None, tokens: Sequence[int]) -> Prefix:
    return (ns, *tokens)


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    alphabet = 3

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(NUM_BLOCKS)
        self.cache = RadixCache(self.alloc, self.page_size, record_events=True)
        self.view: set[int] = set()  # a subscriber's set, from events and snapshots only
        self.model: dict[Prefix, int] = {}
        self.seqs: list[list[int]] = []
        self.locks: list[tuple[RadixNode, Prefix]] = []  # held by "running requests"
        self.handles: list[tuple[RadixNode, Prefix]] = []  # returned, not locked
        self.pins: list[tuple[RadixNode, Prefix]] = []  # pinned (locks no request owns)

    # ------------------------------------------------------------------ helpers

    def _sequence(self, base: int, cut: int, suffix: list[int]) -> list[int]:
        start = self.seqs[base % len(self.seqs)][:cut] if self.seqs else []
        seq = start + [t % self.alphabet for t in suffix]
        self.seqs = (self.seqs + [seq])[-12:]
        return seq

    def _expected(self, ns: str | None, tokens: Sequence[int],
                  max_len: int | None = None) -> list[int]:
        """Blocks of the longest cached page-aligned prefix in `ns`, per the model."""
        ps = self.page_size
        limit = len(tokens) if max_len is None else max(0, min(max_len, len(tokens)))
        blocks = []
        for end in range(ps, limit - limit % ps + 1, ps):
            block = self.model.get(key(ns, tokens[:end]))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _alloc(self, n: int) -> list[int] | None:
        blocks = self.alloc.alloc(n)
        if blocks is None:
            self._evict(n - self.alloc.num_free)
            blocks = self.alloc.alloc(n)
        return blocks

    def _evict(self, n: int) -> None:
        evictable = self.cache.evictable_blocks
        held = self.locks + self.pins
        protected = {b for _, p in held for b in self._expected(p[0], p[1:])}
        freed = self.cache.evict(n)
        assert min(n, evictable) <= freed <= evictable
        gone = {p for p, b in self.model.items() if self.alloc.refcount(b) == 0}
        assert len(gone) == freed
        for p in gone:
            del self.model[p]
        # Leaves go first, so what remains is still prefix-closed...
        ps = self.page_size
        assert all(len(p) == ps + 1 or p[:-ps] in self.model for p in self.model)
        # ...and nothing on a locked or pinned path was touched.
        for _, p in held:
            assert len(self._expected(p[0], p[1:])) * ps == len(p) - 1, "evicted a locked prefix"
        # An eviction that ran out of candidates left no empty, unlocked namespace node.
        if freed < n:
            for ns, child in self.cache.root.children.items():
                assert not isinstance(ns, str) or child.children or child.lock_count
        assert all(self.alloc.refcount(b) >= 1 for b in protected)

    def _hold(self, node: RadixNode, prefix: Prefix, lock: bool) -> None:
        if lock:
            self.cache.lock(node)
            self.locks.append((node, prefix))
        else:
            self.handles = (self.handles + [(node, prefix)])[-8:]

    # ------------------------------------------------------------------ rules

    @rule(base=st.integers(0, 99), cut=st.integers(0, 24),
          suffix=st.lists(st.integers(0, 9), max_size=12), lock=st.booleans(), ns=NAMESPACES)
    def insert_fresh(self, base: int, cut: int, suffix: list[int], lock: bool,
                     ns: str | None) -> None:
        """A caller that computed everything itself: fresh blocks, duplicates freed."""
        seq = self._sequence(base, cut, suffix)
        tokens = seq[:len(seq) - len(seq) % self.page_size]
        blocks = self._alloc(len(tokens) // self.page_size)
        if blocks is None:
            return  # everything is locked; a real scheduler would retract
        cached = self._expected(ns, tokens)
        known = len(cached)
        r = self.cache.insert(tokens, blocks, namespace=ns)
        assert r.prefix_len == known * self.page_size
        assert r.blocks == cached + blocks[known:]
        self.alloc.free(blocks)  # the caller's references; the tree took its own
        for i in range(known, len(blocks)):
            self.model[key(ns, tokens[:(i + 1) * self.page_size])] = blocks[i]
        if tokens:
            assert path_of(self.cache, r.node) == key(ns, tokens)
            self._hold(r.node, key(ns, tokens), lock)

    @rule(base=st.integers(0, 99), cut=st.integers(0, 24),
          suffix=st.lists(st.integers(0, 9), max_size=12),
          max_len=st.none() | st.integers(0, 40), peek=st.booleans(), lock=st.booleans(),
          ns=NAMESPACES)
    def match(self, base: int, cut: int, suffix: list[int], max_len: int | None,
              peek: bool, lock: bool, ns: str | None) -> None:
        tokens = self._sequence(base, cut, suffix)
        expected = self._expected(ns, tokens, max_len)
        nodes = self.cache.num_nodes
        m = self.cache.match_prefix(tokens, max_len, peek=peek, namespace=ns)
        assert m.blocks == expected and m.length == len(expected) * self.page_size
        if max_len is not None:
            assert m.length <= max_len
        path = path_of(self.cache, m.node)
        if m.node.is_root:  # an empty match, in a namespace nothing is cached in
            assert m.length == 0
            path = key(ns, [])
        if peek:
            assert self.cache.num_nodes == nodes
            assert path[:m.length + 1] == key(ns, tokens[:m.length])
        else:
            assert path == key(ns, tokens[:m.length])
            self._hold(m.node, path, lock)

    @rule(base=st.integers(0, 99), cut=st.integers(0, 24),
          suffix=st.lists(st.integers(0, 9), max_size=12), keep=st.booleans(), ns=NAMESPACES)
    def request_lifecycle(self, base: int, cut: int, suffix: list[int], keep: bool,
                          ns: str | None) -> None:
        """match -> lock -> alloc the rest -> insert all -> lock new, unlock old."""
        seq = self._sequence(base, cut, suffix)
        tokens = seq[:len(seq) - len(seq) % self.page_size]
        m = self.cache.match_prefix(tokens, namespace=ns)
        self.cache.lock(m.node)
        held = (m.node, key(ns, tokens[:m.length]))
        self.locks.append(held)
        private = self._alloc(len(tokens) // self.page_size - len(m.blocks))
        if private is not None:
            r = self.cache.insert(tokens, m.blocks + private, namespace=ns)
            assert r.prefix_len == m.length and r.blocks == m.blocks + private
            self.alloc.free(private)
            for i, block in enumerate(private, start=len(m.blocks)):
                self.model[key(ns, tokens[:(i + 1) * self.page_size])] = block
            if keep and tokens:
                self._hold(r.node, key(ns, tokens), lock=True)
        self.locks.remove(held)
        self.cache.unlock(m.node)

    @precondition(lambda self: bool(self.locks))
    @rule(i=st.integers(0, 99))
    def unlock(self, i: int) -> None:
        node, prefix = self.locks.pop(i % len(self.locks))
        assert node.is_root or path_of(self.cache, node) == prefix  # splits never move an end
        self.cache.unlock(node)

    @precondition(lambda self: bool(self.handles))
    @rule(i=st.integers(0, 99))
    def lock_old_handle(self, i: int) -> None:
        node, prefix = self.handles.pop(i % len(self.handles))
        if node.is_root or self.cache.tree.is_live(node):
            assert node.is_root or path_of(self.cache, node) == prefix
            self._hold(node, prefix, lock=True)
        else:
            try:
                self.cache.lock(node)
            except ValueError:
                return
            raise AssertionError("locking an evicted node must raise")

    @rule(base=st.integers(0, 99), cut=st.integers(0, 24),
          suffix=st.lists(st.integers(0, 9), max_size=12), ns=NAMESPACES)
    def pin(self, base: int, cut: int, suffix: list[int], ns: str | None) -> None:
        """Pin what is cached of a sequence (a pin of an empty prefix is refused)."""
        m = self.cache.match_prefix(self._sequence(base, cut, suffix), namespace=ns)
        if m.node.is_root:
            try:
                self.cache.pin(m.node)
            except ValueError:
                return
            raise AssertionError("a pin of the root must raise")
        self.cache.pin(m.node)
        self.pins.append((m.node, path_of(self.cache, m.node)))

    @precondition(lambda self: bool(self.pins))
    @rule(i=st.integers(0, 99))
    def unpin(self, i: int) -> None:
        node, prefix = self.pins.pop(i % len(self.pins))
        assert path_of(self.cache, node) == prefix
        self.cache.unpin(node)

    def _pinned(self) -> set[Prefix]:
        """The model's prefixes that some pin holds (each on a pinned path)."""
        return {p for p in self.model for _, q in self.pins if q[:len(p)] == p}

    @rule(n=st.integers(0, 16))
    def evict(self, n: int) -> None:
        self._evict(n)

    @rule(roll=st.integers(0, 7))
    def flush(self, roll: int) -> None:
        if roll or self.locks:
            return  # rare, and only with nothing running
        kept = self._pinned()
        self.cache.flush()  # keeps exactly the pinned prefixes
        self.model = {p: b for p, b in self.model.items() if p in kept}
        self.handles.clear()
        assert self.alloc.num_free == NUM_BLOCKS - len(self.model)

    @rule()
    def drain_events(self) -> None:
        events = self.cache.take_events()
        if events.cleared:
            self.view.clear()
        self.view.difference_update(events.removed)
        self.view.update(events.stored)
        assert self.view == self._model_hashes()

    @rule()
    def snapshot(self) -> None:
        """A subscriber resyncing between two drains: the next drain must still fit."""
        self.view = set(self.cache.page_hashes_in_tree())

    def _model_hashes(self) -> set[int]:
        return {page_hashes(p[1:], self.page_size, p[0])[-1] for p in self.model}

    # ------------------------------------------------------------------ invariants

    @invariant()
    def consistent(self) -> None:
        cache, alloc = self.cache, self.alloc
        cache.check_invariants()
        assert alloc.num_free + cache.evictable_blocks + cache.locked_blocks == NUM_BLOCKS
        assert sorted(cache.all_blocks()) == sorted(self.model.values())
        assert cache.cached_tokens == len(self.model) * self.page_size
        assert sorted(cache.page_hashes_in_tree()) == sorted(self._model_hashes())
        for node, prefix in self.locks + self.pins:
            assert node.is_root or cache.tree.is_live(node)
            assert node.is_root or path_of(cache, node) == prefix
        assert cache.pinned_tokens == len(self._pinned()) * self.page_size


class RadixMachinePage4(RadixMachine):
    page_size = 4
    alphabet = 2


_settings = settings(max_examples=120, stateful_step_count=50, deadline=None)
TestRadixPage1 = RadixMachine.TestCase
TestRadixPage1.settings = _settings
TestRadixPage4 = RadixMachinePage4.TestCase
TestRadixPage4.settings = _settings
