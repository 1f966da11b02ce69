"""One writer per output folder: a lock file in the folder, held by the process that writes there.

Two processes writing one ``--out`` would both finish and write every record twice (or interleave a report).
The lock is ``fcntl.flock`` on ``OUT/.rope-extend.lock``: the kernel drops it when its process ends, however
it ends (kill -9 included), so a lock left by a dead process is never in the way: the next run takes it over.
The file holds who took it (pid, host, start time, command line), for the message that refuses a second
writer. It stays in the folder (removing it would let two processes lock two different files); its
content is cleared when the holder ends normally.

A process holds the lock of each folder it claimed until it exits (``release`` lets a long-lived caller,
a notebook, give one back). Without ``fcntl`` (Windows) there is no lock.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from pathlib import Path

from .errors import RopeExtendError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks; one writer is then the user's care
    fcntl = None

LOCK = ".rope-extend.lock"
_held: dict[Path, int] = {}  # folder (resolved) -> the open file descriptor holding its lock


def _holder(fd: int) -> str:
    """Who holds the lock, from the file's content: 'pid 123 on host, started ...: rope-extend eval ...'."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 1 << 16).decode("utf-8"))
        return f"pid {info['pid']} on {info['host']}, started {info['started']}: {info['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def lock(path: str | os.PathLike, *, what: str = "--out", probe: bool = False, error=None) -> None:
    """Take the lock of folder ``path`` for this process (again: nothing to do), or raise ``error``
    (``RopeExtendError``) naming the process that holds it. ``probe``: only check that no other process
    holds it (before a long setup), taking nothing."""
    path = Path(path)
    key = path.resolve()
    if key in _held and _same_file(_held[key], path / LOCK):
        return
    release(key)  # held, but the folder was removed and made again since: lock the new one
    if fcntl is None or (probe and not (path / LOCK).exists()):
        return
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise (error or RopeExtendError)(
            f"{what} {path} is being written by another rope-extend process ({holder}); wait for it to end or "
            "give another folder (two writers would record every result twice)"
        ) from None
    if probe:
        os.close(fd)  # closing drops the lock
        return
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(["rope-extend", *sys.argv[1:]])[:300],
    }
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(info) + "\n").encode())
    _held[key] = fd


def release(path: str | os.PathLike) -> None:
    """Give back the lock of folder ``path`` if this process holds it (its content cleared, the file kept)."""
    fd = _held.pop(Path(path).resolve(), None)
    if fd is not None:
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)


@atexit.register
def _release_all() -> None:
    for key in list(_held):
        release(key)
