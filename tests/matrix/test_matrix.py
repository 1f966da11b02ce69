"""The combination matrix (tests/matrix/cells.py): every cell exact against the uncached explicit reference, or
refused before anything runs with a one-line message naming the method and the cache or mode, or not applicable /
not run by a stated rule. Marker ``matrix``: CI runs it in its own step (``pytest -m matrix tests/matrix``); the
default run deselects it (tests/conftest.py).

One test per row (shape, implementation, variant) over its caches and modes, one per compiled cell, and one that
the docs page (docs/combinations.md) is the page these outcomes give. The outcomes are computed once per session,
one model per task in ``run.workers()`` processes.
"""

from __future__ import annotations

import fnmatch
import re
import time
from collections import Counter
from pathlib import Path

import pytest

import rope_extend
from tests.matrix import cells as C
from tests.matrix import table
from tests.matrix.run import Outcome, flex_off_eager, run_all

pytestmark = pytest.mark.matrix

# Cells that fail, with why: {pattern: reason}. A pattern is a cell id (shape-implementation-variant-cache-mode) whose
# fields may list alternatives with | and use fnmatch wildcards. Strict: every cell a pattern matches must fail, and
# every failing cell must match a pattern (test_row, test_compiled). Empty: every cell is exact or refused; a failure
# found later is fixed, or listed here with its reason while it is, and shown on the docs page.
KNOWN_FAILURES: dict[str, str] = {}

DOCS = Path(__file__).resolve().parents[2] / "docs" / "combinations.md"
CELLS = C.all_cells()
ROWS = list(dict.fromkeys((c.shape, c.implementation, c.variant) for c in CELLS))
COMPILED = [c for c in CELLS if c.mode == "compile" and not C.not_applicable(c) and not C.not_run(c)]


def matches(pattern: str, cell: C.Cell) -> bool:
    fields = pattern.split("-")
    values = (cell.shape, cell.implementation, cell.variant, cell.cache, cell.mode)
    assert len(fields) == len(values), f"a KNOWN_FAILURES pattern has five fields: {pattern}"
    return all(any(fnmatch.fnmatchcase(v, alt) for alt in f.split("|")) for f, v in zip(fields, values, strict=True))


def known(cell: C.Cell) -> str | None:
    return next((why for pattern, why in KNOWN_FAILURES.items() if matches(pattern, cell)), None)


@pytest.fixture(scope="session")
def outcomes(request):
    """The outcomes of the cells the selected tests need (all of them when the docs test is selected)."""
    wanted: dict[C.Cell, None] = {}
    for item in request.session.items:
        params = getattr(item, "callspec", None) and item.callspec.params
        if item.name == "test_docs_page_is_current":
            wanted.update(dict.fromkeys(CELLS))
        elif params and "row" in params:
            wanted.update(dict.fromkeys(c for c in CELLS if (c.shape, c.implementation, c.variant) == params["row"]))
        elif params and "cell" in params:
            wanted[params["cell"]] = None
    skipped = {}
    if (why := flex_off_eager()) is not None:  # not a reference here: its cells are left out, said in the log
        skipped = {c: Outcome("not run", why) for c in wanted if c.implementation == "flex_attention"}
    started = time.perf_counter()
    found = run_all([c for c in wanted if c not in skipped]) | skipped
    counts = Counter(o.status for o in found.values())
    compiled = [o for c, o in found.items() if c.mode == "compile" and o.status in ("exact", "failed", "refused")]
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:  # the CI log says what the matrix cost
        with capture.global_and_fixture_disabled():
            reporter.write_line(
                f"\nmatrix: {len(found)} cells in {time.perf_counter() - started:.0f} s ({dict(counts)}); the "
                f"{len(compiled)} compiled cells took {sum(o.seconds for o in compiled):.0f} s"
            )
    return found


def problems(cells: list[C.Cell], outcomes: dict) -> list[str]:
    out = []
    for cell in cells:
        outcome, reason = outcomes[cell], known(cell)
        if outcome.status == "failed" and reason is None:
            out.append(f"{cell.id}: {outcome.cause}: {outcome.detail}")
        elif reason is not None and outcome.status in ("exact", "refused"):
            out.append(f"{cell.id} is {outcome.status} now: take it out of KNOWN_FAILURES ({reason})")
    return out


@pytest.mark.parametrize("row", ROWS, ids=["-".join(row) for row in ROWS])
def test_row(row, outcomes):
    if row[1] == "flex_attention" and (why := flex_off_eager()) is not None:
        pytest.skip(why)
    cells = [c for c in CELLS if (c.shape, c.implementation, c.variant) == row and c.mode != "compile"]
    found = problems(cells, outcomes)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("cell", COMPILED, ids=[c.id for c in COMPILED])
def test_compiled(cell, outcomes):
    found = problems([cell], outcomes)
    assert not found, "\n".join(found)


def test_docs_page_is_current(outcomes, tmp_path_factory):
    # generated with other versions of transformers and torch: the outcomes must still be the page's (a version
    # that changes one fails here, and the page is regenerated on it); only the line naming the versions may differ
    page = re.sub(
        r"transformers [0-9][^,\s]*, torch [0-9][0-9A-Za-z.+]*[0-9A-Za-z]",
        table.version_line(),
        DOCS.read_text(),
        count=1,
    )
    rendered = table.render({c: outcomes[c] for c in CELLS})
    # where FlexAttention is no reference (run.flex_off_eager), the page's other entries are checked
    broken = flex_off_eager() is not None
    if (_without_flex(rendered) != _without_flex(page)) if broken else (rendered != page):
        new = tmp_path_factory.mktemp("matrix") / "combinations.md"
        new.write_text(rendered)
        pytest.fail(
            f"docs/combinations.md is not what the matrix gives ({new}): python -m tests.matrix.table > "
            "docs/combinations.md"
        )


def test_every_known_failure_names_cells():
    unmatched = [pattern for pattern in KNOWN_FAILURES if not any(matches(pattern, c) for c in CELLS)]
    assert not unmatched, f"KNOWN_FAILURES patterns that match no cell: {unmatched}"


def test_the_rows_follow_the_registries():
    """Generated, not hand-listed: every registered method and every cache transformers offers is in the matrix,
    with parameters that patch a model."""
    from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

    assert set(rope_extend.method_names()) < set(C.variants())
    assert set(ALL_CACHE_IMPLEMENTATIONS) < set(C.caches())
    # the sample COMPILE_RULE states: every variant on llama, three on each other shape
    assert len(COMPILED) == len(C.variants()) + 3 * (len(C.SHAPES) - 1)


def _without_flex(page: str) -> list[tuple[str, ...]]:
    """The page's table entries of eager and sdpa only, one ``(shape, variant, implementation, entries)`` each
    (merged rows split), for a machine where FlexAttention is no reference (``run.flex_off_eager``)."""
    shape, entries = "", []
    for line in page.splitlines():
        if line.startswith("## "):
            shape = line[3:]
        elif line.startswith("| ") and not line.startswith("| method "):
            variant, implementations, *codes = (cell.strip() for cell in line.strip("|").split("|"))
            entries += [(shape, variant, i, *codes) for i in implementations.split(", ") if i != "flex_attention"]
    return entries
