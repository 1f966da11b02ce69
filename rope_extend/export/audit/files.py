"""Reading the files an audit is given as hostile: only regular files (a FIFO would block, a device never ends),
never more bytes than a limit, JSON of any depth refused with one line.

Links are followed: a model folder in the hub's cache holds its ``config.json`` as a link to a blob, and the
audit only reads. What a link points to is held to the same rules as a file.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from ...errors import RopeExtendError

MAX_JSON_BYTES = 16 << 20  # a config.json is a few kilobytes; the longest (per-layer lists) well under a megabyte


def open_regular(path: Path, what: str) -> BinaryIO:
    """``path`` opened for reading in binary, refused unless it is a regular file. ``O_NONBLOCK`` lets the open of
    a FIFO return at once (to be refused) instead of waiting for a writer; it changes nothing for a regular file."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise RopeExtendError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RopeExtendError(f"{what} {path} is not a regular file")
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def head(path: Path, n: int) -> bytes:
    """The first ``n`` bytes of a regular file (fewer when it is shorter): what tells a GGUF file, without
    reading the rest of a file that may be gigabytes long."""
    with open_regular(path, "the file") as f:
        return f.read(n)


def read_json(path: Path, what: str, limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON value in ``path``, read to at most ``limit`` bytes; a larger file, a file that is not UTF-8 or
    not JSON is one line naming ``what`` and the file."""
    with open_regular(path, what) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise RopeExtendError(f"{what} {path} is larger than {limit} bytes: not a file the audit reads")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RopeExtendError(f"{what} {path} is not UTF-8 text: {exc}") from None
    return parse_json(text, f"{what} {path}")


def parse_json(text: str, what: str) -> Any:
    """``json.loads(text)``; invalid JSON, or JSON nested past Python's recursion limit, is one line."""
    try:
        return json.loads(text)
    except RecursionError:
        raise RopeExtendError(f"{what} is nested too deeply to be read as JSON") from None
    except ValueError as exc:
        raise RopeExtendError(f"{what} is not valid JSON: {exc}") from None
