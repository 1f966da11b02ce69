"""Evaluation suites: one model under several scalings (``method: none`` included), several tasks, one report.

A suite is a YAML file read by the one strict loader (``rope_extend.schema``) onto the dataclasses below:
an unknown key names its closest valid ones, a wrong value names what is allowed, and command-line
overrides (``--set passkey.trials=2``) win. Shipped suites (``rope_extend/suites/``) can be named
(``rope-extend eval compare smoke``); relative paths in a suite file are relative to it when they exist there.

    model: meta-llama/Llama-2-7b-hf
    methods:
      - {method: none}
      - {method: yarn, factor: 4}
    passkey: {lengths: [4k, 8k, 16k], trials: 10}
    perplexity: {lengths: [4k, 8k, 16k], data: proof-pile.jsonl}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .. import resources, schema
from ..documents import SampleBy
from ..errors import RopeExtendError
from ..hf.window import SlidingWindowMode
from ..methods import registry as M
from ..schema import option
from .data import parse_depths, parse_lengths

WINDOW_HELP = (
    "sliding-window attention: auto widens a window every layer uses, keeps interleaved local layers; "
    "full widens all; keep none"
)


@dataclass
class MethodSpec:
    """One scaling to compare. ``method: none`` is the model as loaded."""

    method: str = option("none", help="scaling method (rope-extend methods), or none for the model as loaded")
    factor: float | None = option(None, help="scale factor s = target / original length L")
    target_length: int | None = option(None, help="target context in tokens (instead of factor)")
    original_length: int | None = option(None, help="override the original pretraining length L")
    params: dict[str, Any] = option(help="method parameters, e.g. {beta_fast: 32}", factory=dict)
    label: str | None = option(None, help="name in tables and plots (default: method and factor)")

    def __post_init__(self):
        if self.method == "none":
            if self.factor is not None or self.target_length is not None or self.params:
                raise RopeExtendError(
                    f"method none takes no factor, target_length or params (got factor={self.factor}, "
                    f"target_length={self.target_length}, params={self.params}): name a method to scale the model"
                )
            return
        method = M.get(self.method)  # an unknown name raises, listing the known ones
        if method.attention and self.factor is None and self.target_length is None:
            pass  # attention methods keep plain RoPE: no factor needed
        elif (self.factor is None) == (self.target_length is None):
            raise RopeExtendError(
                f"method {self.method}: give exactly one of factor and target_length, got "
                f"factor={self.factor}, target_length={self.target_length}"
            )
        if self.factor is not None:
            M.check_factor(self.factor)
        elif self.target_length is not None:
            M.check_int("target_length", self.target_length)
        method.make_params(self.params)  # the rest is checked against the model's config before any run

    def name(self) -> str:
        if self.label:
            return self.label
        if self.method == "none":
            return "none"
        if self.factor is None and self.target_length is None:  # an attention method without a target
            return self.method
        size = f"x{self.factor:g}" if self.factor is not None else f"to {self.target_length}"
        return f"{self.method} {size}"

    def patch_kwargs(self) -> dict[str, Any]:
        return dict(
            factor=self.factor,
            target_length=self.target_length,
            original_max_position_embeddings=self.original_length,
            **self.params,
        )


def _task_lengths(task) -> None:
    task.lengths = parse_lengths(task.lengths)
    if getattr(task, "depths", None) is not None:
        task.depths = parse_depths(task.depths)


@dataclass
class PasskeyTask:
    lengths: list[Any] = option(help="prompt lengths in tokens, e.g. [4k, 8k] (1k = 1024)")
    depths: Any = option(None, help="null: a random depth per trial; a list or grid:N: a depth x length heatmap")
    trials: int = option(10, help="trials per length (per cell with depths)")
    seed: int = option(0, help="seed of the keys and depths")
    key_range: list[int] = option(help="inclusive range of the keys", factory=lambda: [1, 50000])
    max_new_tokens: int = option(10, help="tokens generated for the answer")
    sliding_window: SlidingWindowMode = option("auto", help=WINDOW_HELP)

    __post_init__ = _task_lengths


@dataclass(kw_only=True)
class TextTask:
    """Where a task's texts come from (the one document reader)."""

    data: str | None = option(
        None,
        help="texts: a .txt file, folder, .jsonl, .parquet or a hub dataset (default: the bundled held-out corpus)",
    )
    text_field: str = option("text", help="column holding the text (JSONL, Parquet, datasets)")
    split: str = option("train", help="dataset split (hub datasets)")
    sample_by: SampleBy = option("document", help="a text file is one document, or split by paragraph or line")
    max_docs: int | None = option(None, help="use at most this many documents")


@dataclass(kw_only=True)
class NiahTask(TextTask):
    lengths: list[Any] = option(help="prompt lengths in tokens")
    needle: str | None = option(None, help="the sentence to hide (default: the San Francisco needle)")
    question: str | None = option(None, help="the question asked at the end")
    answer: str | None = option(None, help="the substring a correct answer contains")
    depths: Any = option(None, help="depth grid (default 0, 25, 50, 75, 100%)")
    trials: int = option(1, help="trials per cell (each from another haystack document)")
    seed: int = option(0, help="seed")
    max_new_tokens: int = option(32, help="tokens generated for the answer")
    sliding_window: SlidingWindowMode = option("auto", help=WINDOW_HELP)

    __post_init__ = _task_lengths


@dataclass(kw_only=True)
class PerplexityTask(TextTask):
    lengths: list[Any] = option(help="window lengths in tokens")
    stride: int | None = option(None, help="sliding-window step; null: one truncated window per document")
    chunk_size: int | None = option(None, help="positions per LM-head chunk (default: 16M logits / vocab)")
    sliding_window: SlidingWindowMode = option("auto", help=WINDOW_HELP)

    __post_init__ = _task_lengths


@dataclass(kw_only=True)
class RulerTask(TextTask):
    """RULER's synthetic tasks; ``data`` is the essay haystack (niah_multivalue, niah_multiquery)."""

    lengths: list[Any] = option(help="prompt lengths in tokens")
    tasks: list[str] | None = option(
        None, help="RULER tasks (niah_single_1 ... fwe; see rope_extend.evaluation.ruler); null: all eleven"
    )
    samples: int = option(10, help="prompts per task and length")
    seed: int = option(0, help="seed")
    max_new_tokens: int | None = option(None, help="tokens generated (null: RULER's per task)")
    sliding_window: SlidingWindowMode = option("auto", help=WINDOW_HELP)

    def __post_init__(self):
        from .ruler import check_tasks

        _task_lengths(self)
        if self.tasks is not None:
            self.tasks = check_tasks(self.tasks)


@dataclass
class Suite:
    model: str = option(help="saved model folder, a name rope-extend ships (bundled), or a hub name")
    methods: list[MethodSpec] = option(help="the scalings to compare, e.g. [{method: none}, {method: yarn, factor: 4}]")
    tokenizer: str | None = option(None, help="tokenizer folder or name (default: the model's)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option("auto", help="weights dtype")
    device: str | None = option(None, help="e.g. cuda, cuda:1, cpu (default: where the model loads)")
    trust_remote_code: bool = option(False, help="run the model repository's own code (off by default)")
    title: str | None = option(None, help="report title")
    out: str | None = option(None, help="report folder (default: runs/<suite name>)")
    passkey: PasskeyTask | None = option(None, help="passkey retrieval")
    niah: NiahTask | None = option(None, help="needle in a haystack")
    perplexity: PerplexityTask | None = option(None, help="perplexity")
    ruler: RulerTask | None = option(None, help="RULER's synthetic tasks")
    path: str | None = option(None, help="the suite file", internal=True)

    def __post_init__(self):
        if not self.methods:
            raise RopeExtendError("methods must list at least one method (e.g. [{method: none}])")
        names = [m.name() for m in self.methods]
        if len(set(names)) != len(names):
            raise RopeExtendError(f"two methods have the same label ({names}); give them distinct `label`s")
        if not (self.passkey or self.niah or self.perplexity or self.ruler):
            raise RopeExtendError("no task: give at least one of passkey, niah, perplexity, ruler")


def parse_suite(data: Any, *, path: str | Path | None = None, overrides: Sequence[str] = ()) -> Suite:
    """Check a suite mapping (after ``overrides``) and build the ``Suite``."""
    where = str(path) if path else "the suite"
    data = {} if data is None else data
    if isinstance(data, dict):
        data = schema.merge(data, schema.parse_overrides(list(overrides)))
    suite = schema.build(Suite, data, where=where)
    suite.path = str(path) if path else None
    return suite


def load_suite(path: str | Path, overrides: Sequence[str] = ()) -> Suite:
    """A suite file, or the name of a shipped suite (``smoke``)."""
    path = resources.find_suite(path)
    return parse_suite(schema.read_yaml(path, what="suite"), path=path, overrides=overrides)


def resolve_path(suite: Suite, value: str | None) -> str | None:
    """A relative path in a suite is relative to the suite file when it exists there (else left as is)."""
    return resources.beside(suite.path, value)


def default_out(suite: Suite) -> Path:
    if suite.out:
        return Path(suite.out)
    return Path("runs") / (Path(suite.path).stem if suite.path else "suite")
