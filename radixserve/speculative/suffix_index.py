"""SuffixIndex: what the radix tree's token sequences say follows a sequence's tail.

In the manner of SuffixDecoding (arXiv 2411.04975): every position of every indexed sequence
counts its token under each of its contexts (the ``min_match`` to ``max_context`` tokens
before it); a proposal matches the longest suffix of a sequence's tail that the index knows,
takes the most frequent next token, appends it and repeats, while the chain stays likely
enough (`propose`). The
index is fed by the radix tree (cache/token_index.py), so it holds the prompts and outputs
of every request the tree holds, and forgets them when the tree evicts them. The tree holds
a shared prefix once, so counts are over the distinct sequences it holds, not requests.

Why counts by position: a position's counts depend only on its token and the
``max_context`` tokens before it. So ``remove`` is the exact inverse of ``add`` for the same
positions however they are grouped: the tree can split an edge between the two and remove
the halves separately, and the counts come out the same as if it had never added them.

Layout (why): the tree may hold millions of tokens, so there is no Python object per
(context, token) pair. A context is a 64-bit hash of its tokens (FNV-1a, rolled backward
from the position, so all lengths cost one multiply each; numpy rolls a whole sequence at
once), the key of one dict per namespace. Its value is a single int ``count | token << 32``
while one token has followed it, which is nearly always so for the longer contexts, and a
``{token: count}`` dict only once a second token has. A hash collision can only mislead a
draft, which verification rejects; it cannot leak another tenant's tokens, since each
namespace has its own dict.

Bound: ``max_tokens`` positions over all namespaces. An ``add`` that would pass it indexes
nothing and returns False (all or nothing, so the tree can remember which of its nodes are
indexed and never remove what was not added); room comes back as indexed tokens are
removed. We keep what is indexed rather than dropping the oldest because a drop could not
be undone by the tree's later ``remove`` of the same positions. The cost of that choice: a
tree that outgrows the bound and rarely evicts keeps proposing from its older contents.

Figures (bench/results/draft_sources.md; best of several runs on a
shared 2-core Xeon), defaults (contexts of 2 to 4 tokens, 3 counts per position):

    add / remove of a 2,048-token sequence      1.2 / 1.8 ms  (into an index of 300k tokens)
    RadixCache insert + evict of 2,048 tokens   0.22 ms alone, 3.2 ms feeding the index
    propose of 8 tokens from a 64-token tail    15 us (a known tail), 1 us (unknown)
    memory per indexed token                    209 B (code and docs), 241 B (random)

Why contexts of at most 4 (on held-out files of this repository, drafts of up to 8, the
index holding the rest): 1.581 tokens per step against 1.593 with contexts up to 8, whose
memory and time are 2.3 times as much (445 / 691 B per token): a long match that rests on
one occurrence (a share of 1.0) drafts long chains that miss, and precision fell from 0.140
to 0.125. Contexts of one token (``min_match=1``) gave 1.644
tokens per step, but a one-token context can have thousands of successors to rank at each
proposal step: worth it only where acceptance matters more than the scheduler's time.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

import numpy as np

from radixserve.cache.node import Namespace

_FNV_BASIS = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_PRIME = np.uint64(_FNV_PRIME)

Follow = int | dict[int, int]
"""What follows one context: ``count | token << 32`` (one token so far), or {token: count}."""


class SuffixIndex:
    """Counts of next tokens by context, per cache namespace; proposes likely chains.

    ``max_context``: the longest context counted and matched. ``min_match``: the shortest
    context a proposal may rest on (shorter ones are not counted at all). ``min_prob``: a
    chain stops once the product of its tokens' shares (count / its context's count) would
    fall below it, as SuffixDecoding scores its candidates. ``max_tokens``: the bound above.
    """

    def __init__(self, max_context: int = 4, min_match: int = 2, min_prob: float = 0.1,
                 max_tokens: int = 1 << 20) -> None:
        if not 1 <= min_match <= max_context:
            raise ValueError(f"need 1 <= min_match <= max_context, got {min_match}, "
                             f"{max_context}")
        self.max_context, self.min_match = max_context, min_match
        self.min_prob, self.max_tokens = min_prob, max_tokens
        self.tokens = 0
        """Positions indexed, over all namespaces."""
        self._tables: dict[Namespace, dict[int, Follow]] = {}

    # ---------------------------------------------------------------- feeding

    def add(self, namespace: Namespace, context: Sequence[int], tokens: Sequence[int]) -> bool:
        """Count ``tokens``, which follow ``context`` (the tokens before them on their path;
        only the last ``max_context`` matter). False, and nothing counted, when they would
        take the index past ``max_tokens``."""
        if self.tokens + len(tokens) > self.max_tokens:
            return False
        table = self._tables.setdefault(namespace, {})
        get = table.get
        for hashes, toks, packed in self._positions(context, tokens):
            for h, token, one in zip(hashes, toks, packed):
                entry = get(h)
                if entry is None:
                    table[h] = one
                elif isinstance(entry, int):
                    if entry >> 32 == token:
                        table[h] = entry + 1
                    else:
                        table[h] = {entry >> 32: entry & _MASK32, token: 1}
                else:
                    entry[token] = entry.get(token, 0) + 1
        self.tokens += len(tokens)
        if not table:
            del self._tables[namespace]
        return True

    def remove(self, namespace: Namespace, context: Sequence[int],
               tokens: Sequence[int]) -> None:
        """Undo the counting of these positions (``add``'s, possibly grouped otherwise).
        Raises KeyError for counts that are not there: not the inverse of an add."""
        table = self._tables.get(namespace, {})
        for hashes, toks, _ in self._positions(context, tokens):
            for h, token in zip(hashes, toks):
                entry = table[h]
                if isinstance(entry, int):
                    if entry >> 32 != token:
                        raise KeyError(f"token {token} was not counted after context {h:#x}")
                    if entry & _MASK32 == 1:
                        del table[h]
                    else:
                        table[h] = entry - 1
                    continue
                count = entry[token] - 1
                if count:
                    entry[token] = count
                    continue
                del entry[token]
                if len(entry) == 1:  # back to the packed form, as if only that one was added
                    ((t, c),) = entry.items()
                    table[h] = c | t << 32
        self.tokens -= len(tokens)
        if not table and namespace in self._tables:
            del self._tables[namespace]

    def clear(self) -> None:
        """Forget everything (the tree was emptied)."""
        self._tables.clear()
        self.tokens = 0

    def _positions(self, context: Sequence[int], tokens: Sequence[int]
                   ) -> Iterator[tuple[list[int], list[int], list[int]]]:
        """For each counted context length n: the context hashes of the positions of
        ``tokens`` that have n tokens before them, their tokens, and each token's packed
        first count (``1 | token << 32``). The hashes are those `propose` rolls one position at
        a time, rolled here for all at once (numpy's uint64 arithmetic wraps as the mask)."""
        k, lo = self.max_context, self.min_match
        before = list(context[len(context) - k:] if len(context) > k else context)
        start, length = len(before), len(tokens)
        seq = np.array(before + list(tokens), dtype=np.uint64)
        toks = np.array(tokens, dtype=np.int64)
        tok_list, packed = toks.tolist(), (toks << 32 | 1).tolist()
        h = np.full(length, _FNV_BASIS, dtype=np.uint64)
        for n in range(1, k + 1):
            first = max(0, n - start)  # the positions before it have fewer than n
            if first >= length:
                return
            h[first:] = (h[first:] ^ seq[start + first - n:start + length - n]) * _PRIME
            if n >= lo:
                yield h[first:].tolist(), tok_list[first:], packed[first:]

    # ---------------------------------------------------------------- proposing

    def propose(self, namespace: Namespace, tail: Sequence[int], max_len: int) -> list[int]:
        """Up to ``max_len`` tokens likely to follow ``tail`` in ``namespace``: each the most
        frequent successor of the longest suffix (``min_match`` to ``max_context`` tokens)
        of the tail extended by the chain so far; ties go to the lower token id. Stops where
        no suffix is known or the chain's probability would fall below ``min_prob``."""
        table = self._tables.get(namespace)
        if not table or max_len <= 0:
            return []
        k = self.max_context
        seq = list(tail[len(tail) - k:] if len(tail) > k else tail)
        out: list[int] = []
        prob = 1.0
        while len(out) < max_len:
            found = self._longest(table, seq)
            if found is None:
                break
            ((token, share),) = _ranked(found, 1)
            prob *= share
            if prob < self.min_prob:
                break
            out.append(token)
            seq.append(token)
        return out

    def _longest(self, table: dict[int, Follow], seq: list[int]) -> Follow | None:
        """What follows the longest suffix of ``seq`` (``min_match`` to ``max_context``
        tokens) that ``table`` knows, or None."""
        found, h, j, lo = None, _FNV_BASIS, len(seq), self.min_match
        for n in range(1, min(self.max_context, j) + 1):  # shortest first: the longest wins
            h = ((h ^ seq[j - n]) * _FNV_PRIME) & _MASK64
            if n >= lo:
                entry = table.get(h)
                if entry is None:
                    break  # where a context was counted, each of its suffixes was too
                found = entry
        return found

    # ---------------------------------------------------------------- checks

    def snapshot(self) -> dict[Namespace, dict[int, dict[int, int]]]:
        """Every count as {namespace: {context hash: {token: count}}}: for comparing two
        indexes (tests: the index a tree fed equals one rebuilt from the tree)."""
        return {ns: {h: _counts(e) for h, e in table.items()}
                for ns, table in self._tables.items()}


def _counts(entry: Follow) -> dict[int, int]:
    return {entry >> 32: entry & _MASK32} if isinstance(entry, int) else dict(entry)


def _ranked(entry: Follow, n: int) -> list[tuple[int, float]]:
    """The ``n`` most frequent successors (the lower id first on a tie), each with its share
    of the count."""
    if isinstance(entry, int):
        return [(entry >> 32, 1.0)]
    total = sum(entry.values())
    best = heapq.nsmallest(n, entry.items(), key=lambda tc: (-tc[1], tc[0]))
    return [(token, count / total) for token, count in best]
