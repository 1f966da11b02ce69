"""The families sweep outside pytest, and the docs' families page (docs/families.md) rendered from its snapshots.

    python -m tests.families.table --update     # sweep; write the installed transformers' snapshot and the page
    python -m tests.families.table              # sweep; print the cells that differ from the snapshot
    python -m tests.families.table --render     # no sweep: the page from the committed snapshots
    python -m tests.families.table --update cohere2 exaone4     # only these families' rows (seconds, not minutes)

Run ``--update`` with each transformers version that has a snapshot (CI's oldest, 5.17, is in a venv of its own);
the page holds one table per version and ``test_table.py`` checks it equals what the snapshots render. The sweep is
``tests.families.sweep``, the one ``test_families.py`` runs: a cell that fails a check there is reported here as an
error, and neither the snapshot nor the page is written.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import transformers

from tests.families import snapshot
from tests.families.snapshot import UNBUILT

PAGE = Path(__file__).parents[2] / "docs" / "families.md"
# a family that allows one rope type names the method's type in its reason: one reason for every method
_TYPES = re.compile(r"\b(linear|yarn|dynamic_ntk|llama3|longrope|self_extend|dual_chunk|rerope|string)\b")

HEADER = """# Model families

Every RoPE family in transformers' registry, built as a tiny random model (`tests/families/tiny.py`), x every
method. `exact`: the frequency methods' buffers equal the pure math, the patched model saves and reloads to the same
logits and `unpatch` gives the original back bit for bit; the attention methods' logits equal an explicit
position-matrix reference. `exact*`: the family's config ships a scaling, which the attention method replaces; it is
exact with `target_length` at the method's reach, and refused without it (it would shorten the shipped context).
`refused [n]`: `patch` raises before touching the model, with the family, the method and reason `n` below.

Each cell is pinned: the sweep (`tests/families/test_families.py`, on transformers 5.17 and the newest release)
fails when a cell differs from the committed snapshot of its transformers version
(`tests/families/snapshots/`). This page is rendered from those snapshots by
`python -m tests.families.table --update`, which records a deliberate change; do not edit it by hand.
"""


# a refusal that names the method in its sentence ("self_extend has nothing to change"): one reason for every method
_NAMED = re.compile(
    r"\b(self_extend|dual_chunk|rerope|leaky_rerope|string)(?=('s position rules| has nothing to change))"
)


def _generic(reason: str) -> str:
    reason = _NAMED.sub("the method", reason)
    return _TYPES.sub("<the method's type>", reason) if "requires" in reason else reason


def render_version(data: dict) -> list[str]:
    """One version's section: the summary, the table, the numbered refusals and the families not built."""
    methods, rows = data["methods"], snapshot.rows(data)
    reasons: dict[str, int] = {}
    table = ["| family | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    counts = dict.fromkeys(("exact", "refused", "not built"), 0)
    unbuilt = []
    for family, row in rows.items():
        if isinstance(data["families"][family], str):
            unbuilt.append(f"- {family}: {row[methods[0]].removeprefix(snapshot.UNBUILT)}")
            continue
        cells = []
        for method in methods:
            value = row[method]
            if value.startswith(snapshot.REFUSED):
                number = reasons.setdefault(_generic(value.removeprefix(snapshot.REFUSED)), len(reasons) + 1)
                cells.append(f"refused [{number}]")
                counts["refused"] += 1
            elif value.startswith(snapshot.UNBUILT):
                cells.append("not built")
                counts["not built"] += 1
                unbuilt.append(f"- {family} x {method}: {value.removeprefix(snapshot.UNBUILT)}")
            else:
                cells.append({snapshot.EXACT: "exact", snapshot.REACH: "exact\\*"}[value])
                counts["exact"] += 1
        table.append(f"| {family} | " + " | ".join(cells) + " |")
    whole = sum(isinstance(r, str) for r in data["families"].values())
    more = f" and {counts['not built']} more cells" if counts["not built"] else ""
    summary = (
        f"transformers {data['transformers']}: {len(rows)} RoPE families; {counts['exact']} family x method cells "
        f"exact, {counts['refused']} refused; {whole} families{more} not built here."
    )
    lines = [f"## transformers {snapshot.version(data['transformers'])}", "", summary, "", *table]
    lines += ["", "Refusals:", ""] + [f"{n}. {reason}" for reason, n in reasons.items()]
    if unbuilt:
        lines += ["", "Not built here:", "", *unbuilt]
    if data["reload_differs"]:
        lines += ["", "Save and reload not checked (a plain save and reload of the tiny model changes its logits):"]
        lines += ["", ", ".join(data["reload_differs"]) + "."]
    return lines


def render() -> str:
    """The page: every snapshot, the newest version first."""
    lines = [HEADER]
    for minor in reversed(snapshot.versions()):
        lines += [*render_version(snapshot.load(minor)), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def sweep(families: list[str], log=sys.stderr) -> tuple[dict[str, dict[str, str]], set[str], list[str]]:
    """``(cells, reload_differs, errors)``: each of ``families`` x every method, as the tests run them; the families
    whose plain save and reload does not reproduce the tiny model; the cells that failed a check."""
    from tests.families.sweep import METHODS, one_thread, open_family, run  # builds nothing until called

    cells, differs, errors = {}, set(), []
    with tempfile.TemporaryDirectory() as tmp, one_thread():
        for i, name in enumerate(families):
            start, row = time.perf_counter(), cells.setdefault(name, {})
            try:
                family = open_family(name, Path(tmp) / name)  # saving and reloading must work
            except Exception as exc:  # noqa: BLE001 - reported: the tests fail on it
                errors.append(_error(name, "saving and reloading", exc))
                continue
            if family.status is None and not family.reproducible:
                differs.add(name)
            try:
                for method in METHODS:
                    try:
                        row[method] = run(family, method)
                    except (Exception, pytest.fail.Exception) as exc:  # noqa: BLE001 - reported: the tests fail on it
                        errors.append(_error(name, method, exc))
                        row[method] = f"error: {exc}"
            finally:
                family.close()
            print(f"[{i + 1}/{len(families)}] {name}: {time.perf_counter() - start:.1f} s", file=log, flush=True)
    return cells, differs, errors


def _error(family: str, what: str, exc: BaseException) -> str:
    return f"{family} x {what}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


def differences(before: dict | None, cells: dict[str, dict[str, str]]) -> list[str]:
    """The cells that differ from a snapshot, one line each: ``family x method: old -> new``."""
    if before is None:
        return []
    old = snapshot.rows(before)
    out = [f"{f}: new family" for f in sorted(set(cells) - set(old))]
    out += [f"{f}: no longer in the registry" for f in sorted(set(old) - set(cells))]
    for family in sorted(set(cells) & set(old)):
        for method, now in cells[family].items():
            was = old[family].get(method)
            if was != now:
                out.append(f"{family} x {method}: {was!r} -> {now!r}")
    return out


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.families.table", description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--update", action="store_true", help="write the snapshot and docs/families.md")
    group.add_argument("--render", action="store_true", help="only render docs/families.md from the snapshots")
    parser.add_argument("families", nargs="*", help="only these families (default: every RoPE family)")
    args = parser.parse_args(argv)
    if args.render:
        PAGE.write_text(render())
        print(f"wrote {PAGE}")
        return 0
    _quiet()
    from tests.families.sweep import METHODS
    from tests.families.tiny import rope_families

    registry, recorded = rope_families(), snapshot.load()
    unknown = sorted(set(args.families) - set(registry))
    if unknown:
        parser.error(f"not RoPE families of transformers {transformers.__version__}: {', '.join(unknown)}")
    if args.families and args.update and recorded is None:
        parser.error(f"transformers {transformers.__version__} has no snapshot yet: --update without families")
    start = time.perf_counter()
    cells, differs, errors = sweep(args.families or registry)
    older = [v for v in snapshot.versions() if v != snapshot.version()]
    against = recorded if recorded is not None else (snapshot.load(older[-1]) if older else None)
    if args.families and recorded is not None:  # the other families' rows as recorded
        cells = {**snapshot.rows(recorded), **cells}
        cells = {f: cells[f] for f in registry if f in cells}
        differs |= set(recorded["reload_differs"]) - set(args.families)
    if against is not None:
        diff = differences(against, cells)
        label = f"the snapshot of transformers {snapshot.version(against['transformers'])}"
        print(f"{len(diff)} cells differ from {label}" + (":" if diff else ""))
        print("\n".join(f"  {line}" for line in diff))
    print(f"swept in {time.perf_counter() - start:.0f} s")
    if errors:
        print(f"{len(errors)} cells are neither exact nor refused (the tests fail on them); nothing written:")
        print("\n".join(f"  {line}" for line in errors))
        return 1
    unexplained = sorted({f"{f}: {c}" for f, row in cells.items() for c in row.values() if c.startswith(UNBUILT)})
    if unexplained:
        print("not buildable here (the sweep skips these cells while the snapshot records them):")
        print("\n".join(f"  {line}" for line in unexplained))
    if args.update:
        print(f"wrote {snapshot.save(cells, list(METHODS), differs)}")
        PAGE.write_text(render())
        print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
