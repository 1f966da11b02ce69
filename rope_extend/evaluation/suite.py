"""Evaluation suites: one model under several scalings (``method: none`` included), several tasks, one report.

A suite is a YAML file whose keys map one to one onto the dataclasses below (as trl's TrlParser does);
an unknown key is an error naming it, its closest valid keys and all valid keys. Command-line overrides
(``--set passkey.trials=2``) are applied to the YAML before it is checked, and win.

    model: meta-llama/Llama-2-7b-hf
    methods:
      - {method: none}
      - {method: yarn, factor: 4}
    passkey: {lengths: [4k, 8k, 16k], trials: 10}
    perplexity: {lengths: [4k, 8k, 16k], data: proof-pile.jsonl}
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from .. import hf
from ..errors import RopeExtendError
from .data import parse_depths, parse_lengths


@dataclass
class MethodSpec:
    """One scaling to compare. ``method: none`` is the model as loaded."""

    method: str = "none"
    factor: float | None = None
    target_length: int | None = None
    original_length: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    label: str | None = None

    def name(self) -> str:
        if self.label:
            return self.label
        if self.method == "none":
            return "none"
        size = f"x{self.factor:g}" if self.factor is not None else f"to {self.target_length}"
        return f"{self.method} {size}"

    def patch_kwargs(self) -> dict[str, Any]:
        return dict(factor=self.factor, target_length=self.target_length,
                    original_max_position_embeddings=self.original_length, **self.params)


@dataclass
class PasskeyTask:
    lengths: list[Any]
    depths: Any = None  # None: a random depth per trial; a list or "grid:N": a heatmap
    trials: int = 10
    seed: int = 0
    key_range: list[int] = field(default_factory=lambda: [1, 50000])
    max_new_tokens: int = 10


@dataclass
class NiahTask:
    lengths: list[Any]
    data: str | None = None  # haystack texts: .txt file, folder, .jsonl, .parquet or a hub dataset
    text_field: str = "text"
    split: str = "train"
    max_docs: int | None = None
    needle: str | None = None
    question: str | None = None
    answer: str | None = None
    depths: Any = None
    trials: int = 1
    seed: int = 0
    max_new_tokens: int = 32


@dataclass
class PerplexityTask:
    lengths: list[Any]
    data: str | None = None
    text_field: str = "text"
    split: str = "train"
    max_docs: int | None = None
    stride: int | None = None  # None: one truncated window per document
    chunk_size: int | None = None
    sliding_window: str = "auto"  # auto | full | keep (see rope_extend.evaluation.perplexity)


@dataclass
class Suite:
    model: str
    methods: list[MethodSpec]
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str | None = None
    trust_remote_code: bool = False
    title: str | None = None
    out: str | None = None  # default: reports/<suite name> beside the suite file
    passkey: PasskeyTask | None = None
    niah: NiahTask | None = None
    perplexity: PerplexityTask | None = None
    path: str | None = field(default=None, metadata={"internal": True})


def _check_keys(cls, data: Any, where: str) -> dict:
    if not isinstance(data, dict):
        raise RopeExtendError(f"{where} must be a mapping of {cls.__name__} fields, got {type(data).__name__}")
    allowed = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
    for key in data:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), allowed, n=3, cutoff=0.5)
            hint = f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else ""
            raise RopeExtendError(f"unknown key {key!r} in {where}{hint}; valid keys: {', '.join(allowed)}")
    missing = [f.name for f in dataclasses.fields(cls)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in data]
    if missing:
        raise RopeExtendError(f"{where} is missing {', '.join(repr(m) for m in missing)}")
    return data


def _task(cls, data: Any, where: str):
    if data is None:
        return None
    obj = cls(**_check_keys(cls, data, where))
    obj.lengths = parse_lengths(obj.lengths)
    if getattr(obj, "depths", None) is not None:
        obj.depths = parse_depths(obj.depths)
    return obj


def _override(data: dict, assignment: str) -> None:
    """``a.b=value`` (value read as YAML) into the nested dict ``data``."""
    key, sep, value = assignment.partition("=")
    if not sep or not key.strip():
        raise RopeExtendError(f"an override is key=value (e.g. passkey.trials=2), got {assignment!r}")
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise RopeExtendError(f"cannot set {key!r}: {part!r} is not a mapping")
    node[parts[-1]] = yaml.safe_load(value)


def parse_suite(data: Any, *, path: str | Path | None = None, overrides: Sequence[str] = ()) -> Suite:
    """Check a suite mapping (after ``overrides``) and build the ``Suite``."""
    where = str(path) if path else "the suite"
    data = dict(data or {}) if isinstance(data, dict) or data is None else data
    for assignment in overrides:
        _override(data, assignment)
    _check_keys(Suite, data, where)
    if not data.get("methods"):
        raise RopeExtendError(f"{where}: methods must list at least one method (e.g. [{{method: none}}])")
    methods = []
    for i, m in enumerate(data["methods"]):
        spec = MethodSpec(**_check_keys(MethodSpec, m, f"{where}: methods[{i}]"))
        if spec.method != "none":
            from ..methods import registry

            registry.get(spec.method)  # an unknown name raises now, listing the known ones
        methods.append(spec)
    names = [m.name() for m in methods]
    if len(set(names)) != len(names):
        raise RopeExtendError(f"{where}: two methods have the same label ({names}); give them distinct `label`s")
    suite = Suite(**{**data, "methods": methods, "passkey": _task(PasskeyTask, data.get("passkey"), f"{where}: passkey"),
                     "niah": _task(NiahTask, data.get("niah"), f"{where}: niah"),
                     "perplexity": _task(PerplexityTask, data.get("perplexity"), f"{where}: perplexity")},
                  path=str(path) if path else None)
    if suite.perplexity:  # checked now, not after the other tasks have run
        hf.check_sliding_window_mode(suite.perplexity.sliding_window, f"{where}: perplexity.sliding_window")
    if not (suite.passkey or suite.niah or suite.perplexity):
        raise RopeExtendError(f"{where}: no task: give at least one of passkey, niah, perplexity")
    return suite


def load_suite(path: str | Path, overrides: Sequence[str] = ()) -> Suite:
    path = Path(path)
    if not path.is_file():
        raise RopeExtendError(f"suite {str(path)!r} not found (suites are YAML files, e.g. eval/smoke.yaml)")
    with path.open(encoding="utf-8") as f:
        return parse_suite(yaml.safe_load(f), path=path, overrides=overrides)


def resolve_path(suite: Suite, value: str | None) -> str | None:
    """A relative path in a suite is relative to the suite file when it exists there (else left as is)."""
    if value is None or suite.path is None or Path(value).is_absolute():
        return value
    beside = Path(suite.path).parent / value
    return str(beside) if beside.exists() else value


def default_out(suite: Suite) -> Path:
    if suite.out:
        return Path(suite.out)
    base = Path(suite.path).parent if suite.path else Path(".")
    return base / "reports" / (Path(suite.path).stem if suite.path else "suite")
