"""The disk tier in the radix tree, with integers: spill, load back, failed loads, inserts
through disk nodes, the disk's own LRU, flush, and the saved index.

A fake worker (`FakeWorker`) keeps what each block and each disk entry holds, as the
prefix (namespace, tokens up to and including the page) whose KV it is, and carries out
the tree's transfers in the worker's order (stores, loads, drops). So the state machine
can check the property that matters: every block the tree hands out holds the KV of
exactly the prefix it is filed under, in memory and after a round trip through disk.
"""

from __future__ import annotations

import logging
from array import array
from pathlib import Path

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from radixserve.cache import BlockAllocator, RadixCache, RadixNode
from radixserve.cache.disk import DiskTier
from radixserve.cache.persist import SavedTree, lock_store, open_store, save_index
from radixserve.disk_layout import entry_path
from tests.cache.test_radix_cache_stateful import path_of

Prefix = tuple


class FakeWorker:
    def __init__(self) -> None:
        self.kv: dict[int, Prefix] = {}
        self.files: dict[int, list[Prefix]] = {}
        self.corrupted: set[int] = set()

    def step(self, disk: DiskTier) -> list[int]:
        """Run the queued transfers; returns the entries that failed to load."""
        stores, loads, drops = disk.take_transfers()
        for t in stores:
            self.files[t.entry] = [self.kv.get(b) for b in t.blocks]
        failed = []
        for t in loads:
            if t.entry in self.corrupted or t.entry not in self.files:
                failed.append(t.entry)
                continue
            for b, content in zip(t.blocks, self.files[t.entry]):
                self.kv[b] = content
        for entry in drops:
            self.files.pop(entry, None)
        return failed


def page_prefixes(cache: RadixCache, node: RadixNode) -> list[Prefix]:
    """The prefix each page of `node`'s edge ends, as a block holding it must record."""
    end = path_of(cache, node)
    start = len(end) - len(node.tokens)
    ps = cache.page_size
    return [end[:start + (i + 1) * ps] for i in range(len(node.tokens) // ps)]


class Harness:
    """A tree with a disk tier and a fake worker, driven as the scheduler drives them."""

    def __init__(self, num_blocks: int = 12, page_size: int = 2, disk_pages: int = 20) -> None:
        self.alloc = BlockAllocator(num_blocks)
        self.disk = DiskTier(disk_pages * 100, 100)
        self.cache = RadixCache(self.alloc, page_size, record_events=True, disk=self.disk)
        self.worker = FakeWorker()
        self.ps = page_size

    def alloc_blocks(self, n: int) -> list[int] | None:
        blocks = self.alloc.alloc(n)
        if blocks is None:
            self.cache.evict(n - self.alloc.num_free)
            blocks = self.alloc.alloc(n)
        return blocks

    def load(self, node: RadixNode, tokens: list[int], length: int) -> int:
        """What KVManager.start_load + DiskLoads.finish do; returns tokens loaded."""
        dm = self.cache.match_disk(node, tokens, length)
        if not dm.nodes or dm.nodes[0].lock_count:
            return 0
        self.cache.lock(dm.nodes[-1])
        blocks = self.alloc_blocks(dm.pages)
        if blocks is None:
            self.cache.unlock(dm.nodes[-1])
            return 0
        entries = [n.disk_id for n in dm.nodes]
        self.cache.load(dm, blocks)
        failed = set(self.worker.step(self.disk))
        self.cache.unlock(dm.nodes[-1])
        ok, start, loaded = True, 0, 0
        for n, entry in zip(dm.nodes, entries):
            part = blocks[start:start + len(n.hashes)]
            start += len(n.hashes)
            if ok and entry in failed:
                self.cache.fail_load(n)
                ok = False
            if ok and self.cache.finish_load(n, part):
                loaded += len(n.tokens)
            else:
                self.alloc.free(part)
        return loaded

    def request(self, tokens: list[int], ns: str | None = None, load: bool = True) -> int:
        """One request: match, load from disk, compute the rest, insert. Returns the
        tokens it found cached (memory and disk)."""
        tokens = tokens[:len(tokens) - len(tokens) % self.ps]
        m = self.cache.match_prefix(tokens, namespace=ns)
        self.check_blocks(m.blocks, ns, tokens)
        self.cache.lock(m.node)  # as a waiting request's attach_prefix does
        if load and self.load(m.node, tokens, m.length):
            self.cache.unlock(m.node)  # the request waits; then it is attached anew
            m = self.cache.match_prefix(tokens, namespace=ns)
            self.check_blocks(m.blocks, ns, tokens)
            self.cache.lock(m.node)
        private = self.alloc_blocks(len(tokens) // self.ps - len(m.blocks))
        if private is not None:
            self.worker.step(self.disk)  # saves come before this step's writes
            for i, b in enumerate(private, start=len(m.blocks)):
                self.worker.kv[b] = (ns, *tokens[:(i + 1) * self.ps])
            r = self.cache.insert(tokens, m.blocks + private, namespace=ns)
            self.alloc.free(private)
            self.check_blocks(r.blocks, ns, tokens)
        self.cache.unlock(m.node)
        return m.length

    def check_blocks(self, blocks: list[int], ns: str | None, tokens: list[int]) -> None:
        for i, b in enumerate(blocks):
            assert self.worker.kv.get(b) == (ns, *tokens[:(i + 1) * self.ps]), \
                f"block {b} holds {self.worker.kv.get(b)}, not page {i} of {tokens}"

    def check(self) -> None:
        """The invariants, and every node's KV where the tree says it is."""
        self.cache.check_invariants()
        self.worker.step(self.disk)
        for node in self.cache.nodes():
            if node.is_root or node.is_namespace:
                continue
            want = page_prefixes(self.cache, node)
            if node.on_disk:
                assert self.worker.files.get(node.disk_id) == want, f"{node} on disk"
            else:
                assert [self.worker.kv.get(b) for b in node.blocks] == want, f"{node}"
        assert set(self.worker.files) == set(self.disk.entries)


class TestDiskTier:
    def test_an_evicted_prefix_stays_in_the_tree_on_disk_and_loads_back(self) -> None:
        h = Harness(num_blocks=8)
        a, b = list(range(100, 112)), list(range(200, 212))
        assert h.request(a) == 0
        assert h.request(b) == 0  # evicts a to disk
        assert h.cache.disk_tokens == 12 and h.disk.counters["disk_stores"] >= 1
        assert h.cache.match_prefix(a, peek=True).length == 0  # a memory match stops there
        assert h.request(a) == 12  # loaded back, then a hit
        assert h.disk.counters["disk_loads"] >= 1
        h.check()

    def test_a_failed_load_is_a_miss_and_drops_the_subtree(self) -> None:
        h = Harness(num_blocks=8)
        a = list(range(100, 112))
        h.request(a)
        h.request(list(range(200, 212)))
        h.check()
        (entry,) = [n.disk_id for n in h.cache.nodes() if n.on_disk]
        h.worker.corrupted.add(entry)
        assert h.request(a) == 0  # computed again, and correct
        assert h.disk.counters["disk_load_failures"] == 1
        h.check()
        assert h.request(a) == 12  # the recomputed KV is cached

    def test_an_insert_through_a_disk_node_takes_the_callers_blocks(self) -> None:
        h = Harness(num_blocks=8)
        a = list(range(100, 112))
        h.request(a)
        h.request(list(range(200, 212)))
        assert h.request(a, load=False) == 0  # recomputed: the disk copy is superseded
        assert h.cache.disk_tokens == 12  # b went to disk meanwhile; a is in memory
        assert h.cache.match_prefix(a, peek=True).length == 12
        h.check()

    def test_a_divergent_insert_drops_the_disk_node_it_runs_into(self) -> None:
        h = Harness(num_blocks=8)
        h.request(list(range(100, 112)))
        h.request(list(range(200, 212)))
        h.request(list(range(100, 104)) + [7, 7, 7, 7], load=False)
        h.check()

    def test_the_disk_keeps_its_own_lru_within_its_size(self) -> None:
        h = Harness(num_blocks=6, disk_pages=12)
        for base in range(100, 1000, 100):
            h.request(list(range(base, base + 12)))
            h.check()
        assert self_bytes(h) <= h.disk.capacity_bytes
        assert h.disk.counters["disk_drops"] > 0

    def test_flush_empties_both_tiers(self) -> None:
        h = Harness(num_blocks=8)
        h.request(list(range(100, 112)))
        h.request(list(range(200, 212)))
        h.cache.flush()
        h.check()
        assert h.cache.num_nodes == 0 and not h.worker.files and h.alloc.num_free == 8

    def test_namespaces_stay_apart_on_disk(self) -> None:
        h = Harness(num_blocks=8)
        a = list(range(100, 112))
        h.request(a, ns="alice")
        h.request(list(range(200, 212)), ns="bob")
        assert h.request(a, ns="bob") == 0
        assert h.request(a, ns="alice") == 12
        h.check()


def self_bytes(h: Harness) -> int:
    return sum(h.disk.entries.values()) * h.disk.bytes_per_block


class TestSavedIndex:
    def _spilled(self, tmp_path: Path) -> Harness:
        h = Harness(num_blocks=8)
        for base in (100, 200, 300):
            h.request(list(range(base, base + 12)), ns="alice" if base == 300 else None)
        h.cache.evict(10**9)
        h.worker.step(h.disk)
        for entry, content in h.worker.files.items():  # what the worker would have written
            entry_path(tmp_path, entry).write_bytes(repr(content).encode())
        return h

    def _resumed(self, tmp_path: Path, fingerprint: str = "model-a") -> RadixCache:
        cache = RadixCache(BlockAllocator(8), 2, disk=DiskTier(2000, 100))
        open_store(tmp_path, cache, fingerprint, vocab_size=1000)
        cache.check_invariants()
        return cache

    def test_a_restart_resumes_the_tree_on_disk(self, tmp_path: Path) -> None:
        h = self._spilled(tmp_path)
        assert save_index(tmp_path, h.cache, "model-a") == h.cache.num_nodes - 1  # namespace
        cache = self._resumed(tmp_path)
        assert sorted(cache.page_hashes_in_tree()) == sorted(h.cache.page_hashes_in_tree())
        assert cache.disk_tokens == 36 and cache.cached_tokens == 0
        m = cache.match_prefix(list(range(100, 112)))
        assert cache.match_disk(m.node, list(range(100, 112)), 0).length == 12
        assert cache.disk.next_id == h.disk.next_id

    def test_another_model_ignores_and_empties_the_store(self, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
        h = self._spilled(tmp_path)
        save_index(tmp_path, h.cache, "model-a")
        with caplog.at_level(logging.WARNING):
            cache = self._resumed(tmp_path, "model-b")
        assert cache.num_nodes == 0
        assert "another model" in caplog.text
        assert not list(tmp_path.glob("*.kv"))

    def test_missing_files_and_files_no_index_names(self, tmp_path: Path) -> None:
        h = self._spilled(tmp_path)
        save_index(tmp_path, h.cache, "model-a")
        first = min(h.disk.entries)
        entry_path(tmp_path, first).unlink()
        stray = entry_path(tmp_path, 999)
        stray.write_bytes(b"junk")
        cache = self._resumed(tmp_path)
        assert first not in cache.disk.entries and not stray.exists()

    def test_a_damaged_index_starts_empty(self, tmp_path: Path) -> None:
        h = self._spilled(tmp_path)
        save_index(tmp_path, h.cache, "model-a")
        (tmp_path / "index.msgpack").write_bytes(b"\x93garbage")
        assert self._resumed(tmp_path).num_nodes == 0

    def test_a_tampered_index_keeps_ids_outside_the_vocabulary_out(self, tmp_path: Path
                                                                    ) -> None:
        """Issue 25: a node whose tokens hold a negative or out-of-vocabulary id was put
        back in the tree, and the front door's `/cache` (which decodes them) crashed."""
        h = self._spilled(tmp_path)
        save_index(tmp_path, h.cache, "model-a")
        path = tmp_path / "index.msgpack"
        saved = msgspec.msgpack.decode(path.read_bytes(), type=SavedTree)
        roots = [n for n in saved.nodes if n.parent == -1]
        for node, bad in zip(roots, (-5, 1000)):  # vocab_size is 1000 in _resumed
            ids = array("q", node.tokens)
            ids[0] = bad
            node.tokens = ids.tobytes()
        path.write_bytes(msgspec.msgpack.encode(saved))
        cache = self._resumed(tmp_path)
        assert cache.num_nodes > 0 and all(
            0 <= t < 1000 for n in cache.nodes() for t in n.tokens)
        (tmp_path / "index.msgpack").write_bytes(b"\x91" * 100_000)  # nested, not a tree
        assert self._resumed(tmp_path).num_nodes == 0

    def test_one_server_per_directory(self, tmp_path: Path) -> None:
        held = lock_store(tmp_path)
        with pytest.raises(RuntimeError, match="in use by another radixserve server"):
            lock_store(tmp_path)
        held.close()
        lock_store(tmp_path).close()


class DiskMachine(RuleBasedStateMachine):
    """Random requests (several namespaces, shared prefixes), evictions, corrupted files and
    flushes over a small pool and a smaller disk."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(num_blocks=10, page_size=2, disk_pages=9)
        self.seqs: list[list[int]] = []
        self.view: set[int] = set()  # a router's view, from the tree's events alone

    @rule(base=st.integers(0, 99), cut=st.integers(0, 12),
          suffix=st.lists(st.integers(0, 2), max_size=10), ns=st.sampled_from([None, "a"]),
          load=st.booleans())
    def request(self, base: int, cut: int, suffix: list[int], ns: str | None,
                load: bool) -> None:
        start = self.seqs[base % len(self.seqs)][:cut] if self.seqs else []
        seq = start + suffix
        self.seqs = (self.seqs + [seq])[-10:]
        self.h.request(seq, ns, load)

    @rule(n=st.integers(0, 8))
    def evict(self, n: int) -> None:
        self.h.cache.evict(n)

    @rule(i=st.integers(0, 99))
    def corrupt(self, i: int) -> None:
        self.h.worker.step(self.h.disk)
        entries = sorted(self.h.worker.files)
        if entries:
            self.h.worker.corrupted.add(entries[i % len(entries)])

    @rule(roll=st.integers(0, 5))
    def flush(self, roll: int) -> None:
        if not roll:
            self.h.cache.flush()

    @invariant()
    def consistent(self) -> None:
        self.h.check()
        # A node on disk is still in the tree (a hit): only leaving the disk is an event.
        events = self.h.cache.take_events()
        if events.cleared:
            self.view.clear()
        self.view.difference_update(events.removed)
        self.view.update(events.stored)
        assert self.view == set(self.h.cache.page_hashes_in_tree())


TestDiskMachine = DiskMachine.TestCase
TestDiskMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
