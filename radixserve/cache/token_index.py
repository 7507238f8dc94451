"""The tree's side of a token index: every token sequence that enters or leaves the tree,
told to an index with the context before it (speculative/suffix_index.py is one).

`RadixCache` is composed with one of two, as with its event log: `IndexFeed`, over a
`TokenIndex`, or `NoIndexFeed` (no index, or a disabled cache). What the index is told:

- a leaf added by an insert or restored from disk: its namespace, its edge's tokens and the
  last ``max_context`` tokens of the path above it (``added``);
- each node that leaves the tree (evicted, dropped from disk, flushed around pins), told
  before the tree detaches it, while its path is still there (``removing``);
- the tree emptied (``cleared``).

A split changes no position's tokens or context, and a spill to disk keeps the node in the
tree, so neither is told. The index may refuse an add (it is full): the node remembers
(``RadixNode.indexed``, which a split hands to both halves) and its removal is not told.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from radixserve.cache.node import Namespace, RadixNode
from radixserve.cache.tree import RadixTree


class TokenIndex(Protocol):
    """What the tree feeds (speculative/suffix_index.py `SuffixIndex` is one)."""

    max_context: int
    """How many tokens before a sequence the index needs (the feed sends no more)."""

    def add(self, namespace: Namespace, context: Sequence[int], tokens: Sequence[int]) -> bool:
        """``tokens`` entered the tree after ``context``; False: not indexed (full)."""

    def remove(self, namespace: Namespace, context: Sequence[int],
               tokens: Sequence[int]) -> None:
        """The inverse of the adds of these positions."""

    def clear(self) -> None:
        """The tree was emptied."""


class IndexFeed:
    """Tells ``index`` what enters and leaves ``tree`` (see the module docstring)."""

    def __init__(self, tree: RadixTree, index: TokenIndex) -> None:
        self.tree, self.index = tree, index

    def added(self, node: RadixNode) -> RadixNode:
        """``node``, a new leaf, entered the tree; returns it."""
        namespace, context = self._above(node)
        node.indexed = self.index.add(namespace, context, node.tokens)
        return node

    def removing(self, top: RadixNode) -> None:
        """``top`` and its subtree are about to be detached."""
        k = self.index.max_context
        namespace, context = self._above(top)
        stack = [(top, context)]
        while stack:
            node, context = stack.pop()
            if node.indexed:
                self.index.remove(namespace, context, node.tokens)
            if node.children:
                below = (context + node.tokens.tolist())[-k:]
                stack.extend((child, below) for child in node.children.values())

    def cleared(self) -> None:
        self.index.clear()

    def _above(self, node: RadixNode) -> tuple[Namespace, list[int]]:
        """``node``'s namespace (its own, for a namespace node) and the last ``max_context``
        tokens of the path above it (the walk goes up to the root's child, which names the
        namespace, but copies only as many edges' tokens as that takes)."""
        k, parts, have, top = self.index.max_context, [], 0, node
        for top in self.tree.path(self.tree.parent(node)):
            if have < k and top.tokens:
                parts.append(top.tokens[-(k - have):].tolist())
                have += len(parts[-1])
        return top.namespace, [t for part in reversed(parts) for t in part]


class NoIndexFeed:
    """An `IndexFeed` for a cache that feeds no index."""

    def added(self, node: RadixNode) -> RadixNode:
        return node

    def removing(self, top: RadixNode) -> None:
        pass

    def cleared(self) -> None:
        pass
