"""The disk tier's directory: what each file is called, and how it is made, written and
read. Shared by the scheduler's side (the tree's index, cache/persist.py), the worker's (the
KV files, worker/kv_disk.py) and the cache secret (tenants.py), which otherwise know nothing
of each other.

The directory holds every tenant's cached prompts (token ids, namespaces and KV in clear),
so only the server's account may read it: it is made 0700, and an existing one that is
group- or world-accessible or owned by another account is refused at start (`private_dir`).
Every file is written 0600 whatever the umask, first under an unpredictable temporary name
created with O_EXCL | O_NOFOLLOW, then renamed into place (`write_temp`), so a file or a
symbolic link planted under any name is never opened for writing, followed or overwritten
(a rename replaces a link at the final name, never its target); files are read with
O_NOFOLLOW (`open_read`), so a planted link is an unreadable file, never another file's
bytes.
"""

from __future__ import annotations

import os
import pwd
import secrets
import stat
from io import BufferedReader
from pathlib import Path

ENTRY_SUFFIX = ".kv"
INDEX_NAME = "index.msgpack"
LOCK_NAME = "lock"
"""Held (flock) by the one scheduler that uses the directory."""
TEMP_SUFFIX = ".tmp"
"""How every temporary file's name ends; start-up deletes those a crash left behind."""
DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(directory: Path) -> Path:
    """`directory`, made (mode 0700, as are the parents it lacks) if it is missing, else
    checked: ValueError naming the path, what is wrong and the fix when it is not a
    directory, is owned by another account or is open to the group or the world."""
    _make_dirs(directory)
    try:
        st = os.stat(directory)
    except OSError as e:
        raise ValueError(f"kv_disk_dir {directory} cannot be used: {e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"kv_disk_dir {directory} is not a directory")
    if st.st_uid != os.geteuid():
        raise ValueError(
            f"kv_disk_dir {directory} is owned by {_account(st.st_uid)}, not by this server's "
            f"account ({_account(os.geteuid())}): another account could read every tenant's "
            "prompts there; name a directory of this account's (the server makes it 0700)")
    if st.st_mode & 0o077:
        raise ValueError(
            f"kv_disk_dir {directory} has mode {stat.S_IMODE(st.st_mode):04o}, open to other "
            "accounts, which could read every tenant's prompts there; run "
            f"`chmod -R go= {directory}` (the server makes it 0700)")
    return directory


def _make_dirs(directory: Path) -> None:
    if not directory.parent.exists():
        _make_dirs(directory.parent)
    try:
        os.mkdir(directory, DIR_MODE)
    except FileExistsError:
        return
    os.chmod(directory, DIR_MODE)  # exactly 0700, whatever the umask


def _account(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def create_private(path: Path, flags: int = os.O_WRONLY) -> int:
    """A file descriptor on `path`, created with mode 0600 (exactly, whatever the umask) with
    `flags`, never through a symbolic link (OSError ELOOP on one)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


def write_temp(final: Path, *chunks: bytes | memoryview) -> Path:
    """A new file next to `final` holding `chunks`, fsync'd and closed, for the caller to
    `os.replace` onto `final`: its name (`<final's name>.<random>.tmp`) is unpredictable and
    it is created with O_EXCL, so nothing planted under any name is written through."""
    tmp = final.with_name(f"{final.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")
    with os.fdopen(create_private(tmp, os.O_WRONLY | os.O_EXCL), "wb") as f:
        try:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return tmp


def open_read(path: Path) -> BufferedReader:
    """`path` opened for reading, never through a symbolic link (OSError ELOOP on one) and
    never blocking (a planted FIFO reads as empty)."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK),
                     "rb")


def entry_dirs(directory: Path, tp_size: int = 1) -> list[Path]:
    """Where the KV files are: `directory` itself, or under tensor parallelism one folder
    per rank (`rank0`, `rank1`, ...), each with its heads' share of every entry. An entry
    is whole only where every rank's file is."""
    return [directory] if tp_size == 1 else [directory / f"rank{r}" for r in range(tp_size)]


def entry_path(directory: Path, entry: int) -> Path:
    return directory / f"{entry:016x}{ENTRY_SUFFIX}"


def entry_of(path: Path) -> int | None:
    """The entry a KV file's name names, or None for any other file."""
    if path.suffix != ENTRY_SUFFIX:
        return None
    try:
        return int(path.stem, 16)
    except ValueError:
        return None


def fsync_dir(directory: Path) -> None:
    """Make the renames done in `directory` survive a crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
