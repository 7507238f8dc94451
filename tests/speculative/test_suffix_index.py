"""SuffixIndex (speculative/suffix_index.py): counts by context, chains, namespaces, bound."""

from __future__ import annotations

import random

import pytest

from radixserve.speculative.suffix_index import SuffixIndex


def test_the_most_frequent_continuation_is_proposed() -> None:
    index = SuffixIndex(max_context=4, min_match=2)
    for _ in range(3):
        index.add(None, [], [1, 2, 3, 4, 5])
    index.add(None, [], [1, 2, 3, 9, 9])
    assert index.propose(None, [7, 1, 2], 3) == [3, 4, 5]  # 3 of 4 went on with 4
    index.add(None, [], [1, 2, 3, 9, 9])
    index.add(None, [], [1, 2, 3, 9, 9])
    assert index.propose(None, [7, 1, 2], 3) == [3, 4, 5]  # 3 against 3: the lower id
    index.add(None, [], [1, 2, 3, 9, 9])
    assert index.propose(None, [7, 1, 2], 3) == [3, 9, 9]  # 4 against 3


def test_the_longest_known_suffix_decides() -> None:
    index = SuffixIndex(max_context=4, min_match=2)
    index.add(None, [], [5, 1, 2, 7])
    for _ in range(5):
        index.add(None, [], [6, 1, 2, 8])
    assert index.propose(None, [1, 2], 1) == [8]  # by the 2-token context: 8 (5 of 6)
    assert index.propose(None, [5, 1, 2], 1) == [7]  # the 3-token context knows better


def test_the_chain_stops_where_the_evidence_is_weak() -> None:
    index = SuffixIndex(max_context=4, min_match=2, min_prob=0.3)
    index.add(None, [], [1, 2, 3, 4])
    for t in (10, 11, 12, 13):  # after [3, 4]: four continuations, a quarter each
        index.add(None, [1, 2, 3, 4], [t])
    assert index.propose(None, [1, 2], 5) == [3, 4]
    assert index.propose(None, [8, 9], 5) == []  # nothing known
    assert index.propose(None, [1, 2], 0) == []


def test_context_decides_where_counting_starts() -> None:
    """Added after a context, tokens count under contexts that reach into it."""
    index = SuffixIndex(max_context=4, min_match=2)
    index.add(None, [1, 2], [3])
    assert index.propose(None, [1, 2], 1) == [3]
    assert index.propose(None, [2], 1) == []  # a 1-token context is below min_match


def test_namespaces_never_see_each_others_tokens() -> None:
    index = SuffixIndex(max_context=4, min_match=2)
    index.add("alice", [], [1, 2, 3, 4, 5])
    index.add("bob", [], [1, 2, 6, 7, 8])
    for _ in range(4):
        index.add(None, [], [1, 2, 9, 9, 9])
    assert index.propose("alice", [1, 2], 3) == [3, 4, 5]
    assert index.propose("bob", [1, 2], 3) == [6, 7, 8]
    assert index.propose(None, [1, 2], 3) == [9, 9, 9]
    assert index.propose("carol", [1, 2], 3) == []
    index.remove("alice", [], [1, 2, 3, 4, 5])
    assert index.propose("alice", [1, 2], 3) == []


def random_sequences(rng: random.Random, n: int) -> list[tuple[str | None, list[int], list[int]]]:
    """(namespace, context, tokens) with a small vocabulary, so contexts recur."""
    out = []
    for _ in range(n):
        context = [rng.randrange(5) for _ in range(rng.randrange(0, 12))]
        tokens = [rng.randrange(5) for _ in range(rng.randrange(1, 30))]
        out.append((rng.choice([None, "a", "b"]), context, tokens))
    return out


def test_remove_is_the_exact_inverse_of_add_however_the_positions_are_split() -> None:
    rng = random.Random(0)
    index = SuffixIndex(max_context=5, min_match=1)
    added = random_sequences(rng, 200)
    for ns, context, tokens in added:
        assert index.add(ns, context, tokens)
    rng.shuffle(added)
    # Each removed split at a random point, as a tree's edge would be, the halves in
    # either order.
    for ns, context, tokens in added:
        cut = rng.randrange(len(tokens) + 1)
        halves = [(context, tokens[:cut]), (context + tokens[:cut], tokens[cut:])]
        for c, t in (halves if rng.random() < 0.5 else halves[::-1]):
            index.remove(ns, c, t)
    assert index.snapshot() == {} and index.tokens == 0
    with pytest.raises(KeyError):
        index.remove(None, [], [1, 2])


def test_an_index_with_some_removed_equals_one_that_never_had_them() -> None:
    rng = random.Random(1)
    added = random_sequences(rng, 100)
    index, fresh = SuffixIndex(max_context=4), SuffixIndex(max_context=4)
    for ns, context, tokens in added:
        index.add(ns, context, tokens)
    for ns, context, tokens in added[50:]:
        fresh.add(ns, context, tokens)
    for ns, context, tokens in added[:50]:
        index.remove(ns, context, tokens)
    assert index.snapshot() == fresh.snapshot() and index.tokens == fresh.tokens
    for ns, context, tokens in added[50:]:  # and proposes the same
        tail = context + tokens
        assert index.propose(ns, tail, 4) == fresh.propose(ns, tail, 4)
        assert index.propose_tree(ns, tail, 6) == fresh.propose_tree(ns, tail, 6)
        chain = index.propose_tree(ns, tail, 4, branches=1)
        assert [t for _, t in chain] == index.propose(ns, tail, 4)


def test_the_bound_refuses_whole_adds_and_comes_back_with_removals() -> None:
    index = SuffixIndex(max_context=4, max_tokens=10)
    assert index.add(None, [], [1, 2, 3, 4, 5, 6])
    assert not index.add(None, [], [7, 8, 9, 10, 11])  # would make 11
    assert index.tokens == 6 and index.propose(None, [7, 8], 1) == []
    assert index.add("a", [], [7, 8, 9, 10])
    assert index.tokens == 10
    index.remove(None, [], [1, 2, 3, 4, 5, 6])
    assert index.add(None, [], [7, 8, 9, 10, 11])
    assert index.propose(None, [7, 8], 3) == [9, 10, 11]
    index.clear()
    assert index.tokens == 0 and index.snapshot() == {}


def test_a_tree_of_candidates_branches_where_two_continuations_are_frequent() -> None:
    index = SuffixIndex(max_context=4, min_match=2, min_prob=0.2)
    for _ in range(3):
        index.add(None, [], [1, 2, 3, 4, 5])
    for _ in range(2):
        index.add(None, [], [1, 2, 7, 8, 9])
    index.add(None, [], [1, 2, 6, 6, 6])  # a sixth of the count: below min_prob
    tree = index.propose_tree(None, [0, 1, 2], 8)
    assert tree == [(-1, 3), (0, 4), (1, 5), (-1, 7), (3, 8), (4, 9)]
    assert all(parent < i for i, (parent, _) in enumerate(tree))
    assert index.propose_tree(None, [0, 1, 2], 4) == tree[:4]  # the likeliest first
    chain = index.propose_tree(None, [0, 1, 2], 8, branches=1)
    assert [t for _, t in chain] == index.propose(None, [0, 1, 2], 8) == [3, 4, 5]
    assert index.propose_tree("other", [0, 1, 2], 8) == []
