"""What an export target is: ``ExportTarget``, the ``Decision`` it takes part in, the ``ExportJob`` it writes.

``export`` (``run``) resolves the scaling, asks ``routes.decide`` how the target serves it (the rules every
engine shares, then the target's own ``decide``), and hands the target one ``ExportJob``; the target writes
its file or folder and returns an ``ExportResult``. A target knows nothing of the others.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...methods.engine_form import LONGROPE, Form
from ...methods.resolved import Scaling
from . import TARGETS

INFO = "rope-extend-export.json"  # written beside the exported config: what was exported, how, for which engine
EXPORTED, APPROXIMATE, REFUSED = "exported", "with --approximate", "refused"


@dataclass(frozen=True)
class Decision:
    """``status`` (``EXPORTED``, ``APPROXIMATE``, ``REFUSED``); ``form`` (the static scaling the engine gets, None
    for the attention methods); ``reason`` (what the engine lacks, or what changes); ``nearest`` (the nearest
    exportable choice, for a refusal)."""

    status: str
    form: Form | None
    reason: str = ""
    nearest: str = ""
    adaptive: bool = False  # served by rope-extend's vLLM plugin, one factor per request (``adaptive``); ``form`` is
    # the static fallback, exported only with approximate (what changes is in ``form.changes``)

    @property
    def served(self) -> Form:
        """``form`` of a decision that exports: only a refusal has none, and ``export`` raises a refusal before
        any target writes, so a missing form here is a target's bug, reported as such."""
        if self.form is None:
            raise ValueError(f"a {self.status!r} export decision without a form to write ({self.reason})")
        return self.form

    def message(self, method: str, target: str) -> str:
        engine = TARGETS.get(target).engine
        if self.status == REFUSED:
            return f"{engine} cannot serve {method}: {self.reason}; nearest that exports: {self.nearest}"
        return f"{engine} serves {method} only approximately: {self.reason}; pass --approximate (approximate=True) to export anyway"


@dataclass(kw_only=True)
class ExportResult:
    """Where the export went, how the engine serves it, and what it could not keep exactly."""

    out: Path
    target: str
    engine: str
    method: str
    how: str
    command: str
    notes: list[str] = field(default_factory=list)
    overrides: dict[str, Any] | None = None
    override_flag: str | None = None  # the engine's flag that takes ``overrides`` as JSON

    @property
    def override_argument(self) -> str | None:
        """``overrides`` as the engine's command-line argument (to serve the original folder unchanged)."""
        if not self.overrides or not self.override_flag:
            return None
        return f"{self.override_flag} '{json.dumps(self.overrides, sort_keys=True)}'"

    def as_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "target": self.target,
            "engine": self.engine,
            "method": self.method,
            "how": self.how,
            "command": self.command,
            "notes": self.notes,
            **(
                {
                    "overrides": self.overrides,
                    "override_flag": self.override_flag,
                    "override_argument": self.override_argument,
                }
                if self.overrides
                else {}
            ),
        }


@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    """The options of ``export`` that only some targets read (each target checks its own in ``check``)."""

    approximate: bool = False  # export a method the engine serves only approximately
    dtype: str = "f32"  # GGUF weights: f32, f16, bf16, q8_0
    tokenizer_pre: str | None = None  # llama.cpp's pre-tokenizer name
    trust_remote_code: bool = False
    buckets: Any = None  # dynamic_yarn to vllm: the factors a request can get


@dataclass(kw_only=True)
class ExportJob:
    """One export, resolved and decided: everything a target's ``write`` needs."""

    out: Path  # the file or folder to write (checked new and writable)
    model: Any  # the loaded model, or None when ``source`` is a folder not loaded yet
    tokenizer: Any
    source: Path | None  # the saved folder the model was given as, or None
    config: Any  # the model's config (a composite one included)
    text: Any  # its text config, whose rope settings are exported
    scaling: Scaling | None  # None: the config's plain RoPE
    method: str  # the scaling's method name, "none" without one
    decision: Decision
    length: int  # the length the export serves: the scaling's target, else max_position_embeddings
    dim: int  # rotary dimension and base of the exported rope dict
    base: float
    notes: list[str]  # what the export changes; a target appends its own
    options: ExportOptions


class ExportTarget:
    """One serving engine (one module in this package, registered in ``TARGETS``).

    ``name`` is the ``--to`` value, ``engine`` the engine and the version its rules were read from (it starts
    every refusal), ``writes`` what it writes. The hooks below default to the rules every engine shares; a
    target overrides those where its engine differs, and always ``write``.
    """

    name: str = ""
    engine: str = ""
    writes: str = ""

    def check(self, options: ExportOptions) -> None:
        """Refuse an option the target cannot take, before anything is read."""

    def rope_layer(self, config) -> str | None:
        """The layer type whose rope dict is exported: None for one flat dict."""
        return None

    def decide(self, scaling: Scaling | None, form: Form | None, base: float) -> Decision | None:
        """This engine's own answer for ``scaling`` (``form``: its static form, None for an attention method), or
        None for the rules every engine shares (``routes.decide``). ``scaling`` never has ``logn``."""
        return None

    def write(self, job: ExportJob) -> ExportResult:
        """Write ``job.out`` (under a temporary name, ``io.writing``) and say how the engine serves it."""
        raise NotImplementedError(f"export target {self.name!r} does not say how it writes")


def longrope_switch(engine: str, form: Form | None) -> Decision | None:
    """Serving engines (llama.cpp, vLLM, SGLang) pick LongRoPE's factors once, for the length they serve;
    transformers picks them per forward."""
    if form is None or form.kind != LONGROPE:
        return None
    return Decision(
        APPROXIMATE,
        form,
        f"{engine} uses the long factors for every sequence once it serves more than "
        f"L={form.original_max_position_embeddings} tokens, where transformers switches per forward at L",
    )


def yarn_like(scaling: Scaling) -> str:
    """The frequency method every engine serves, at the same reach (the nearest choice to a refused one)."""
    return f"yarn with factor {scaling.factor:g}" if scaling.factor > 1 else "yarn with a factor (target length / L)"
