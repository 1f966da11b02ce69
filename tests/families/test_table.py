"""The docs cannot drift from the families snapshots (no model is built here: seconds).

- ``docs/families.md`` is exactly what ``table.render()`` makes of the committed snapshots;
- the hand-picked table of ``docs/methods.md`` ("The families users run most", on the newest transformers with a
  snapshot) says of each family what that snapshot records: ``yes`` exact, ``yes*`` exact at its reach, ``no``
  refused;
- every snapshot is well formed: each cell one of the four statuses, the same methods in every row.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.families import snapshot, table

METHODS_PAGE = Path(__file__).parents[2] / "docs" / "methods.md"
WORDS = {"yes": snapshot.EXACT, "yes*": snapshot.REACH, "no": snapshot.REFUSED}


def test_there_are_snapshots():
    assert snapshot.versions(), f"no snapshot in {snapshot.SNAPSHOTS}: `{snapshot.UPDATE}`"


def test_families_page_is_rendered_from_the_snapshots():
    assert table.PAGE.read_text() == table.render(), (
        f"{table.PAGE.name} differs from the snapshots: `python -m tests.families.table --render` (or --update)"
    )


@pytest.mark.parametrize("minor", snapshot.versions())
def test_snapshot_is_well_formed(minor):
    data = snapshot.load(minor)
    assert snapshot.version(data["transformers"]) == minor
    for family, row in data["families"].items():
        if isinstance(row, str):
            assert row.startswith(snapshot.UNBUILT), (family, row)
            continue
        assert list(row) == data["methods"], family
        for method, value in row.items():
            ok = value in (snapshot.EXACT, snapshot.REACH) or value.startswith((snapshot.REFUSED, snapshot.UNBUILT))
            assert ok and "\n" not in value, (family, method, value)


def _hand_table() -> tuple[list[str], dict[str, list[str]]]:
    """``(methods, {model_type: words})`` of the table after "The families users run most"."""
    text = METHODS_PAGE.read_text()
    lines = text[text.index("The families users run most") :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| family |"))
    methods = [c.strip() for c in lines[start].strip("|").split("|")][1:]
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        first, *words = (c.strip() for c in line.strip("|").split("|"))
        rows[re.search(r"`(\w+)`", first).group(1)] = words
    return methods, rows


def test_methods_page_families_agree_with_the_newest_snapshot():
    methods, rows = _hand_table()
    minor = snapshot.versions()[-1]
    recorded = snapshot.rows(snapshot.load(minor))
    assert rows and f"transformers {minor}" in METHODS_PAGE.read_text(), (
        f"docs/methods.md names another version than {minor}"
    )
    for family, words in rows.items():
        assert family in recorded, f"docs/methods.md names {family}, which is not in {minor}'s snapshot"
        for method, word in zip(methods, words, strict=True):
            value, want = recorded[family][method], WORDS[word]
            ok = value == want if want != snapshot.REFUSED else value.startswith(want)
            assert ok, f"docs/methods.md says {family} x {method} is {word!r}; transformers {minor}: {value!r}"
