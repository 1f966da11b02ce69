"""``rope_extend.progress.bar``: in a log (a file or a pipe) a bar prints a line every ``LOG_INTERVAL`` seconds, not
every update; on a terminal it is tqdm's; and it is the only bar of the package."""

from __future__ import annotations

import ast
import io
from pathlib import Path

import pytest

import rope_extend
from rope_extend import progress


class _Clock:
    """tqdm's clock (``bar._time``), moved by hand: 0.1 s per update."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _draws(stream: io.StringIO) -> int:
    return stream.getvalue().count("\r")


def _run(bar, clock: _Clock, updates: int) -> None:
    bar._time = clock
    bar.start_t = bar.last_print_t = clock.now
    for i in range(updates):
        clock.now += 0.1
        bar.set_postfix(step=i)  # refresh=True by default: a draw of its own on a terminal
        bar.update(1)
    bar.close()


def test_a_bar_in_a_log_prints_a_line_every_interval_only(monkeypatch):
    monkeypatch.delenv("TQDM_MININTERVAL", raising=False)
    monkeypatch.delenv("TQDM_MAXINTERVAL", raising=False)
    log = io.StringIO()  # not a terminal
    bar = progress.bar(total=1000, file=log, desc="measure")
    assert bar.mininterval == bar.maxinterval == progress.LOG_INTERVAL == 30.0
    _run(bar, _Clock(), 1000)  # 100 s of updates
    # the first draw, one per 30 s (3 in 100 s) and the last: not one per update and postfix
    assert _draws(log) == 5
    last = log.getvalue().rstrip().rsplit("\r", 1)[-1]
    assert "1000/1000 [01:" in last and last.endswith("10.00it/s, step=999]")


def test_tqdms_own_bar_would_print_every_update(monkeypatch):
    """The same run through tqdm as the package used it before: a line per update and per postfix."""
    from tqdm.auto import tqdm

    log = io.StringIO()
    _run(tqdm(total=1000, file=log), _Clock(), 1000)
    assert _draws(log) > 1000


def test_a_terminal_keeps_tqdms_bar_and_the_environment_wins(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    bar = progress.bar(total=3, file=Terminal())
    assert type(bar) is not progress._Logged and bar.mininterval == 0.1
    bar.close()
    monkeypatch.setenv("TQDM_MININTERVAL", "5")
    bar = progress.bar(total=3, file=io.StringIO())
    assert bar.mininterval == 5 and bar.maxinterval == progress.LOG_INTERVAL
    bar.close()


@pytest.mark.parametrize("stream", [None, io.StringIO()])
def test_a_disabled_bar_prints_nothing(stream, capsys):
    bar = progress.bar(range(3), disable=True, file=stream)
    assert list(bar) == [0, 1, 2]
    assert capsys.readouterr().err == "" and (stream is None or stream.getvalue() == "")


def test_progress_is_the_only_module_that_makes_a_bar():
    """Every bar of the package goes through ``progress.bar`` (one mechanism for logs): no other module imports
    tqdm."""
    package = Path(rope_extend.__file__).parent
    importers = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if any(n == "tqdm" or n.startswith("tqdm.") for n in names):
                importers.append(str(path.relative_to(package)))
    assert sorted(set(importers)) == ["progress.py"]
