"""Issue 41, findings 9 and 10: the disk tier holds every tenant's prompts in clear, so only
the server's account may read it. The directory is made 0700 and every file 0600 whatever
the umask (the test runs under umask 0); a directory or cache secret another account owns
or can read is refused at start, naming it, why and the fix; a symbolic link planted under
the name of any file the server writes there (the index, the KV files, the lock, the
secret, the temporaries), before start or while serving, is never followed and its target
never written."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from radixserve.cache.persist import lock_store
from radixserve.disk_layout import INDEX_NAME, LOCK_NAME, entry_path, pin, private_dir, unpin
from radixserve.tenants import CACHE_SECRET_FILE, load_cache_secret
from tests.conftest import checked_engine
from tests.factories import tiny_model_dir

TARGET = b"a file of this account's that the server must never write\n"


@pytest.fixture
def umask_0():
    old = os.umask(0)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def planted(directory: Path, name: str, target: Path) -> Path:
    link = directory / name
    link.unlink(missing_ok=True)
    link.symlink_to(target)
    return link


def another_accounts(path: Path, monkeypatch) -> None:
    """Make `path` look owned by another account: given away as root, else the server's
    account seen as another uid."""
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534, follow_symlinks=False)
    else:
        uid = os.stat(path).st_uid + 1
        monkeypatch.setattr(os, "geteuid", lambda: uid)


def test_every_file_is_private_and_no_planted_link_is_followed(tmp_path, umask_0):
    tiny = tiny_model_dir(tmp_path / "models")
    target = tmp_path / "target"
    target.write_bytes(TARGET)
    kv = tmp_path / "state" / "kv"
    kv.mkdir(parents=True, mode=0o700)
    kv.parent.chmod(0o755)  # umask 0 made it 0777, which another account could swap kv in
    # Before start: links under the index's name, an old-style temporary and the first
    # entries' names. The index is unreadable (a cold start); the others are deleted.
    for name in (INDEX_NAME, "index.tmp", *(entry_path(kv, e).name for e in range(1, 4))):
        planted(kv, name, target)
    prompts = [[1 + i] * 200 + [7, 8] for i in range(4)]  # each evicts the one before
    sp = {"max_new_tokens": 4, "temperature": 0}
    with checked_engine(tiny, max_total_tokens=512, kv_disk_dir=str(kv),
                        kv_persist_interval=0.001, debug_invariants=True) as engine:
        disk = engine.scheduler.cache.radix_cache.disk
        # While serving: links under the index's name and every entry name to come.
        planted(kv, INDEX_NAME, target)
        for e in range(disk.next_id, disk.next_id + 16):
            planted(kv, entry_path(kv, e).name, target)
        cold = [engine.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts]
        engine.worker.disk.sync()
        assert disk.entries and target.read_bytes() == TARGET
        written = [entry_path(kv, e) for e in disk.entries] + [kv / INDEX_NAME]
        for path in written + [kv / LOCK_NAME, kv / CACHE_SECRET_FILE]:
            assert stat.S_ISREG(os.lstat(path).st_mode) and mode(path) == 0o600, path
        # A complete, valid KV file swapped for a link to its copy: a load does not follow
        # it (a miss, recomputed), so a link can never feed the tree another file's bytes.
        first = min(disk.entries)
        copy = tmp_path / "copy.kv"
        copy.write_bytes(entry_path(kv, first).read_bytes())
        planted(kv, entry_path(kv, first).name, copy)
        again = [engine.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts]
        assert again == cold
        assert engine.stats()["disk_load_failures"] >= 1
    assert target.read_bytes() == TARGET and mode(kv) == 0o700
    for path in kv.iterdir():  # after the flush and the shutdown's save
        assert not path.name.endswith(".tmp"), path
        if path.is_symlink():  # planted for an entry never written: left as it was
            assert path.readlink() == target and path.suffix == ".kv", path
        else:
            assert mode(path) == 0o600, path


def test_a_directory_made_with_its_parents_is_private_whatever_the_umask(tmp_path, umask_0):
    kv = private_dir(tmp_path / "a" / "b" / "kv")
    assert mode(kv) == mode(kv.parent) == mode(tmp_path / "a") == 0o700


def test_a_directory_others_can_reach_is_refused_before_any_work(tmp_path, monkeypatch):
    tiny = tiny_model_dir(tmp_path / "models")
    kv = tmp_path / "kv"
    kv.mkdir(mode=0o755)
    kv.chmod(0o755)
    from radixserve import Engine

    with pytest.raises(ValueError, match=rf"kv_disk_dir {kv} has mode 0755.*chmod -R go= {kv}"):
        Engine(str(tiny), kv_disk_dir=str(kv))
    assert os.listdir(kv) == []  # refused before writing anything there
    kv.chmod(0o750)
    with pytest.raises(ValueError, match="mode 0750"):  # the group alone is enough
        load_cache_secret("/unused", str(kv))
    kv.chmod(0o700)
    another_accounts(kv, monkeypatch)
    with pytest.raises(ValueError, match=rf"kv_disk_dir {kv} is owned by .*not by this server"):
        load_cache_secret(None, str(kv))
    assert os.listdir(kv) == []


def test_the_cache_secret_is_this_accounts_alone(tmp_path, monkeypatch, umask_0):
    kv = private_dir(tmp_path / "kv")
    key = load_cache_secret(None, str(kv))
    secret = kv / CACHE_SECRET_FILE
    assert mode(secret) == 0o600 and load_cache_secret(None, str(kv)) == key  # kept
    secret.chmod(0o644)
    with pytest.raises(ValueError, match=rf"cache secret {secret} has mode 0644.*delete it"):
        load_cache_secret(None, str(kv))
    # A link to a secret someone planted elsewhere: never followed, never written through.
    secret.unlink()
    target = tmp_path / "planted-secret"
    target.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    target.chmod(0o600)
    planted(kv, CACHE_SECRET_FILE, target)
    with pytest.raises(ValueError, match=rf"cache secret {secret} cannot be opened.*symbolic"):
        load_cache_secret(None, str(kv))
    assert target.read_bytes() == b"0123456789abcdef0123456789abcdef\n"
    secret.unlink()
    secret.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o600)
    pinned_kv = pin(kv)  # checked now: as another uid the directory would look another's too
    another_accounts(secret, monkeypatch)
    with pytest.raises(ValueError, match=rf"cache secret {secret} is owned by uid \d+, not"):
        load_cache_secret(None, str(kv))
    unpin(pinned_kv)


def test_a_planted_lock_link_is_refused_not_followed(tmp_path, umask_0):
    kv = private_dir(tmp_path / "kv")
    target = tmp_path / "target"
    target.write_bytes(TARGET)
    planted(kv, LOCK_NAME, target)
    with pytest.raises(RuntimeError, match=rf"lock file {kv / LOCK_NAME} cannot be opened"):
        lock_store(kv)
    assert target.read_bytes() == TARGET
    (kv / LOCK_NAME).unlink()
    lock = lock_store(kv)
    assert mode(kv / LOCK_NAME) == 0o600
    lock.close()
