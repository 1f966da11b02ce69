"""Writing files so that nothing is left half-written: write to a temporary name, then rename."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` in one rename.

    Works for a file or a folder. On an exception the temporary is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    target = tmp / path.name
    try:
        yield target
        if path.is_dir() and not path.is_symlink() and target.is_dir():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(target, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(target, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: str | os.PathLike, data: Any) -> Path:
    return write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
