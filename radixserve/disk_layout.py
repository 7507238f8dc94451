"""The disk tier's directory: what each file is called, and how it is pinned, made, written
and read. Shared by the scheduler's side (the tree's index, cache/persist.py), the worker's
(the KV files, worker/kv_disk.py) and the cache secret (tenants.py), which otherwise know
nothing of each other.

The directory holds every tenant's cached prompts (token ids, namespaces and KV in clear),
so only the server's account may read it, and nobody else may choose where it is:

- **Pinned at start** (`pin`): the path is walked from `/` one component at a time, and
  refused (ValueError naming the path, what is wrong and the fix) when a symbolic link on
  it is owned by another account than the server's or root, when a directory on it could
  have its entries replaced by another account (owned by one, or group- or world-writable
  without the sticky bit, or sticky but the entry not the server's or root's), or when the
  directory itself is owned by another account or open to the group or the world. It is
  made (0700, as are the parents it lacks) if missing, and opened once: a directory
  descriptor (`PinnedDir`). Every file operation afterwards is relative to that descriptor
  (`openat`-style, `O_NOFOLLOW`), so a link or directory swapped in at the path after start
  is never followed: the server keeps the directory it checked. The front door pins it and
  hands the descriptor to its scheduler and worker (`adopt`), restarted ones included; an
  Engine pins it for its life.
- **Every file** is written 0600 whatever the umask, first under an unpredictable temporary
  name created with O_EXCL | O_NOFOLLOW, then renamed into place (`PinnedDir.write_temp`),
  so a file or a symbolic link planted under any name is never opened for writing, followed
  or overwritten (a rename replaces a link at the final name, never its target); files are
  read with O_NOFOLLOW (`PinnedDir.open_read`), so a planted link is an unreadable file,
  never another file's bytes.
"""

from __future__ import annotations

import os
import pwd
import secrets
import stat
import weakref
from io import BufferedReader
from pathlib import Path

ENTRY_SUFFIX = ".kv"
INDEX_NAME = "index.msgpack"
RESPONSES_NAME = "responses.msgpack"
"""The Responses API's stored responses (server/http/response_file.py)."""
LOCK_NAME = "lock"
"""Held (flock) by the one scheduler that uses the directory."""
TEMP_SUFFIX = ".tmp"
"""How every temporary file's name ends; start-up deletes those a crash left behind."""
DIR_MODE = 0o700
FILE_MODE = 0o600
MAX_LINKS = 40
"""Symbolic links a pinned path may pass through (Linux's own bound)."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class PinnedDir:
    """A directory opened once; every operation is relative to its descriptor and follows
    no symbolic link. `path` is the name it was pinned by, for messages only."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path
        self._subs: dict[str, PinnedDir] = {}
        self._closer = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        self._closer()

    def create_private(self, name: str, flags: int = os.O_WRONLY) -> int:
        """A descriptor on `name`, created with mode 0600 (exactly, whatever the umask) with
        `flags`, never through a symbolic link (OSError ELOOP on one)."""
        fd = os.open(name, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE,
                     dir_fd=self.fd)
        try:
            os.fchmod(fd, FILE_MODE)
        except OSError:
            os.close(fd)
            raise
        return fd

    def write_temp(self, final: str, *chunks: bytes | memoryview) -> str:
        """A new file next to `final` holding `chunks`, fsync'd and closed, for the caller to
        `replace` onto `final`: its name (`<final>.<random>.tmp`) is unpredictable and it is
        created with O_EXCL, so nothing planted under any name is written through."""
        tmp = f"{final}.{secrets.token_hex(8)}{TEMP_SUFFIX}"
        with os.fdopen(self.create_private(tmp, os.O_WRONLY | os.O_EXCL), "wb") as f:
            try:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            except BaseException:
                self.unlink(tmp)
                raise
        return tmp

    def replace(self, src: str, dst: str) -> None:
        os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        """Delete `name` (a link itself, never its target); nothing if it is missing."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def open_read(self, name: str) -> BufferedReader:
        """`name` opened for reading, never through a symbolic link (OSError ELOOP on one)
        and never blocking (a planted FIFO reads as empty)."""
        return os.fdopen(os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                                 | os.O_NONBLOCK, dir_fd=self.fd), "rb")

    def read_bounded(self, name: str, limit: int) -> bytes:
        """`name`'s bytes, opened as `open_read` opens it; ValueError when it holds more
        than `limit`, checked before reading and by reading at most one byte past it (a
        file that grows meanwhile is not read further)."""
        with self.open_read(name) as f:
            if os.fstat(f.fileno()).st_size > limit:
                raise ValueError(f"larger than {limit} bytes")
            raw = f.read(limit + 1)
        if len(raw) > limit:
            raise ValueError(f"larger than {limit} bytes")
        return raw

    def write_whole(self, name: str, data: bytes) -> None:
        """`name` replaced by `data` at once: written under a temporary name, renamed into
        place, and the directory synced (a crash leaves the old file or the new one)."""
        self.replace(self.write_temp(name, data), name)
        self.fsync()

    def exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def fsync(self) -> None:
        """Make the renames done here survive a crash."""
        os.fsync(self.fd)

    def sub(self, name: str) -> PinnedDir:
        """The folder `name` in this one (made 0700 if missing), opened without following a
        link and checked as the directory itself is (`_check_private`)."""
        if name not in self._subs:
            made = True
            try:
                os.mkdir(name, DIR_MODE, dir_fd=self.fd)
            except FileExistsError:
                made = False
            path = self.path / name
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
            except OSError as e:
                raise ValueError(f"kv_disk_dir {path} cannot be used ({e}; a symbolic link is "
                                 "never followed)") from None
            try:
                if made:
                    os.fchmod(fd, DIR_MODE)  # exactly 0700, whatever the umask
                _check_private(fd, path)
            except BaseException:
                os.close(fd)
                raise
            self._subs[name] = PinnedDir(fd, path)
        return self._subs[name]


_PINNED: dict[str, PinnedDir] = {}
"""This process's pinned directories, by absolute path (`pin`, `adopt`)."""


def _key(directory: str | Path) -> str:
    return os.path.abspath(os.fspath(directory))


def pin(directory: str | Path) -> PinnedDir:
    """Check `directory` and open it (see the module's doc), made if missing; it is then
    this process's for that path (`pinned`) until `unpin`. ValueError when refused."""
    pinned_dir = _open_checked(Path(directory))
    _PINNED[_key(directory)] = pinned_dir
    return pinned_dir


def adopt(directory: str | Path, fd: int) -> PinnedDir:
    """A descriptor the process that pinned `directory` handed down (a child's start):
    checked again as the directory is, then this process's for that path."""
    _check_private(fd, Path(directory))
    pinned_dir = _PINNED[_key(directory)] = PinnedDir(fd, Path(directory))
    return pinned_dir


def unpin(pinned_dir: PinnedDir) -> None:
    """Forget `pinned_dir` as its path's (its descriptor closes with its last user)."""
    key = _key(pinned_dir.path)
    if _PINNED.get(key) is pinned_dir:
        del _PINNED[key]


def pinned(directory: str | Path) -> PinnedDir:
    """`directory` as this process pinned it (or a folder of such a one, `PinnedDir.sub`);
    one not pinned (a tool, a test) is checked and opened now, for the caller alone."""
    key = _key(directory)
    found = _PINNED.get(key)
    if found is not None:
        return found
    parent = _PINNED.get(os.path.dirname(key))
    if parent is not None:
        return parent.sub(os.path.basename(key))
    return _open_checked(Path(directory))


def private_dir(directory: Path) -> Path:
    """`directory`, made (mode 0700, as are the parents it lacks) if it is missing, else
    checked as `pin` checks it: ValueError naming the path, what is wrong and the fix."""
    pinned(directory)
    return directory


def _open_checked(directory: Path) -> PinnedDir:
    try:
        problem, fd = _walk(os.path.abspath(directory))
    except OSError as e:
        raise ValueError(f"kv_disk_dir {directory} cannot be used: {e}") from None
    try:
        _check_private(fd, directory)
        if problem is not None:
            raise ValueError(f"kv_disk_dir {directory} is refused: {problem}; name a path "
                             "that only this account (and root) can change")
    except BaseException:
        os.close(fd)
        raise
    return PinnedDir(fd, directory)


def _check_private(fd: int, directory: Path) -> None:
    st = os.fstat(fd)
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


def _walk(path: str) -> tuple[str | None, int]:
    """Open the directory at absolute `path` one component at a time from `/`, following
    each symbolic link by hand and making what is missing (0700). Returns the first reason
    another account could choose what the path names (or None) and the descriptor."""
    parts = [p for p in path.split("/") if p]
    stack = [os.open("/", _DIR_FLAGS)]
    where = ["/"]
    problem: str | None = None
    links = 0
    try:
        while parts:
            name = parts.pop(0)
            if name == ".":
                continue
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                    where.pop()
                continue
            here, shown = stack[-1], os.path.join(*where, name)
            folder = os.path.join(*where)
            problem = problem or _folder_problem(folder, os.fstat(here), shown)
            made = False
            try:
                st = os.stat(name, dir_fd=here, follow_symlinks=False)
            except FileNotFoundError:
                if problem is not None:
                    raise ValueError(f"kv_disk_dir {path} is refused: {problem}") from None
                os.mkdir(name, DIR_MODE, dir_fd=here)
                made = True
                st = os.stat(name, dir_fd=here, follow_symlinks=False)
            problem = problem or _entry_problem(folder, os.fstat(here), shown, st)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > MAX_LINKS:
                    raise ValueError(f"kv_disk_dir {path}: more than {MAX_LINKS} symbolic links")
                target = os.readlink(name, dir_fd=here)
                if target.startswith("/"):
                    for fd in stack[1:]:
                        os.close(fd)
                    del stack[1:], where[1:]
                parts[:0] = [p for p in target.split("/") if p]
                continue
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=here)
            except NotADirectoryError:
                raise ValueError(f"kv_disk_dir {path} is not a directory ({shown} is "
                                 "not)") from None
            except OSError as e:
                raise ValueError(f"kv_disk_dir {path} cannot be used: {shown}: {e}") from None
            stack.append(fd)
            where.append(name)
            opened = os.fstat(fd)
            if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
                problem = problem or f"{shown} changed while it was checked"
            if made:
                os.fchmod(fd, DIR_MODE)  # exactly 0700, whatever the umask
        return problem, stack.pop()
    finally:
        for fd in stack:
            os.close(fd)


def _folder_problem(folder: str, st: os.stat_result, shown: str) -> str | None:
    """Why another account could replace any entry of `folder` (`shown` the one passed
    through), or None."""
    if st.st_uid not in (os.geteuid(), 0):
        return f"{folder} is owned by {_account(st.st_uid)}, who could replace {shown} in it"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (f"{folder} (mode {stat.S_IMODE(st.st_mode):04o}) is writable by other "
                f"accounts without the sticky bit: they could replace {shown}")
    return None


def _entry_problem(folder: str, folder_st: os.stat_result, shown: str,
                   st: os.stat_result) -> str | None:
    """Why another account could replace or redirect the entry `shown` of `folder` (whose
    own problems `_folder_problem` says), or None."""
    trusted = (os.geteuid(), 0)
    if folder_st.st_mode & 0o022 and st.st_uid not in trusted:  # sticky: the owner may
        return (f"{folder} (mode {stat.S_IMODE(folder_st.st_mode):04o}) is writable by other "
                f"accounts and {shown} is {_account(st.st_uid)}'s, who could replace it")
    if stat.S_ISLNK(st.st_mode) and st.st_uid not in trusted:
        return (f"{shown} is a symbolic link owned by {_account(st.st_uid)}, who could point "
                "it at a directory of theirs")
    return None


def _account(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def entry_dirs(directory: Path, tp_size: int = 1) -> list[Path]:
    """Where the KV files are: `directory` itself, or under tensor parallelism one folder
    per rank (`rank0`, `rank1`, ...), each with its heads' share of every entry. An entry
    is whole only where every rank's file is."""
    return [directory] if tp_size == 1 else [directory / f"rank{r}" for r in range(tp_size)]


def entry_name(entry: int) -> str:
    return f"{entry:016x}{ENTRY_SUFFIX}"


def entry_path(directory: Path, entry: int) -> Path:
    return directory / entry_name(entry)


def entry_of(name: str) -> int | None:
    """The entry a KV file's name names, or None for any other file."""
    stem, dot, suffix = name.rpartition(".")
    if not dot or f".{suffix}" != ENTRY_SUFFIX:
        return None
    try:
        return int(stem, 16)
    except ValueError:
        return None
