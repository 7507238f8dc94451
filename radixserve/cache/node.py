"""Radix-tree node and the small result records of `RadixCache`.

Memory layout choices (why): a cache holding millions of tokens must not hold millions of
Python objects. An edge keeps its tokens and block ids in two `array('q')` buffers (8
bytes per entry, one object per edge), and a node never points up to its parent: it
stores the parent's integer id, which the tree resolves through its `dict[int, node]`.
With references only going downward there are no reference cycles, so nodes die by
reference counting and the tree gives the cyclic garbage collector nothing to untangle.

Page hashes (cache/events.py): each edge also keeps the chained hash of each of its pages,
in a third `array('q')` parallel to its blocks, so the tree can name what enters and leaves
it to a router (`RadixCache.take_events`) and list itself (`page_hashes_in_tree`) without
rehashing anything. A page's hash names the whole prefix ending at it, namespace included.

Tiers (the disk tier, cache/disk.py): a node's KV is either in memory (``blocks``) or on
disk (``disk_id``, its entry in the disk store, with ``blocks`` empty), never both. Memory is
prefix-closed: a node in memory has every ancestor in memory, so the disk nodes are whole
subtrees at the bottom of the tree. A match walks memory nodes only; the disk nodes below
where it ends are what can be loaded back (`RadixCache.match_disk`).

Namespaces (tenants, `cache_salt`): the default namespace (`None`) is the root itself.
Any other namespace is a *namespace node*, a child of the root with an empty edge (no
tokens, no blocks: it never holds KV), filed in the root's children under the namespace
string itself, which can never equal a child key (an int or a tuple of ints). Every node of
that namespace lies below it, so the namespace is part of every key from the root and a
lookup in one namespace can never reach another's prefixes.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import TypeAlias

ChildKey: TypeAlias = int | tuple[int, ...] | str
"""A child's key in its parent: its first token (page_size 1) or its first page's tokens; a
namespace node's, in the root, is its namespace."""

Namespace: TypeAlias = str | None
"""A cache namespace: None (the default, the root) or an opaque non-empty string (the
server derives it from the tenant and the request's `cache_salt`; see server/tenants.py)."""

ROOT_ID = 0
NOT_ON_DISK = -1
"""`RadixNode.disk_id` of a node whose KV is in memory."""
UNFILED, MEMORY_LRU, DISK_LRU = 0, 1, 2
"""`RadixNode.filed`: which eviction order the node is in (see lru.py `order_of`)."""


class RadixNode:
    """One compressed edge of the tree: `tokens` and the `blocks` that hold their KV.

    `len(tokens) == len(blocks) * page_size` and is never 0 except at the root (and at
    namespace nodes). `hashes[i]` is `page_hashes` of the whole path from the root (in
    the node's namespace) up to and including page i of this edge. Callers
    get nodes as opaque handles (to pass to `lock`/`unlock`) and must not mutate them.

    A handle always means "the prefix that ends at this node": when an edge is split, the
    node object keeps the lower part (and its id), and a new node takes the upper part, so
    a handle held across a split still ends at the same token position.
    """

    __slots__ = ("id", "parent_id", "tokens", "blocks", "hashes", "children", "lock_count",
                 "pin_count", "hits", "last_access", "last_used", "namespace", "disk_id",
                 "resident_children", "filed", "indexed")

    def __init__(self, node_id: int, parent_id: int, tokens: array[int], blocks: array[int],
                 hashes: array[int], last_access: int, namespace: Namespace = None) -> None:
        self.id = node_id
        self.parent_id = parent_id  # -1 for the root; an int, not a reference (no cycles)
        self.tokens = tokens
        self.blocks = blocks
        self.hashes = hashes  # one per block: the page hash of the prefix ending there
        self.children: dict[ChildKey, RadixNode] = {}
        # How many locks are held on this node or below it; > 0 means "never evict".
        self.lock_count = 0
        # How many of those locks are pins (`RadixCache.pin`) on this node or below it.
        self.pin_count = 0
        # Requests whose cached prefix reached this node (for `RadixCache.summary` only).
        self.hits = 0
        # Logical clock value of the last match/insert through this node (LRU order).
        self.last_access = last_access
        # time.monotonic() of that access: reported to people, never used for ordering.
        self.last_used = 0.0
        # Set on a namespace node only (a root child with an empty edge); None elsewhere.
        self.namespace = namespace
        # The disk store's entry holding this edge's KV, or NOT_ON_DISK (KV in `blocks`).
        self.disk_id = NOT_ON_DISK
        # Children in memory: a node with none can leave memory (its subtree is on disk).
        self.resident_children = 0
        # Which eviction order holds it (UNFILED, MEMORY_LRU, DISK_LRU), kept by cache/lru.py.
        self.filed = UNFILED
        # Whether a token index counted this edge's tokens (cache/token_index.py).
        self.indexed = False

    @property
    def is_root(self) -> bool:
        return self.id == ROOT_ID

    @property
    def is_namespace(self) -> bool:
        """A namespace node: the empty-edged root child that every node of a non-default
        namespace lies below."""
        return self.namespace is not None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def on_disk(self) -> bool:
        return self.disk_id != NOT_ON_DISK

    def __repr__(self) -> str:
        ns = f", namespace={self.namespace!r}" if self.namespace is not None else ""
        ns += f", disk={self.disk_id}" if self.on_disk else ""
        return (f"RadixNode(id={self.id}{ns}, parent={self.parent_id}, tokens={len(self.tokens)}, "
                f"blocks={len(self.blocks)}, children={len(self.children)}, "
                f"lock={self.lock_count}, pin={self.pin_count}, t={self.last_access})")


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest cached, page-aligned prefix of a lookup.

    `blocks` hold the KV of `tokens[:length]` (one per page). They stay valid only while
    `node` is locked: lock it before anything can call `evict`.
    """

    blocks: list[int]
    node: RadixNode
    """Where the match ends (for an empty match: the root, or the namespace's node when the
    namespace has one). After a non-peek match it ends
    exactly at `length`. After a peek it is the node whose edge contains the end of the
    match, which may extend past `length` (the tree is not split by a peek)."""
    length: int


@dataclass(frozen=True, slots=True)
class DiskMatch:
    """The disk nodes that continue a memory match (`RadixCache.match_disk`), top down:
    loading them all back makes `length` more tokens of the lookup a memory hit."""

    nodes: list[RadixNode]
    length: int
    """Tokens of the lookup past the memory match that they cover (the last node's edge
    may reach past them)."""

    @property
    def pages(self) -> int:
        """Blocks a load of every node needs (whole edges)."""
        return sum(len(n.hashes) for n in self.nodes)


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What `insert` did with the caller's blocks."""

    prefix_len: int
    """Tokens of the inserted sequence that were already in the tree."""
    blocks: list[int]
    """The canonical blocks of the inserted sequence, one per page: the tree's own where it
    already held those tokens, else the caller's (which the tree now also holds). Where
    they differ from the caller's, the caller's block is a duplicate: swap it for the
    canonical one and drop it. They cover the whole sequence, except where a disk node that
    is being loaded holds part of the rest (see `RadixCache.insert`): then they stop there,
    and the caller keeps its own blocks for the tokens past them."""
    node: RadixNode
    """The node ending exactly where `blocks` end (lock it to keep it)."""
