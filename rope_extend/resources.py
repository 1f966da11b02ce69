"""Files that ship inside the package, and how a name finds them.

- ``recipes/``: fine-tuning recipes (YAML), ``recipes/accelerate/`` launcher configs, ``recipes/data/``
  the small text the tiny recipe trains on;
- ``suites/``: evaluation suites (YAML) for ``rope-extend eval compare``;
- ``bundled/model`` and ``bundled/data/eval.jsonl``: the bundled testbed model and its held-out corpus.

They are package data, so they are there after ``pip install rope-extend`` as in a checkout: a recipe or
suite can be named (``tiny-cpu``) from any working directory.
"""

from __future__ import annotations

from pathlib import Path

from .errors import RopeExtendError, closest

PACKAGE = Path(__file__).resolve().parent
RECIPES = PACKAGE / "recipes"
SUITES = PACKAGE / "suites"
BUNDLED_MODEL = PACKAGE / "bundled" / "model"
BUNDLED_EVAL_CORPUS = PACKAGE / "bundled" / "data" / "eval.jsonl"


def names(folder: Path) -> list[str]:
    """The YAML files of ``folder`` by name (no suffix), sorted."""
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def find(name: str | Path, folder: Path, what: str, error: type[RopeExtendError] = RopeExtendError) -> Path:
    """``name`` as a path when it is a file; else the shipped ``folder/name.yaml``."""
    path = Path(name)
    if path.is_file():
        return path
    if path.exists():
        raise error(f"{what} {str(name)!r} is a folder, not a YAML file")
    for candidate in (folder / str(name), folder / f"{name}.yaml"):
        if candidate.is_file() and candidate.parent == folder:
            return candidate
    known = names(folder)
    raise error(
        f"{what} {str(name)!r}: no such file, and not the name of a shipped {what}{closest(name, known)} "
        f"(shipped: {', '.join(known) or 'none'})"
    )


def find_recipe(name: str | Path, error: type[RopeExtendError] = RopeExtendError) -> Path:
    return find(name, RECIPES, "recipe", error)


def find_suite(name: str | Path, error: type[RopeExtendError] = RopeExtendError) -> Path:
    return find(name, SUITES, "suite", error)


def beside(anchor: str | Path | None, value: str | None) -> str | None:
    """A relative path written in a YAML file: relative to that file when it exists there, else unchanged
    (relative to the working directory), so shipped recipes and suites find their data from anywhere."""
    if value is None or anchor is None or Path(value).is_absolute():
        return value
    candidate = Path(anchor).parent / value
    return str(candidate) if candidate.exists() else value
