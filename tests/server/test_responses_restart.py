"""Stored responses survive a restart on the disk tier's directory (issue 55, item 2),
through the real `radixserve serve`: a stored response, SIGTERM, a start on the same
directory; it is read back and continued with `previous_response_id` (its prompt read from
the resumed disk tier), another tenant still gets a 404, an expired one is gone; and a
crash (SIGKILL) past the save delay loses nothing stored."""

from __future__ import annotations

import os
import signal
import time

import httpx
import msgspec
import pytest

from radixserve.disk_layout import RESPONSES_NAME
from radixserve.server.http.response_file import SAVE_DELAY, SavedResponses
from tests.factories import tiny_model_dir
from tests.server.test_disk_restart import SYSTEM, serve_with, stop
from tests.server.test_faults import wait_dead

KEY_A, KEY_B = "sk-restart-a", "sk-restart-b"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")


def serve(tiny_dir, disk):
    return serve_with(tiny_dir, "--max-total-tokens", "4096", "--max-pinned-tokens", "3000",
                      "--max-pinned-tokens-per-tenant", "3000", "--kv-disk-dir", str(disk),
                      "--served-model-name", "tiny", "--api-key", f"{KEY_A}=ta",
                      "--api-key", f"{KEY_B}=tb")


def respond(url: str, key: str, text: str, previous: str | None = None) -> dict:
    r = httpx.post(f"{url}/v1/responses", timeout=120, headers={
        "Authorization": f"Bearer {key}"}, json={
        "model": "tiny", "instructions": SYSTEM, "input": text, "max_output_tokens": 6,
        "temperature": 0, "previous_response_id": previous})
    assert r.status_code == 200, r.text
    return r.json()


def get(url: str, key: str, id: str) -> httpx.Response:
    return httpx.get(f"{url}/v1/responses/{id}", timeout=30,
                     headers={"Authorization": f"Bearer {key}"})


def test_stored_responses_survive_a_restart_and_continue_from_the_cache(tiny, tmp_path):
    disk = tmp_path / "kv"
    proc, url, _ = serve(tiny, disk)
    try:
        kept = respond(url, KEY_A, "Which route do class 3 parcels take?")
        doomed = respond(url, KEY_A, "And class 4?")
        assert get(url, KEY_B, kept["id"]).status_code == 404
    finally:
        stop(proc, url)
    # the file as saved at shutdown: both, tenant-scoped; one is made to have expired
    path = disk / RESPONSES_NAME
    assert os.stat(path).st_mode & 0o777 == 0o600
    saved = msgspec.msgpack.decode(path.read_bytes(), type=SavedResponses)
    assert {(r.tenant, r.id) for r in saved.responses} == {
        ("ta", kept["id"]), ("ta", doomed["id"])}
    for r in saved.responses:
        assert r.prompt  # the ids to pin again
        if r.id == doomed["id"]:
            r.expires = time.time() - 1
    path.write_bytes(msgspec.msgpack.encode(saved))

    proc, url, started = serve(tiny, disk)
    assert "stored responses: 1 of 2 resumed" in started
    try:
        back = get(url, KEY_A, kept["id"])
        assert back.status_code == 200 and back.json() == kept
        assert get(url, KEY_A, doomed["id"]).status_code == 404  # expired
        assert get(url, KEY_B, kept["id"]).status_code == 404  # another tenant's
        refused = httpx.post(f"{url}/v1/responses", timeout=60, headers={
            "Authorization": f"Bearer {KEY_B}"}, json={
            "model": "tiny", "input": "hi", "previous_response_id": kept["id"]})
        assert refused.status_code == 404, refused.text
        turn = respond(url, KEY_A, "And class 5?", previous=kept["id"])
        usage = turn["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] > 600, usage
        pins = httpx.get(f"{url}/cache", timeout=30,
                         headers={"Authorization": f"Bearer {KEY_A}"}).json()["pins"]
        assert len(pins) == 2, pins  # the continued response's prompt again, and the turn's
        time.sleep(SAVE_DELAY + 1.5)  # saved without a shutdown: a crash keeps it
        pids = httpx.get(f"{url}/health", timeout=30).json().get("pids", {})
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert wait_dead(pids.values())  # the killed scheduler's lock goes with it
    except BaseException:
        if proc.poll() is None:
            stop(proc, url)
        raise
    proc, url, started = serve(tiny, disk)
    try:
        assert "stored responses: 2 of 2 resumed" in started
        assert get(url, KEY_A, turn["id"]).json() == turn
        assert get(url, KEY_A, kept["id"]).status_code == 200
    finally:
        stop(proc, url)
