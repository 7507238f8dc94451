"""Issue 53, item 6 (finding 9): `--kv-disk-dir` given as a symbolic link, swapped after
start to another account's 0777 directory, made the server write its index and KV files
there: it checked the path through the link at start, then resolved it again on every file
operation. The directory is pinned now: checked and opened once at start (a directory
descriptor, which a restarted scheduler and worker inherit), every file operation relative
to it, and a path another account could redirect is refused at start.

On the two-tenant harness: after start the link (and, in a variant, the directory itself)
is swapped for another account's directory while bob's prompts evict KV to disk and alice's
plain requests run; nothing is written through the swapped path, the pinned directory keeps
getting the files, alice is unaffected, and a worker crash's restart still writes into the
pinned directory. At start: a link owned by another account, and a path through a folder
another account can write, are refused, over the real server and in `disk_layout.pin`."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from radixserve.client import Client
from radixserve.disk_layout import INDEX_NAME, pin, unpin
from radixserve.server.runtime import Runtime
from tests.factories import tiny_model_dir
from tests.server.attack_harness import AttackServer, assert_unaffected, attack_server

OTHER = 65534
"""Another account's uid (nobody): the tests that give a path away need root."""
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="gives files to another account")
EVICTING = {"sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def others_dir(path: Path) -> Path:
    """A 0777 directory of another account's, where nothing of the server's may land."""
    path.mkdir()
    path.chmod(0o777)
    if os.geteuid() == 0:
        os.chown(path, OTHER, OTHER)
    return path


def swap_link(link: Path, target: Path) -> None:
    """Point `link` at `target` at once (a new link renamed over it), as its owner could."""
    fresh = link.with_name(link.name + ".new")
    fresh.symlink_to(target)
    if os.geteuid() == 0:
        os.lchown(fresh, OTHER, OTHER)
    os.replace(fresh, link)


def kv_files(directory: Path) -> dict[str, float]:
    return {p.name: p.stat().st_mtime for p in directory.iterdir()
            if p.suffix == ".kv" or p.name == INDEX_NAME}


def evict(client: Client, tag: int, count: int = 8) -> None:
    """Prompts of ~200 tokens that evict each other to disk (a 1024-token pool)."""
    for i in range(count):
        client.generate(input_ids=[(tag * 31 + i) % 200 + 5] * 200 + [7, 8], **EVICTING)


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk-dir")
    real = root / "state" / "kv"
    real.mkdir(parents=True, mode=0o700)
    link = root / "kv-link"
    link.symlink_to(real)
    return root, real, link


@pytest.fixture(scope="module")
def server(tmp_path_factory, layout):
    _, _, link = layout
    with attack_server(tmp_path_factory, max_total_tokens=1024, debug_invariants=True,
                       kv_disk_dir=str(link), kv_persist_interval=0.05) as s:
        yield s


def test_a_link_swapped_after_start_is_never_followed(server, layout):
    root, real, link = layout
    evict(server.bob, 0)
    assert server.operator.stats()["disk_tokens"] > 0
    theirs = others_dir(root / "theirs")

    def attack(s: AttackServer) -> None:
        swap_link(link, theirs)
        before = kv_files(real)
        time.sleep(0.05)
        evict(s.bob, 1)
        evict(s.bob, 2, 4)
        time.sleep(0.3)  # an index save or two (every 0.05 s after a step)
        evict(s.bob, 3, 2)
        assert os.listdir(theirs) == [], "the server wrote through the swapped link"
        after = kv_files(real)
        assert after[INDEX_NAME] > before[INDEX_NAME], "the pinned directory's index is stale"
        assert set(after) - set(before), "no new KV file in the pinned directory"

    report = assert_unaffected(server, attack, max_latency_ratio=3, max_rss_growth_mib=300)
    print(report)


def test_the_directory_swapped_under_its_name_and_a_restart_keep_the_pinned_one(server, layout):
    """The directory itself renamed away and another put at its path (what an account that
    could write its parent would do), then the worker killed: the restarted scheduler and
    worker inherit the descriptor, and still write only into the directory pinned at start."""
    root, real, link = layout
    moved = real.with_name("kv-moved")
    real.rename(moved)
    theirs = others_dir(real)  # at the path the link named at start
    swap_link(link, real)
    worker = server.operator.health()["pids"]["worker"]
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while (h := server.operator.health())["status"] != "ok" or h["pids"]["worker"] == worker:
        assert time.monotonic() < deadline, f"no restart: {h}"
        time.sleep(0.2)
    before = kv_files(moved)
    evict(server.bob, 4)
    time.sleep(0.3)
    evict(server.bob, 5, 2)
    assert os.listdir(theirs) == [], "the restarted processes wrote through the new path"
    after = kv_files(moved)
    assert after[INDEX_NAME] > before[INDEX_NAME] and set(after) - set(before)
    assert server.alice.generate(prompt="Hello", **EVICTING)["output_ids"]


@needs_root
def test_a_link_another_account_owns_is_refused_at_start(tmp_path_factory):
    root = tmp_path_factory.mktemp("refused")
    real = root / "kv"
    real.mkdir(mode=0o700)
    link = root / "their-link"
    link.symlink_to(real)
    os.lchown(link, OTHER, OTHER)
    tiny = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"symbolic link owned by .*uid 65534"):
        Runtime(str(tiny), kv_disk_dir=str(link), max_total_tokens=1024)
    assert time.monotonic() - start < 60
    assert os.listdir(real) == []  # nothing written through it


@needs_root
@pytest.mark.parametrize("case", ["link", "world-writable", "group-writable", "sticky-theirs",
                                  "owned-folder", "link-in-link"])
def test_paths_another_account_could_redirect_are_refused(tmp_path, case):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    folder = tmp_path / "folder"
    folder.mkdir(mode=0o755)
    kv = folder / "kv"
    if case == "link":
        kv.symlink_to(mine)
        os.lchown(kv, OTHER, OTHER)
    elif case in ("world-writable", "group-writable"):
        folder.chmod(0o777 if case == "world-writable" else 0o775)
    elif case == "sticky-theirs":  # /tmp-like: only the entry's owner may replace it
        folder.chmod(0o1777)
        kv.symlink_to(mine)
        os.lchown(kv, OTHER, OTHER)
    elif case == "owned-folder":
        os.chown(folder, OTHER, OTHER)
    else:  # a link of ours through a link of theirs
        hop = tmp_path / "hop"
        hop.symlink_to(mine)
        os.lchown(hop, OTHER, OTHER)
        kv.symlink_to(hop)
    with pytest.raises(ValueError, match=r"kv_disk_dir .* is refused: .*(link owned|writable "
                                         r"by other|owned by)"):
        pin(kv)
    assert os.listdir(mine) == []
    assert kv.is_symlink() or not kv.exists()  # nothing made where another account decides


def test_a_sticky_folder_with_our_own_entry_and_our_own_link_are_accepted(tmp_path):
    """/tmp's case: a sticky world-writable folder whose entry is this account's; a link of
    this account's. Both are pinned, and the directory made 0700."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    kv = sticky / "kv"
    pinned = pin(kv)
    assert oct(kv.stat().st_mode & 0o777) == oct(0o700)
    unpin(pinned)
    link = tmp_path / "link"
    link.symlink_to(kv)
    unpin(pin(link))
