"""Which method each engine can serve: exported, exported only on request (``approximate``), or refused.

A refusal names the method, the engine, what the engine lacks and the nearest choice that exports. The
``table`` below is what the README's serving table is generated from (a test keeps them equal).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RopeExtendError, closest
from ..methods import registry
from .configs import SGLANG_VERSION, VLLM_VERSION
from .forms import DEFAULT, DYNAMIC, LONGROPE, Form, static_form
from .llamacpp import LLAMACPP_VERSION
from .targets import TARGETS

ENGINES = {
    "gguf": LLAMACPP_VERSION,
    "vllm": VLLM_VERSION,
    "sglang": SGLANG_VERSION,
    "transformers4": "transformers 4",
}
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

    def message(self, method: str, target: str) -> str:
        engine = ENGINES[target]
        if self.status == REFUSED:
            return f"{engine} cannot serve {method}: {self.reason}; nearest that exports: {self.nearest}"
        return f"{engine} serves {method} only approximately: {self.reason}; pass --approximate (approximate=True) to export anyway"


def check_target(target: str) -> str:
    if target not in TARGETS:
        raise RopeExtendError(
            f"unknown export target {target!r}{closest(target, TARGETS)}; allowed: {', '.join(TARGETS)}"
        )
    return target


def _yarn_like(scaling: registry.Scaling) -> str:
    """The frequency method every engine serves, at the same reach."""
    return f"yarn with factor {scaling.factor:g}" if scaling.factor > 1 else "yarn with a factor (target length / L)"


def _attention(scaling: registry.Scaling, target: str, base: float) -> Decision:
    name = scaling.method.name
    if name == "self_extend" and target == "gguf":
        return Decision(
            APPROXIMATE,
            Form(DEFAULT, float(base)),
            "llama.cpp runs its own group attention (--grp-attn-n G --grp-attn-w W, accepted by llama-completion "
            "only; llama-cli and llama-server reject them), which groups the cache in blocks of W instead of "
            "Self-Extend's per-query neighbour window, so positions differ from rope-extend's",
        )
    if name == "dual_chunk":
        lacks = {
            "vllm": "vLLM 0.33.0 reads dual_chunk_attention_config (Qwen2/Qwen3 families) but ships no attention "
            "backend that runs it",
            "sglang": "SGLang 0.5.23 reads dual_chunk_attention_config but ships no dual-chunk attention backend",
        }.get(target, "it has no dual-chunk attention")
        return Decision(REFUSED, None, lacks, _yarn_like(scaling))
    if name == "self_extend":
        return Decision(REFUSED, None, "it has no Self-Extend (only llama.cpp has a version of it)", "--to gguf")
    return Decision(REFUSED, None, "it has no attention that changes positions per query and key", _yarn_like(scaling))


def decide(scaling: registry.Scaling | None, target: str, dim: int, base: float) -> Decision:
    """How ``target`` serves ``scaling`` for a rotary dimension ``dim`` and base ``base``."""
    check_target(target)
    if scaling is not None and scaling.logn:
        return Decision(
            REFUSED,
            None,
            "log-n multiplies each query by log_L(position), which no engine config can say",
            f"{scaling.method.name} without logn",
        )
    if scaling is not None and scaling.method.attention:
        return _attention(scaling, target, base)
    form = static_form(scaling, dim, base)
    if form is None:
        return Decision(REFUSED, None, "no engine knows this method", "yarn")
    name = scaling.method.name if scaling is not None else "none"
    if name == "dynamic" and target == "transformers4":
        # transformers 4's own dynamic NTK (alpha from the length against max_position_embeddings, kept at L)
        return Decision(
            APPROXIMATE,
            Form(DYNAMIC, float(base), scaling.factor, scaling.original_max_position_embeddings),
            "transformers 4's dynamic recomputes the base at every length past L and never re-rotates cached "
            "keys; rope-extend's changes the base on a grid of lengths and re-rotates the cache (logits differ "
            "by about 1e-4 past L, the same below)",
        )
    if name == "dynamic_yarn" and form.changes and target == "vllm":
        return Decision(EXPORTED, form, adaptive=True)
    if form.changes:
        return Decision(APPROXIMATE, form, form.changes)
    if form.kind == LONGROPE and target != "transformers4":
        return Decision(
            APPROXIMATE,
            form,
            f"{ENGINES[target]} uses the long factors for every sequence once it serves more than "
            f"L={form.original_max_position_embeddings} tokens, where transformers switches per forward at L",
        )
    return Decision(EXPORTED, form)


# ----------------------------------------------------------------------------------------------- the table
EXAMPLES = {  # a parameter set for each method whose defaults cannot stand alone
    "longrope": {"short_factor": [1.0] * 32, "long_factor": [2.0] * 32},
}


def table(dim: int = 64, base: float = 10000.0, length: int = 4096) -> list[tuple[str, dict[str, str]]]:
    """``[(method, {target: status}), ...]`` for every registered method at factor 4 (the README's table)."""
    rows = []
    for name in ["none", *registry.names()]:
        if name == "none":
            scaling = None
        else:
            method = registry.get(name)
            scaling = registry.resolve(
                method,
                factor=None if method.attention else 4.0,
                original_max_position_embeddings=length,
                params=EXAMPLES.get(name, {}),
            )
        rows.append((name, {t: decide(scaling, t, dim, base).status for t in TARGETS}))
    return rows


def markdown_table() -> str:
    head = "| method | " + " | ".join(TARGETS) + " |\n|---|" + "---|" * len(TARGETS)
    lines = [f"| {name} | " + " | ".join(row[t] for t in TARGETS) + " |" for name, row in table()]
    return "\n".join([head, *lines])
