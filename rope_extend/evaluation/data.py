"""Inputs of the harnesses: context lengths, needle depths, and texts (through the one document reader)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

from .. import resources
from ..documents import SampleBy, read_documents
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
    items: list[Any]
    if isinstance(values, str):
        items = [v for v in values.split(",") if v.strip()]
    elif isinstance(values, int):
        items = [values]
    else:
        items = list(values)
    if not items:
        raise RopeExtendError("no lengths given: pass at least one positive integer, e.g. 1k,2k,4k")
    return sorted({parse_length(v) for v in items})


def parse_trials_at(value: Any, lengths: Sequence[int] | None = None) -> dict[int, int] | None:
    """Trial counts at particular lengths, ``{16k: 10}`` -> ``{16384: 10}`` (None stays None). With
    ``lengths``, every length named must be one of them (a length the run does not measure is a mistake)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not value:
        raise RopeExtendError(
            f"trials_at must be a mapping of lengths to trial counts, e.g. {{16k: 10}}, got {value!r}"
        )
    counts: dict[int, int] = {}
    for key, count in value.items():
        length = parse_length(key)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise RopeExtendError(f"trials_at[{key}] must be a positive integer number of trials, got {count!r}")
        if length in counts:
            raise RopeExtendError(f"trials_at names length {length} twice")
        counts[length] = count
    if lengths is not None:
        unknown = sorted(set(counts) - set(lengths))
        if unknown:
            raise RopeExtendError(
                f"trials_at names {', '.join(map(str, unknown))}, not among the lengths measured "
                f"({', '.join(map(str, lengths))}); change trials_at or drop it (trials_at: null; on the command "
                "line --set TASK.trials_at=null, since a mapping given with --set is merged into the suite's)"
            )
    return counts


def parse_depths(values: str | float | Iterable[Any] | None) -> list[float] | None:
    """Needle depths as fractions in [0, 1]: ``"0,0.5,1"``, ``"0%,50%,100%"``, or ``"grid:5"`` (5 evenly spaced)."""
    if values is None:
        return None
    if isinstance(values, str):
        text = values.strip()
        if text.startswith("grid:"):
            digits = text[5:]
            if not digits.isdigit() or int(digits) < 2:
                raise RopeExtendError(f"a depth grid is grid:N with an integer N >= 2, got {values!r}")
            n = int(digits)
            return [i / (n - 1) for i in range(n)]
        items: list[Any] = [v for v in text.split(",") if v.strip()]
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
def load_texts(
    source: str | os.PathLike | Sequence[str],
    *,
    text_field: str = "text",
    split: str = "train",
    max_docs: int | None = None,
    sample_by: SampleBy = "document",
) -> list[str]:
    """Documents from ``source`` through the one reader (``rope_extend.documents.read_documents``: a file, a
    folder, JSONL, Parquet or a hub dataset; a ``.txt`` file is one document), or a list of strings as is."""
    if isinstance(source, (str, os.PathLike)):
        return read_documents(source, text_field=text_field, split=split, sample_by=sample_by, max_docs=max_docs)
    texts = [str(t) for t in source if str(t).strip()]
    if not texts:
        raise RopeExtendError("the list of texts holds no non-empty text")
    return texts[:max_docs] if max_docs else texts


def default_texts() -> list[str]:
    """The bundled held-out corpus (long synthetic chronicles) when installed; else an error."""
    if not resources.BUNDLED_EVAL_CORPUS.is_file():
        raise RopeExtendError(
            "no texts given and no bundled corpus is installed: pass --data (a .txt file, a folder "
            "of .txt files, a .jsonl or .parquet file, or a hub dataset name when online)"
        )
    return read_documents(resources.BUNDLED_EVAL_CORPUS)
