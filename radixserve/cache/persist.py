"""The tree's index on disk, for a warm restart: which prefixes the disk tier holds.

`save_index` writes every node whose KV is on disk along with its whole path (a node on disk
below one in memory is left out: a restart could not reach it); `restore_index` puts them
back into an empty tree as disk nodes, under the same namespaces, with their LRU order.
A store written for another model is not this model's KV: `open_store` checks the
fingerprint (weights, config, dtype, page size; see worker/kv_disk.py) and the block size,
and empties the directory, with one log line, when they differ. Files no index names
(a crash between writing a file and the next save) are deleted.

The index is written as the KV files are: to an unpredictable temporary name, fsync'd,
renamed, mode 0600 (`disk_layout.PinnedDir.write_temp`); it is read without following a
symbolic link. Every operation goes through the directory as it was pinned at start
(`disk_layout.pinned`), never through its path again. Page hashes are not saved:
restoring recomputes them from the tokens, as inserting would.
"""

from __future__ import annotations

import fcntl
import logging
import os
from array import array
from pathlib import Path
from typing import IO

import msgspec

from radixserve.cache.node import RadixNode
from radixserve.cache.radix import RadixCache
from radixserve.disk_layout import (INDEX_NAME, LOCK_NAME, TEMP_SUFFIX, PinnedDir, entry_dirs,
                                   entry_name, entry_of, pinned)
from radixserve.messages import decode

log = logging.getLogger(__name__)
VERSION = 1
MAX_INDEX_BYTES = 1 << 30


class SavedNode(msgspec.Struct, array_like=True):
    parent: int
    """Index of its parent in `SavedTree.nodes`, or -1: right below its namespace's root."""
    namespace: str | None
    tokens: bytes
    """Its edge's token ids, as `array("q")` bytes."""
    entry: int
    last_access: int


class SavedTree(msgspec.Struct, kw_only=True):
    version: int
    fingerprint: str
    page_size: int
    bytes_per_block: int
    next_entry: int
    nodes: list[SavedNode]


_INDEX = msgspec.msgpack.Decoder(SavedTree)


def lock_store(directory: Path) -> IO[bytes]:
    """Take the directory for this process (one server per disk store); keep the returned
    file open for as long as it is used. RuntimeError naming the directory if taken, or if
    its lock file is a symbolic link; ValueError if the directory is not private
    (`disk_layout.pin`)."""
    store = pinned(directory)
    path = store.path / LOCK_NAME
    try:
        f = os.fdopen(store.create_private(LOCK_NAME, os.O_RDWR), "r+b")
    except OSError as e:
        raise RuntimeError(f"kv_disk_dir lock file {path} cannot be opened ({e}); if it is a "
                           "symbolic link, remove it") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RuntimeError(f"kv_disk_dir {directory} is in use by another radixserve server "
                           "(each server needs its own directory)") from None
    return f


def open_store(directory: Path, cache: RadixCache, fingerprint: str, vocab_size: int,
               tp_size: int = 1) -> None:
    """Resume `cache` (empty, with a disk tier) from the index in `directory`, if there is one
    for this model, and delete every KV file that the resumed tree does not name (every
    rank's, `tp_size` of them: `disk_layout.entry_dirs`). The index
    is read as untrusted bytes: a node with a token id outside `[0, vocab_size)` is skipped
    (a tampered index must not put ids in the tree that no prompt can hold, and that the
    front door could not turn into text)."""
    disk = cache.disk
    assert disk is not None and cache.num_nodes == 0
    store = pinned(directory)
    saved = _read_index(store)
    if saved is not None:
        if (saved.fingerprint, saved.page_size, saved.bytes_per_block) != (
                fingerprint, cache.page_size, disk.bytes_per_block):
            log.warning("kv_disk_dir %s holds the KV of another model (or dtype or page size): "
                        "starting with an empty disk tier", directory)
        else:
            restored = _restore([pinned(d) for d in entry_dirs(directory, tp_size)], cache,
                                saved, vocab_size)
            log.info("kv_disk_dir %s: resumed %d cached prefix nodes (%d tokens) on disk",
                     directory, restored, cache.disk_tokens)
        disk.next_id = max(disk.next_id, saved.next_entry)
    for folder in {store, *(pinned(d) for d in entry_dirs(directory, tp_size))}:
        for name in folder.names():
            entry = entry_of(name)
            if (entry is not None and entry not in disk.entries) or name.endswith(TEMP_SUFFIX):
                folder.unlink(name)


def save_index(directory: Path, cache: RadixCache, fingerprint: str) -> int:
    """Write the index of every node on disk reachable through disk nodes alone; returns
    how many it names."""
    disk = cache.disk
    assert disk is not None
    nodes: list[SavedNode] = []
    index: dict[int, int] = {}
    stack = list(cache.root.children.values())
    while stack:
        node = stack.pop()
        if node.is_namespace:
            stack.extend(node.children.values())
            continue
        if not node.on_disk:
            stack.extend(node.children.values())  # its disk children are unreachable later
            continue
        parent = cache.tree.parent(node)
        if parent.on_disk:
            at = index.get(parent.id)
            if at is None:
                continue
        elif parent.is_root or parent.is_namespace:
            at = -1
        else:
            continue
        index[node.id] = len(nodes)
        ns = parent.namespace if at == -1 else nodes[at].namespace
        nodes.append(SavedNode(at, ns, node.tokens.tobytes(), node.disk_id, node.last_access))
        stack.extend(node.children.values())
    saved = SavedTree(version=VERSION, fingerprint=fingerprint, page_size=cache.page_size,
                      bytes_per_block=disk.bytes_per_block, next_entry=disk.next_id,
                      nodes=nodes)
    store = pinned(directory)
    store.write_whole(INDEX_NAME, msgspec.msgpack.encode(saved))
    return len(nodes)


def _read_index(store: PinnedDir) -> SavedTree | None:
    path = store.path / INDEX_NAME
    try:
        saved = decode(_INDEX, store.read_bounded(INDEX_NAME, MAX_INDEX_BYTES))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, msgspec.DecodeError) as e:
        log.warning("kv disk index %s unreadable (%s): starting with an empty disk tier", path, e)
        return None
    if saved.version != VERSION:
        log.warning("kv disk index %s has version %d, not %d: starting with an empty disk tier",
                    path, saved.version, VERSION)
        return None
    return saved


def _restore(dirs: list[PinnedDir], cache: RadixCache, saved: SavedTree, vocab_size: int) -> int:
    """Add `saved`'s nodes to `cache` as disk nodes; those that make no sense (a bad parent,
    a partial page, a token id outside the vocabulary, a duplicate child, an entry named
    twice or with no file) are skipped, with what lies below them."""
    disk = cache.disk
    assert disk is not None
    cache.tree.advance_clock(max((n.last_access for n in saved.nodes), default=0) + 1)
    made: list[RadixNode | None] = []
    for n in saved.nodes:
        node = None
        tokens = array("q")
        tokens.frombytes(n.tokens[:len(n.tokens) // 8 * 8])
        parent = (cache.tree.namespace_node(n.namespace, create=True) if n.parent == -1
                  else made[n.parent] if 0 <= n.parent < len(made) else None)
        if (parent is not None and tokens and len(tokens) % cache.page_size == 0
                and len(n.tokens) % 8 == 0 and 0 <= min(tokens)
                and max(tokens) < vocab_size and n.entry not in disk.entries
                and cache.tree.child_key(tokens, 0) not in parent.children
                and n.last_access <= (parent.last_access if parent.on_disk else cache.tree.clock)
                and all(d.exists(entry_name(n.entry)) for d in dirs)):
            node = cache.restore_disk_node(parent, tokens, n.entry, n.last_access)
        made.append(node)
    cache.make_disk_room(0)  # the store may have been made smaller
    disk.take_transfers()  # those files are deleted by open_store: nothing for the worker
    return sum(node is not None and cache.tree.is_live(node) for node in made)
