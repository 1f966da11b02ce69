"""One writer per output: a lock file, held by the process that writes there.

Two processes writing one ``--out`` would both finish and write every record twice (or interleave a report, or
one export silently replace the other). The lock is ``fcntl.flock`` on a lock file: the kernel drops it when its
process ends, however it ends (kill -9 included), so a lock left by a dead process is never in the way: the next
run takes it over. The file holds who took it (pid, host, start time, command line), for the message that refuses
a second writer.

Two places for the lock file:

- an output folder written entry by entry (eval, card, train, ...): ``OUT/.rope-extend.lock`` (``lock``). It
  stays in the folder (removing it would let two processes lock two different files); its content is cleared
  when the holder ends normally. A process holds it until it exits (``release`` gives it back earlier).
- a path replaced in one rename when complete (an export's file or folder, configure's folder):
  ``PARENT/.NAME.rope-extend.lock`` beside it (``beside``), so that it never ends up inside the artifact. It is
  removed when the holder is done, which is safe because a taker checks, once it holds the lock, that the name
  still leads to the file it locked (``_take``).

The lock file lives where a hostile or careless hand may have put something else by that name: a symbolic link
to a user's file (writing the holder record there would destroy the file), a hard link to one, a folder, a named
pipe (opening it would hang). It is never opened through a link (``O_NOFOLLOW``, and the folder opened with
``O_NOFOLLOW`` too), never waited on (``O_NONBLOCK``), and anything but a small regular file of its own (one
link) is refused in one line, untouched (``check``). Refused rather than replaced: removing it would change a
folder the user owns, and two processes replacing it at once could each lock a file of its own.

Without ``fcntl`` (Windows) there is no lock.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from .errors import RopeExtendError
from .untrusted import decode_json, entry_kind

try:
    import fcntl

    _FLOCK = True
except ImportError:  # pragma: no cover - Windows: no advisory locks; one writer is then the user's care
    _FLOCK = False  # and ``fcntl`` is not bound: nothing below uses it without _FLOCK

LOCK = ".rope-extend.lock"
MAX_RECORD = 4096  # a holder record is ~300 bytes: a bigger file by the lock's name is not one
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_held: dict[tuple[Path, str], int] = {}  # (folder resolved, lock name) -> the open descriptor holding the lock
_removed: set[tuple[Path, str]] = set()  # of those, the locks removed when given back (``beside``)


def lock_name(path: str | os.PathLike) -> str:
    """The name of the lock beside ``path``: ``.NAME.rope-extend.lock``."""
    return f".{Path(path).name}{LOCK}"


def _kind(st: os.stat_result) -> str | None:
    """What is wrong with the entry ``st`` as a lock file, or None when it is a small regular file of its own."""
    kind = entry_kind(st.st_mode)
    if kind is not None:
        return kind
    if st.st_nlink != 1:
        return f"a file with {st.st_nlink} hard links (another name of some other file)"
    if st.st_size > MAX_RECORD:
        return f"a file of {st.st_size} bytes (a holder record is under {MAX_RECORD})"
    return None


def _shown(folder: Path, name: str) -> Path:
    """The path the user gave, for messages: the folder, or the path a lock beside it (``beside``) is for."""
    return folder if name == LOCK else folder / name[1 : -len(LOCK)]


def _refuse(error, what: str, folder: Path, name: str, kind: str):
    return (error or RopeExtendError)(
        f"{what} {_shown(folder, name)}: its lock {folder / name} is {kind}, not the lock file rope-extend makes "
        "(a regular file of its own): nothing there is touched; remove it, or give another path"
    )


def _open_folder(folder: Path, name: str, what: str, error) -> int | None:
    """A descriptor of ``folder``; None if there is no folder. An output folder (``name`` is ``LOCK``) is not
    followed if it is a link (refused): the folder the user named as a parent of a path (``beside``) is."""
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | (_NOFOLLOW if name == LOCK else 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and folder.is_symlink():
            raise (error or RopeExtendError)(
                f"{what} {folder} is a symbolic link: rope-extend never writes through a link; give a real folder"
            ) from None
        raise (error or RopeExtendError)(
            f"{what} {folder}: cannot open the folder ({exc.strerror}); give a folder you can write"
        ) from None


def check(folder: str | os.PathLike, *, name: str = LOCK, what: str = "--out", error=None) -> None:
    """Refuse (``error``, default ``RopeExtendError``) an entry ``name`` in ``folder`` that is not a lock file
    rope-extend would write into: a link, a folder, a pipe, a device, a file with other names, a big file. Nothing
    is opened or changed; an absent entry (or folder) is fine."""
    try:
        st = os.lstat(Path(folder) / name)
    except OSError:
        return
    kind = _kind(st)
    if kind is not None:
        raise _refuse(error, what, Path(folder), name, kind)


def _holder(fd: int) -> str:
    """Who holds the lock, from the file's content: 'pid 123 on host, started ...: rope-extend eval ...'."""
    try:  # MAX_RECORD bytes at most, and JSON of any shape or depth refused: a hostile holder may write anything
        info = decode_json(os.pread(fd, MAX_RECORD, 0), "the holder record")
        said = f"pid {info['pid']} on {info['host']}, started {info['started']}: {info['command']}"
        return " ".join(said.split())[:400]  # one line, whatever the record holds
    except (OSError, RopeExtendError, KeyError, TypeError):
        return "a process that has not written its name yet"


def _same_file(fd: int, folder: Path, name: str) -> bool:
    """Whether ``folder/name`` (not followed if a link) is still the file open as ``fd``."""
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(folder / name))
    except OSError:
        return False


def _open_lock(folder: Path, name: str, what: str, error, *, create: bool) -> int | None:
    """Open the lock file ``folder/name`` for writing, without following a link or waiting on a pipe, and check
    that what was opened is a lock file (``_kind``). None when there is nothing to open (``create`` off)."""
    dirfd = _open_folder(folder, name, what, error)
    if dirfd is None:
        return None
    try:
        flags = os.O_RDWR | os.O_NONBLOCK | _NOFOLLOW | (os.O_CREAT if create else 0)
        fd = os.open(name, flags, 0o644, dir_fd=dirfd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        try:
            kind = _kind(os.lstat(name, dir_fd=dirfd))
        except OSError:
            kind = None
        if kind is not None:
            raise _refuse(error, what, folder, name, kind) from None
        raise (error or RopeExtendError)(
            f"{what} {_shown(folder, name)}: cannot open its lock {folder / name} ({exc.strerror}); give a path you "
            "can write"
        ) from None
    finally:
        os.close(dirfd)
    kind = _kind(os.fstat(fd))
    if kind is not None:
        os.close(fd)
        raise _refuse(error, what, folder, name, kind)
    return fd


def _take(folder: Path, name: str, *, what: str, probe: bool, error) -> int | None:
    """Open and lock ``folder/name``; returns the descriptor (None for a ``probe``, or nothing to probe), or
    raises ``error`` naming the holder. Holding the lock, the name must still lead to the locked file: a holder
    that removed it on release (``beside``) between our open and our lock leaves us an orphan, so try again."""
    for _ in range(5):
        fd = _open_lock(folder, name, what, error, create=not probe)
        if fd is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise (error or RopeExtendError)(
                f"{what} {_shown(folder, name)} is being written by another "
                f"rope-extend process ({holder}); wait for it to end or give another path (two writers would "
                "record every result twice, or one replace the other)"
            ) from None
        if _same_file(fd, folder, name):
            record = os.pread(fd, MAX_RECORD, 0)
            if record and not record.startswith(b'{"pid": '):
                os.close(fd)
                raise _refuse(error, what, folder, name, "a file that is not a holder record")
            if probe:
                os.close(fd)  # closing drops the lock
                return None
            return fd
        os.close(fd)
    raise (error or RopeExtendError)(
        f"{what} {_shown(folder, name)}: its lock {folder / name} keeps changing; try again"
    )


def _write_holder(fd: int) -> None:
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(["rope-extend", *sys.argv[1:]])[:300],
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)


def lock(path: str | os.PathLike, *, what: str = "--out", probe: bool = False, error=None, name: str = LOCK) -> None:
    """Take the lock of folder ``path`` (its file ``name``) for this process (again: nothing to do), or raise
    ``error`` (``RopeExtendError``) naming the process that holds it, or a lock file that is not one (``_kind``).
    ``probe``: only check that no other process holds it (before a long setup), creating and taking nothing."""
    folder = Path(path)
    key = (folder.resolve(), name)
    if key in _held and _same_file(_held[key], folder, name):
        return
    _give_back(key)  # held, but the folder was removed and made again since: lock the new one
    check(folder, name=name, what=what, error=error)
    if not _FLOCK:
        return
    fd = _take(folder, name, what=what, probe=probe, error=error)
    if fd is not None:
        _write_holder(fd)
        _held[key] = fd


@contextlib.contextmanager
def beside(path: str | os.PathLike, *, what: str = "--out", error=None) -> Iterator[None]:
    """Hold the lock of ``path``, a file or folder written by replacing it in one rename, for the block: the lock
    file is ``.NAME.rope-extend.lock`` beside it (the parent folder is made if missing) and is removed after."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise (error or RopeExtendError)(
            f"{what} {path}: cannot make the folder {path.parent} ({exc.strerror}); give a path you can write"
        ) from None
    name = lock_name(path)
    key = (path.parent.resolve(), name)
    lock(path.parent, what=what, error=error, name=name)
    _removed.add(key)
    try:
        yield
    finally:
        _give_back(key)


def probe_beside(path: str | os.PathLike, *, what: str = "--out", error=None) -> None:
    """Refuse now what ``beside`` would refuse for ``path`` (a lock there that is not one, or held by another
    process), taking and creating nothing: the check before a long setup."""
    path = Path(path)
    if path.parent.is_dir():
        lock(path.parent, what=what, probe=True, error=error, name=lock_name(path))


def _give_back(key: tuple[Path, str]) -> None:
    fd = _held.pop(key, None)
    if fd is None:
        return
    try:
        if key in _removed:
            _removed.discard(key)
            folder, name = key
            if _same_file(fd, folder, name):  # removed while locked: a waiting taker sees the name gone
                os.unlink(folder / name)
        else:
            os.ftruncate(fd, 0)
    except OSError:
        pass  # a folder removed or made read-only meanwhile: the kernel drops the lock at close all the same
    finally:
        os.close(fd)


def release(path: str | os.PathLike) -> None:
    """Give back the lock of folder ``path`` if this process holds it (its content cleared, the file kept)."""
    _give_back((Path(path).resolve(), LOCK))


@atexit.register
def _release_all() -> None:
    for key in list(_held):
        _give_back(key)
