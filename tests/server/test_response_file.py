"""Stored responses on the disk tier's directory (issue 55, item 2): the file's round trip
(tenants, wall-clock expiry, byte accounting, the prompt to pin again), the bounds applied
again on load, a refused file (corrupt, oversized, wrong shape, another version, a symbolic
link) starting empty with one log line, and the pins a loaded response takes again."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from array import array

import msgspec
import pytest

from radixserve.disk_layout import RESPONSES_NAME, pinned
from radixserve.server.http import response_file as rf
from radixserve.server.http.response_store import ResponseStore, Stored


def stored(id: str, text: str = "hi", ids: list[int] | None = None) -> Stored:
    return Stored(id, {"id": id, "object": "response", "output": [{"text": text}]},
                  [{"role": "user", "content": text},
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"id": "c1", "type": "function",
                        "function": {"name": "f", "arguments": "{}"}}]}],
                  array("i", ids if ids is not None else [1, 2, 3]))


def saved_store(folder) -> ResponseStore:
    store = ResponseStore(max_count=10, max_bytes=10**6, ttl=100)
    store.put("a", stored("resp_a1"))
    store.put("a", stored("resp_a2", "there"))
    store.put("b", stored("resp_b1", ids=[4, 5]))
    rf.save(folder, rf.encode(rf.snapshot(store), "m"))
    return store


def load(folder, **bounds) -> ResponseStore:
    store = ResponseStore(**{"max_count": 10, "max_bytes": 10**6, "ttl": 100, **bounds})
    saved = rf.read(folder)
    if saved is not None:
        rf.restore(store, saved, "m", ["a", "b"])
    return store


def test_a_round_trip_keeps_tenants_expiry_bytes_and_the_prompt(tmp_path):
    folder = pinned(tmp_path)
    before = saved_store(folder)
    assert os.stat(tmp_path / RESPONSES_NAME).st_mode & 0o777 == 0o600
    after = load(folder)
    for tenant in ("a", "b"):
        assert list(after.tenants[tenant]) == list(before.tenants[tenant])
        assert after.count(tenant) == before.count(tenant)  # the byte accounting too
        for id, old in before.tenants[tenant].items():
            new = after.tenants[tenant][id]
            assert (new.body, new.messages) == (old.body, old.messages)
            assert new.pinned is None and new.prompt == old.pinned  # no pin held yet
            assert abs(new.expires - old.expires) < 1.0
    assert after.get("b", "resp_a1")[0] is None  # still per tenant


def test_load_drops_expired_and_unknown_tenants_and_applies_the_bounds(tmp_path):
    folder = pinned(tmp_path)
    saved_store(folder)
    assert load(folder, max_count=1).count("a")[0] == 1
    kept = load(folder, max_count=1).tenants["a"]
    assert list(kept) == ["resp_a2"]  # the oldest dropped first
    assert load(folder, ttl=0.5).tenants["a"]["resp_a1"].expires <= time.monotonic() + 0.5
    saved = rf.read(folder)
    assert saved is not None
    for r in saved.responses:
        if r.id == "resp_a1":
            r.expires = time.time() - 1
    store = ResponseStore(10, 10**6, 100)
    assert rf.restore(store, saved, "m", ["a"]) == 1  # a1 expired; b unknown now
    assert list(store.tenants) == ["a"]
    store = ResponseStore(10, 10**6, 100)
    rf.restore(store, saved, "another model", ["a", "b"])
    assert store.tenants["b"]["resp_b1"].prompt is None  # ids of another tokenizer


@pytest.mark.parametrize("content", [
    b"\x00garbage\xff", msgspec.msgpack.encode({"version": 1, "model": "m", "responses": 5}),
    msgspec.msgpack.encode({"version": 2, "model": "m", "responses": []}), b""])
def test_a_refused_file_starts_empty_and_says_so(tmp_path, caplog, content):
    (tmp_path / RESPONSES_NAME).write_bytes(content)
    with caplog.at_level(logging.WARNING):
        assert rf.read(pinned(tmp_path)) is None
    assert "stored responses" in caplog.text and "starting with none" in caplog.text


def test_an_oversized_file_or_a_link_is_refused(tmp_path, caplog, monkeypatch):
    folder = pinned(tmp_path)
    saved_store(folder)
    monkeypatch.setattr(rf, "MAX_FILE_BYTES", 100)
    with caplog.at_level(logging.WARNING):
        assert rf.read(folder) is None
    assert "larger than 100 bytes" in caplog.text
    monkeypatch.undo()
    os.rename(tmp_path / RESPONSES_NAME, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / RESPONSES_NAME)
    assert rf.read(folder) is None  # never followed


def test_a_save_past_the_bound_leaves_the_oldest_out(tmp_path, caplog, monkeypatch):
    store = ResponseStore(10, 10**6, 100)
    for i in range(3):
        store.put("a", stored(f"resp_{i}"))
    size = store.tenants["a"]["resp_0"].size
    monkeypatch.setattr(rf, "MAX_FILE_BYTES", 4096 + 2 * (size + 256) + 10)
    with caplog.at_level(logging.WARNING):
        data = rf.encode(rf.snapshot(store), "m")
    assert "1 of them are not saved" in caplog.text
    saved = msgspec.msgpack.decode(data, type=rf.SavedResponses)
    assert [r.id for r in saved.responses] == ["resp_1", "resp_2"]


def test_a_loaded_response_pins_again_once_and_releases_consistently(tmp_path):
    folder = pinned(tmp_path)
    store = ResponseStore(10, 10**6, 100)
    store.put("a", stored("resp_1", ids=[7, 7]))
    store.put("a", stored("resp_2", ids=[7, 7]))  # the same prefix, one pin
    store.put("a", stored("resp_3", ids=[9]))
    rf.save(folder, rf.encode(rf.snapshot(store), "m"))
    after = load(folder)
    one, two, three = (after.tenants["a"][i] for i in ("resp_1", "resp_2", "resp_3"))
    ids = after.take_repin("a", one)
    assert ids is not None and list(ids) == [7, 7]
    assert after.take_repin("a", one) is None  # claimed once
    assert after.repinned("a", one, ids) is False and one.pinned == ids
    assert after.take_repin("a", two) is None and two.pinned == ids  # shares one's pin
    assert after.delete("a", "resp_1").pinned is None  # resp_2 still holds it
    assert after.delete("a", "resp_2").pinned == ids  # the last: released
    ids3 = after.take_repin("a", three)
    assert ids3 is not None
    # a save while its pin is being taken still has the ids
    assert [e[3] for e in rf.snapshot(after) if e[1] is three] == [ids3]
    after.delete("a", "resp_3")  # dropped while its pin was being taken
    assert after.repinned("a", three, ids3) is True  # the caller unpins it
    assert not after.holders


def test_the_writer_saves_after_a_change_and_at_close_only(tmp_path, monkeypatch):
    monkeypatch.setattr(rf, "SAVE_DELAY", 0.01)
    folder = pinned(tmp_path)

    async def run() -> None:
        store = ResponseStore(10, 10**6, 100)
        file = rf.ResponseFile(folder, store, "m")
        await file.start(["a"])
        await asyncio.sleep(0.05)
        assert not (tmp_path / RESPONSES_NAME).exists()  # nothing changed: nothing written
        store.put("a", stored("resp_1"))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if (tmp_path / RESPONSES_NAME).exists():
                break
        saved = rf.read(folder)
        assert saved is not None and [r.id for r in saved.responses] == ["resp_1"]
        store.delete("a", "resp_1")
        await file.close()
        saved = rf.read(folder)
        assert saved is not None and saved.responses == []

    asyncio.run(run())
