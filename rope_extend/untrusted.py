"""Reading a file that anyone could have written, and showing what it holds, without being led astray by it.

Every file rope-extend reads but did not just write is read here: a user's inputs (a config.json, a suite's
``params_from``, an earlier run's ``results.json``) and what rope-extend wrote into an output folder where a
careless or hostile hand may have replaced it since (a marker, a records file, a checkpoint's state, a lock's
holder record). The rules, each one a failure seen in practice:

- only a regular file is read: a named pipe would block the reader until something writes to it (the open is
  made with ``O_NONBLOCK``, so it returns at once to be refused), and a device (``/dev/zero``) never ends;
- ``follow_links=False`` for a file rope-extend itself made in an output folder: a link there was put by someone
  else, and reading through it would take another file's content for rope-extend's (``O_NOFOLLOW``: the kernel
  refuses the link, with no window between a check and the open); ``True`` for a user's input, which may well
  be a link (a model folder in the hub's cache holds its ``config.json`` as a link to a blob);
- at most ``limit`` bytes are read: a larger file is refused in one line naming the file, the limit and what the
  file should be, before any of it is decoded;
- the bytes must be UTF-8 and, for JSON, valid JSON nested no deeper than Python's recursion limit (``json``
  recurses; 100,000 ``[`` would end in a RecursionError);
- a value from such a file is shown in a message by ``shown`` (``errors.shown``, re-exported here): ``repr``
  bounded without walking the whole value (a list of a million items, a string of a gigabyte), so the message
  stays one short line and costs no time.

Each refusal is one ``error`` (``RopeExtendError`` unless the caller names its own subclass) naming the file
(``name``, by default its path) and ending with ``fix``: what the file should be, or what to do.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from .errors import RopeExtendError, shown  # noqa: F401  (shown: errors.shown, importable from here as before)

MAX_JSON_BYTES = 16 << 20  # a config.json is a few kilobytes; the longest (per-layer lists) well under a megabyte
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_RAISE = object()  # decode_json's ``invalid`` when invalid JSON is an error


def _said(name: str, problem: str, fix: str) -> str:
    return f"{name} {problem}" + (f": {fix}" if fix else "")


def entry_kind(mode: int) -> str | None:
    """What an entry of ``mode`` (from ``lstat``) is when it is not a regular file: 'a symbolic link', 'a folder',
    'a named pipe', 'a socket or device'; None for a regular file. The one wording of every refusal of an entry
    that is not a file (the reader here, the lock, the records file)."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "a named pipe" if stat.S_ISFIFO(mode) else "a socket or device"


def _not_regular(mode: int) -> str | None:
    """``entry_kind`` with what rope-extend reads instead, for a reader's message; None for a regular file."""
    kind = entry_kind(mode)
    if kind == "a symbolic link":
        return f"{kind}: rope-extend never reads a file it wrote through a link"
    if kind == "a folder":
        return f"{kind}, not a file"
    return None if kind is None else f"{kind}, not a regular file"


def _open_failed(path: Path, name: str, exc: OSError, follow_links: bool, fix: str) -> str:
    """The one line for an ``os.open`` of ``path`` that failed: what is there, if that is why, else the reason."""
    try:
        st = os.stat(path) if follow_links else os.lstat(path)
    except OSError:
        st = None
    kind = _not_regular(st.st_mode) if st is not None else None
    if kind is not None:
        return _said(name, f"is {kind}", fix)
    if exc.errno == errno.ENOENT:
        if os.path.islink(path):
            return _said(name, f"is a link to nothing ({os.readlink(path)})", fix)
        return f"{name}: no such file" + (f": {fix}" if fix else "")
    return _said(f"cannot read {name}", f"({exc.strerror or type(exc).__name__})", fix)


def open_regular(
    path: str | os.PathLike, *, name: str | None = None, follow_links: bool = True, fix: str = "", error=None
) -> BinaryIO:
    """``path`` opened for reading in binary (unbuffered), refused unless it is a regular file (and, without
    ``follow_links``, unless it is one itself rather than a link to one). What is there is looked at before the
    open (opening some devices does something) and checked again on what was opened (it may have been swapped
    in between); ``O_NONBLOCK`` lets the open of a named pipe return at once, to be refused, instead of waiting
    for a writer, and changes nothing for a file."""
    path = Path(path)
    name = name or str(path)
    try:
        kind = _not_regular((os.stat(path) if follow_links else os.lstat(path)).st_mode)
    except OSError:
        kind = None  # the open says why
    if kind is not None:
        raise (error or RopeExtendError)(_said(name, f"is {kind}", fix))
    try:
        fd = os.open(path, _FLAGS | (0 if follow_links else _NOFOLLOW))
    except OSError as exc:
        raise (error or RopeExtendError)(_open_failed(path, name, exc, follow_links, fix)) from None
    try:
        kind = _not_regular(os.fstat(fd).st_mode)
        if kind is not None:
            raise (error or RopeExtendError)(_said(name, f"is {kind}", fix))
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def check_folder(folder: str | os.PathLike, *, ignore=None, fix: str = "", error=None) -> None:
    """Refuse, in one line naming the entry and what it is, a folder of a user's (a model folder to be copied)
    that holds anything but regular files and folders: a named pipe (a copy would wait for a writer), a device
    (``/dev/zero`` never ends), a socket, a link to nothing, or a link to a folder (it may lead anywhere, back
    into the folder itself included). A link to a regular file is followed, as a user's input may be one (the
    hub's cache keeps each file of a model as a link to a blob). ``ignore`` is ``shutil.copytree``'s: what it
    leaves out of the copy is not looked at."""
    fail = error or RopeExtendError
    stack = [Path(folder)]
    while stack:
        current = stack.pop()
        try:
            names = sorted(os.listdir(current))
        except OSError as exc:
            raise fail(
                _said(f"cannot read the folder {current}", f"({exc.strerror or type(exc).__name__})", fix)
            ) from None
        skipped = set(ignore(os.fspath(current), names)) if ignore is not None else set()
        for name in names:
            if name in skipped:
                continue
            path = current / name
            problem = _not_copyable(path)
            if problem == "a folder":
                stack.append(path)
            elif problem is not None:
                raise fail(_said(str(path), f"is {problem}", fix))


def _not_copyable(path: Path) -> str | None:
    """What ``path`` is when a copy should not read it ("a named pipe, ...", "a link to nothing (...)"), "a folder"
    for a folder (walked, not read), None for a regular file or a link to one."""
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:  # gone since the listing
        return f"unreadable ({exc.strerror or type(exc).__name__})"
    if not stat.S_ISLNK(mode):
        return "a folder" if stat.S_ISDIR(mode) else _not_regular(mode)
    target = os.readlink(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:  # a link to nothing, a loop of links, a target that may not be looked at
        if exc.errno == errno.ENOENT:
            return f"a link to nothing ({target})"
        return f"a link that cannot be followed ({target}: {exc.strerror or type(exc).__name__})"
    if stat.S_ISDIR(mode):
        return f"a link to a folder ({target}), not a file"
    kind = _not_regular(mode)
    return None if kind is None else f"a link to {target}, {kind}"


def read_up_to(f: BinaryIO, n: int) -> bytes:
    """Up to ``n`` bytes from ``f`` (fewer only at its end): an unbuffered read may return less than asked."""
    parts, left = [], n
    while left > 0:
        part = f.read(min(left, 1 << 24))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def head(path: str | os.PathLike, n: int, *, name: str | None = None, error=None) -> bytes:
    """The first ``n`` bytes of a regular file (fewer when it is shorter): what tells a file's format, without
    reading the rest of a file that may be gigabytes long."""
    with open_regular(path, name=name, error=error) as f:
        return read_up_to(f, n)


def read_bytes(
    path: str | os.PathLike,
    *,
    limit: int,
    name: str | None = None,
    follow_links: bool = True,
    fix: str = "",
    error=None,
) -> bytes:
    """The content of the regular file ``path``, refused when it is larger than ``limit`` bytes (told by its
    size, or, for a file whose size says nothing, by reading one byte past the limit)."""
    name = name or str(path)
    with open_regular(path, name=name, follow_links=follow_links, fix=fix, error=error) as f:
        too_big = os.fstat(f.fileno()).st_size > limit
        data = b"" if too_big else read_up_to(f, limit + 1)
    if too_big or len(data) > limit:
        raise (error or RopeExtendError)(_said(name, f"is larger than {limit} bytes", fix))
    return data


def decode_text(data: bytes, name: str, *, fix: str = "", error=None) -> str:
    """``data`` decoded as UTF-8; anything else is one line naming the first byte that is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise (error or RopeExtendError)(_said(name, f"is not UTF-8 text (byte {exc.start})", fix)) from None


def read_text(
    path: str | os.PathLike,
    *,
    limit: int,
    name: str | None = None,
    follow_links: bool = True,
    fix: str = "",
    error=None,
) -> str:
    """The UTF-8 text of the regular file ``path``, at most ``limit`` bytes of it (``read_bytes``), its line
    endings read as ``open`` in text mode reads them (universal newlines): ``"\\r\\n"`` and a lone ``"\\r"``
    are ``"\\n"``, so a file saved on Windows is the same text as one saved elsewhere."""
    name = name or str(path)
    data = read_bytes(path, limit=limit, name=name, follow_links=follow_links, fix=fix, error=error)
    return decode_text(data, name, fix=fix, error=error).replace("\r\n", "\n").replace("\r", "\n")


def decode_json(data: bytes | str, name: str, *, fix: str = "", error=None, invalid: Any = _RAISE) -> Any:
    """The JSON value of ``data`` (UTF-8 bytes or text). Invalid JSON is one line, or ``invalid`` when given (a
    line cut short by an interrupted write, which the caller skips); JSON nested past Python's recursion limit,
    or holding an integer past its 4300 digits, is always one line: made, not cut short."""
    text = decode_text(data, name, fix=fix, error=error) if isinstance(data, bytes) else data
    try:
        return json.loads(text)
    except RecursionError:
        raise (error or RopeExtendError)(_said(name, "is nested too deeply to be read as JSON", fix)) from None
    except json.JSONDecodeError as exc:
        if invalid is not _RAISE:
            return invalid
        problem = f"is not valid JSON ({' '.join(str(exc).split())})"
    except ValueError as exc:  # an integer of more than 4300 digits: no file rope-extend reads holds one
        problem = f"is not valid JSON ({' '.join(str(exc).split())[:150]})"
    raise (error or RopeExtendError)(_said(name, problem, fix))


def read_json(
    path: str | os.PathLike,
    *,
    limit: int = MAX_JSON_BYTES,
    name: str | None = None,
    follow_links: bool = True,
    fix: str = "",
    error=None,
) -> Any:
    """The JSON value in the regular file ``path`` (``read_bytes``, then ``decode_json``)."""
    name = name or str(path)
    data = read_bytes(path, limit=limit, name=name, follow_links=follow_links, fix=fix, error=error)
    return decode_json(data, name, fix=fix, error=error)


def read_object(
    path: str | os.PathLike,
    *,
    limit: int = MAX_JSON_BYTES,
    name: str | None = None,
    follow_links: bool = True,
    fix: str = "",
    error=None,
) -> dict[str, Any]:
    """``read_json`` of a file that must hold a JSON object (``{...}``); anything else is one line naming it."""
    name = name or str(path)
    data = read_json(path, limit=limit, name=name, follow_links=follow_links, fix=fix, error=error)
    if not isinstance(data, dict):
        kind = {list: "a list", str: "a string", bool: "true or false", type(None): "null"}.get(type(data), "a number")
        raise (error or RopeExtendError)(_said(name, f"holds {kind}, not a JSON object", fix))
    return data
