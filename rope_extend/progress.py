"""Progress bars: ``bar`` is the one tqdm bar of every loop of the package (the evaluation runner, the training
loop, the factor search); ``tests/test_progress.py`` checks that no other module makes its own.

On a terminal a bar redraws in place, so each update costs nothing to read. Written to a file or a pipe (a log,
``| tee``, CI), every redraw is one more line: the demo's 4-minute log was 75 KB, mostly bars. There a bar
prints a line at most every ``LOG_INTERVAL`` seconds, besides its first and its last, and a postfix or
description set with ``refresh=True`` waits for that line instead of printing one of its own. tqdm's own
environment overrides (``TQDM_MININTERVAL``, ``TQDM_MAXINTERVAL``) still win, and a notebook keeps its widget.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from tqdm import tqdm as _std_tqdm
from tqdm.auto import tqdm as _auto_tqdm

LOG_INTERVAL = 30.0  # seconds between two lines of a bar in a log: a 10-minute stage writes about 20


class _Logged(_std_tqdm):
    """A bar written to a file or a pipe: it refreshes only on its own clock (``mininterval``)."""

    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        super().set_postfix(ordered_dict, refresh=False, **kwargs)

    def set_description(self, desc=None, refresh=True):
        super().set_description(desc, refresh=False)


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` redraws in place (a terminal), as opposed to a file or a pipe, where each draw is kept."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):  # a closed or detached stream
        return False


def _seconds(variable: str) -> float:
    """``LOG_INTERVAL``, or the environment's ``variable`` when it holds a number of seconds (read at each bar:
    tqdm reads its own only when it is imported)."""
    try:
        value = float(os.environ.get(variable, LOG_INTERVAL))
    except ValueError:
        return LOG_INTERVAL
    return value if value >= 0 else LOG_INTERVAL


def _in_notebook(cls: type) -> bool:
    return any(base.__module__ == "tqdm.notebook" for base in cls.__mro__)


def bar(iterable=None, **kwargs: Any):
    """A tqdm bar (``tqdm.auto``'s on a terminal or in a notebook) over ``iterable`` with tqdm's keywords; to a
    file or a pipe, one line every ``LOG_INTERVAL`` seconds at most (see the module docstring)."""
    stream = kwargs.get("file") or sys.stderr
    if kwargs.get("disable") or is_terminal(stream) or _in_notebook(_auto_tqdm):
        return _auto_tqdm(iterable, **kwargs)
    for key in ("mininterval", "maxinterval"):  # maxinterval: tqdm's monitor would otherwise print every 10 s
        kwargs.setdefault(key, _seconds(f"TQDM_{key.upper()}"))
    return _Logged(iterable, **kwargs)
