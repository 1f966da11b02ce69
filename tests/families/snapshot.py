"""The families snapshot: every (family, method) cell's outcome on one transformers version, committed, so that a
cell that changes (exact to refused, another reason, a family that no longer builds) fails the sweep until the
change is recorded on purpose:

    python -m tests.families.table --update

runs the sweep on the installed transformers, writes its snapshot (``snapshots/transformers-<major.minor>.json``)
and the docs' families page (``docs/families.md``, rendered from every snapshot). A cell is one line of text:

- ``exact``: the patch is accepted and the tests' checks hold (frequencies against the pure math, save and
  reload, ``unpatch`` bit-identical; attention methods against the explicit position-matrix reference);
- ``exact at its reach``: the family's config ships a scaling, which the attention method replaces; it is exact
  with ``target_length`` at the method's reach and refused without it (it would shorten the shipped context);
- ``refused: <reason>``: ``patch`` raised rope-extend's error; the reason is its message without the
  ``<family>: cannot apply '<method>': `` in front (the sweep checks that both are named);
- ``not buildable: <why>``: the tiny model cannot be built or run here, before rope-extend touches it (``tiny``'s
  ``Unbuildable``, or transformers' own unpatched forward failing). A family with this status for every method
  is stored as that one string.
"""

from __future__ import annotations

import json
from pathlib import Path

import transformers

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = "python -m tests.families.table --update"
EXACT, REACH, REFUSED, UNBUILT = "exact", "exact at its reach", "refused: ", "not buildable: "


def version(full: str | None = None) -> str:
    """``major.minor`` of a transformers version (the installed one by default): one snapshot per minor release."""
    return ".".join((full or transformers.__version__).split(".")[:2])


def path(minor: str | None = None) -> Path:
    return SNAPSHOTS / f"transformers-{minor or version()}.json"


def versions() -> list[str]:
    """The minor versions with a committed snapshot, oldest first."""
    found = [p.stem.removeprefix("transformers-") for p in SNAPSHOTS.glob("transformers-*.json")]
    return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))


def load(minor: str | None = None) -> dict | None:
    """``{"transformers": full version, "methods": [...], "reload_differs": [family, ...], "families": {family:
    {method: cell} or cell}}``, or None when the version has no snapshot."""
    p = path(minor)
    return json.loads(p.read_text()) if p.exists() else None


def save(cells: dict[str, dict[str, str]], methods: list[str], reload_differs, full: str | None = None) -> Path:
    """Write the snapshot of ``full`` (the installed version by default): a family whose every cell is the same
    ``not buildable`` is stored as that one string; ``reload_differs`` lists the families whose tiny model a plain
    save and reload does not reproduce, so that their frequency cells cannot check (d) (``frequency_cell``)."""
    families = {}
    for family in sorted(cells):
        row = cells[family]
        values = set(row.values())
        one = next(iter(values)) if len(values) == 1 else None
        families[family] = one if one is not None and one.startswith(UNBUILT) else {m: row[m] for m in methods}
    data = {
        "transformers": full or transformers.__version__,
        "methods": list(methods),
        "reload_differs": sorted(reload_differs),
        "families": families,
    }
    p = path(version(full))
    p.parent.mkdir(exist_ok=True)
    p.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return p


def cell(data: dict | None, family: str, method: str) -> str | None:
    """The recorded cell, or None when the snapshot (or the family in it) is missing."""
    row = None if data is None else data["families"].get(family)
    return row if isinstance(row, str) or row is None else row.get(method)


def rows(data: dict) -> dict[str, dict[str, str]]:
    """Every family's cells, the one-string families spelled out per method."""
    return {f: r if isinstance(r, dict) else dict.fromkeys(data["methods"], r) for f, r in data["families"].items()}


def refused(message: str, family: str, method: str) -> str:
    """The recorded cell of a refusal: its message without the family and method that ``hf.config.naming`` puts in
    front, on one line."""
    return REFUSED + message.split(f"{family}: cannot apply {method!r}: ", 1)[-1].replace("\n", " ")


def unbuilt(exc: BaseException, explicit: bool) -> str:
    """The recorded cell of a family that cannot be built or run: ``tiny.Unbuildable``'s reason as it is, any other
    exception as its type and its message on one line, cut at 200 characters (the sweep then fails unless the
    snapshot holds exactly this)."""
    if explicit:
        return UNBUILT + str(exc)
    message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{UNBUILT}{type(exc).__name__}: {message[:200]}"


def changed(family: str, method: str, recorded: str | None, now: str) -> str:
    """The failure message of a cell that differs from the installed version's snapshot: the cell, what the snapshot
    says (None: the family is not in it) and what it is now, and the command that records it."""
    where = path().relative_to(Path(__file__).parents[2])
    was = f"the family is not in {where}" if recorded is None else f"{where} records {recorded!r}"
    return (
        f"{family} x {method}: {was}; it is now {now!r}. If that is intended, record it with `{UPDATE}` "
        "(it rewrites the snapshot and docs/families.md) and commit both."
    )
