"""The router's view of a replica's tree: exact from events, repaired from snapshots, and
provisional for prefixes routed but not yet cached."""

from __future__ import annotations

from radixserve.cache.events import page_hashes
from radixserve.messages import CacheEvents
from radixserve.router.view import LINGER, CacheView

PAGE = 4


def events(seq: int, stored=(), removed=(), cleared=False, epoch="e1") -> CacheEvents:
    return CacheEvents(epoch=epoch, seq=seq, page_size=PAGE, stored=list(stored),
                       removed=list(removed), cleared=cleared)


def synced_view(hashes=(), seq=0, epoch="e1") -> CacheView:
    view = CacheView()
    assert not view.on_snapshot({"epoch": epoch, "seq": seq, "page_size": PAGE,
                                 "hashes": list(hashes)})
    return view


class TestMatch:
    def test_the_longest_run_of_leading_pages_held(self):
        prompt = page_hashes(range(20), PAGE)  # 5 pages
        view = synced_view(prompt[:3])
        assert view.matched_pages(prompt) == 3
        assert view.matched_pages(page_hashes(range(1, 21), PAGE)) == 0

    def test_namespaces_never_match_each_other(self):
        view = synced_view(page_hashes(range(8), PAGE, "tenant-a"))
        assert view.matched_pages(page_hashes(range(8), PAGE, "tenant-a")) == 2
        assert view.matched_pages(page_hashes(range(8), PAGE, "tenant-b")) == 0
        assert view.matched_pages(page_hashes(range(8), PAGE)) == 0

    def test_provisional_until_released(self):
        prompt = page_hashes(range(12), PAGE)
        view = synced_view()
        view.hold(prompt)
        view.hold(prompt)
        assert view.matched_pages(prompt) == 3
        view.release(prompt, now=0.0)
        view.expire(LINGER)
        assert view.matched_pages(prompt) == 3, "one call still holds it"
        view.release(prompt, now=10.0)
        view.expire(10.0 + LINGER / 2)
        assert view.matched_pages(prompt) == 3, "its events may still be on their way"
        view.expire(10.0 + LINGER)
        assert view.matched_pages(prompt) == 0 and not view.provisional


class TestEvents:
    def test_applies_in_order(self):
        a, b = page_hashes(range(8), PAGE), page_hashes(range(100, 108), PAGE)
        view = synced_view()
        assert not view.on_events(events(1, stored=a))
        assert not view.on_events(events(2, stored=b, removed=a[1:]))
        assert view.hashes == {a[0], *b}
        assert not view.on_events(events(3, stored=a[:1], cleared=True))
        assert view.hashes == {a[0]}, "cleared comes first, then stored"

    def test_a_gap_asks_for_a_snapshot_and_replays_what_came_after(self):
        a = page_hashes(range(12), PAGE)
        view = synced_view(seq=1)
        assert view.on_events(events(3, stored=a[:1])), "seq 2 was lost"
        assert not view.synced
        assert not view.on_events(events(4, stored=a[1:2]))  # buffered meanwhile
        # The snapshot was taken after seq 3: it holds a[0]; seq 4 is replayed on top.
        assert not view.on_snapshot({"epoch": "e1", "seq": 3, "page_size": PAGE,
                                     "hashes": [a[0]]})
        assert view.synced and view.hashes == {a[0], a[1]} and view.seq == 4

    def test_a_new_epoch_is_a_new_tree(self):
        a = page_hashes(range(8), PAGE)
        view = synced_view(a, seq=7)
        assert view.on_events(events(1, stored=a[:1], epoch="e2")), "the replica restarted"
        assert not view.on_snapshot({"epoch": "e2", "seq": 1, "page_size": PAGE,
                                     "hashes": a[:1]})
        assert view.hashes == {a[0]} and view.epoch == "e2"

    def test_a_snapshot_older_than_the_buffer_asks_again(self):
        view = synced_view(seq=1)
        assert view.on_events(events(5))
        assert view.on_snapshot({"epoch": "e1", "seq": 2, "page_size": PAGE, "hashes": []}), \
            "events 3 and 4 are in neither"

    def test_reset_forgets_everything(self):
        a = page_hashes(range(8), PAGE)
        view = synced_view(a)
        view.hold(a)
        view.reset()
        assert view.matched_pages(a) == 0 and not view.synced
