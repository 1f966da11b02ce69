"""Inputs of the harnesses: context lengths and texts (local files, a folder, JSONL, Parquet, or a hub dataset).

Nothing here downloads anything unless the caller names a hub dataset and a hub is reachable; offline, a
name that is not a local path is an error that says so.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..errors import RopeExtendError

_LENGTH = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")
_UNITS = {"": 1, "k": 1024, "m": 1024 * 1024}  # "4k" = 4096, as in "Llama 2 4k context"


def parse_length(value: Any) -> int:
    """``4096``, ``"4096"``, ``"4k"`` (= 4096), ``"0.5k"`` (= 512) -> a positive integer token count."""
    if isinstance(value, bool):
        raise RopeExtendError(f"a length must be a positive integer number of tokens (e.g. 4096 or 4k), got {value!r}")
    if isinstance(value, int):
        number = value
    else:
        match = _LENGTH.match(str(value))
        exact = float(match.group(1)) * _UNITS[match.group(2).lower()] if match else None
        if exact is None or exact != int(exact):
            raise RopeExtendError(
                f"a length must be a positive integer number of tokens (e.g. 4096, 4k = 4096, 0.5k = 512), got {value!r}"
            )
        number = int(exact)
    if number < 1:
        raise RopeExtendError(f"a length must be a positive integer number of tokens, got {value!r}")
    return number


def parse_lengths(values: str | int | Iterable[Any]) -> list[int]:
    """``"1k,2k,4k"`` or ``[1024, "2k"]`` -> ``[1024, 2048, 4096]`` (sorted, without repeats)."""
    if isinstance(values, str):
        items = [v for v in values.split(",") if v.strip()]
    elif isinstance(values, int):
        items = [values]
    else:
        items = list(values)
    if not items:
        raise RopeExtendError("no lengths given: pass at least one positive integer, e.g. 1k,2k,4k")
    return sorted({parse_length(v) for v in items})


def parse_depths(values: str | float | Iterable[Any] | None) -> list[float] | None:
    """Needle depths as fractions in [0, 1]: ``"0,0.5,1"``, ``"0%,50%,100%"``, or ``"grid:5"`` (5 evenly spaced)."""
    if values is None:
        return None
    if isinstance(values, str):
        text = values.strip()
        if text.startswith("grid:"):
            n = text[5:]
            if not n.isdigit() or int(n) < 2:
                raise RopeExtendError(f"a depth grid is grid:N with an integer N >= 2, got {values!r}")
            n = int(n)
            return [i / (n - 1) for i in range(n)]
        items = [v for v in text.split(",") if v.strip()]
    elif isinstance(values, (int, float)):
        items = [values]
    else:
        items = list(values)
    depths = []
    for item in items:
        raw = str(item).strip()
        try:
            depth = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
        except ValueError:
            depth = float("nan")
        if not 0.0 <= depth <= 1.0:
            raise RopeExtendError(f"a depth is a fraction in [0, 1] or a percentage 0%..100%, got {item!r}")
        depths.append(depth)
    if not depths:
        raise RopeExtendError("no depths given: pass fractions like 0,0.5,1 or grid:5")
    return sorted(set(depths))


# ------------------------------------------------------------------------------------------ texts
def _from_dataset(kind: str, files: str | list[str], text_field: str, split: str) -> list[str]:
    import datasets

    ds = datasets.load_dataset(kind, data_files=files, split=split)
    if text_field not in ds.column_names:
        raise RopeExtendError(
            f"{files}: no column {text_field!r}; its columns are {', '.join(ds.column_names)} (choose one with --text-field)"
        )
    return [str(t) for t in ds[text_field] if t]


def _hub_offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def load_texts(source: str | os.PathLike | Sequence[str], *, text_field: str = "text", split: str = "train",
               max_docs: int | None = None) -> list[str]:
    """Documents from ``source``, in a stable order.

    - a list of strings: used as is;
    - a ``.txt`` (or any plain text) file: one document;
    - a folder: every ``*.txt`` file in it (sorted by name), one document each;
    - ``.jsonl``/``.json``/``.parquet``: through ``datasets``, the ``text_field`` column;
    - anything else: a hub dataset name (``datasets.load_dataset(name, split=split)``), only when a hub is
      reachable; offline that is an error.
    """
    if not isinstance(source, (str, os.PathLike)):
        texts = [str(t) for t in source]
    else:
        path = Path(source)
        suffix = path.suffix.lower()
        if path.is_dir():
            files = sorted(path.rglob("*.txt"))
            if not files:
                raise RopeExtendError(f"{path} is a folder without .txt files; give .txt files, JSONL or Parquet")
            texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
        elif path.is_file() and suffix in (".jsonl", ".json"):
            texts = _from_dataset("json", str(path), text_field, "train")
        elif path.is_file() and suffix == ".parquet":
            texts = _from_dataset("parquet", str(path), text_field, "train")
        elif path.is_file():
            texts = [path.read_text(encoding="utf-8", errors="replace")]
        elif _hub_offline() or path.suffix or os.sep in str(source):
            raise RopeExtendError(
                f"data {str(source)!r} is not a local file or folder"
                + (" and the hub is offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE)" if _hub_offline() else "")
                + "; give a .txt file, a folder of .txt files, a .jsonl or a .parquet file"
            )
        else:
            import datasets

            try:
                ds = datasets.load_dataset(str(source), split=split)
            except Exception as exc:  # network, missing dataset, auth: say what was tried
                raise RopeExtendError(
                    f"could not load dataset {str(source)!r} (split {split!r}) from the hub: {exc}; "
                    "give a local .txt file, folder, .jsonl or .parquet file instead"
                ) from exc
            if text_field not in ds.column_names:
                raise RopeExtendError(f"dataset {source!r} has no column {text_field!r}; columns: {', '.join(ds.column_names)}")
            texts = [str(t) for t in ds[text_field] if t]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise RopeExtendError(f"{source!r} holds no non-empty text")
    return texts[:max_docs] if max_docs else texts


def default_texts() -> list[str]:
    """The project's bundled held-out corpus (``rope_extend.bundled.eval_texts()``) when installed; else an error."""
    try:
        from .. import bundled

        if bundled.EVAL_CORPUS.is_file():
            return bundled.eval_texts()
    except ImportError:
        pass
    raise RopeExtendError("no texts given and no bundled corpus is installed: pass --data (a .txt file, a folder "
                          "of .txt files, a .jsonl or .parquet file, or a hub dataset name when online)")
