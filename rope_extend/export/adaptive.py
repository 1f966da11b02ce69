"""Length-adaptive YaRN for a serving engine: one factor per request, chosen when the request is admitted.

Static YaRN at ``s`` serves ``s L`` tokens but changes every short prompt too (Qwen's documentation warns of it;
YaRN x4 on SmolLM2-135M: perplexity 49.69 against 43.04 at 4k, inside L). rope-extend's ``dynamic_yarn`` is
plain RoPE up to ``L`` and YaRN at ``l / L`` past it, which needs cached keys turned as ``l`` grows; an engine
that pages its KV cache cannot turn them. The engine form fixes each request's factor at admission instead:

- ``need = min(prompt tokens + max_tokens, max_model_len) - 1``, the most positions the model is fed for the
  request: the engine stops once it has sampled the last token and never feeds that one back, so a prompt of
  ``L`` tokens scored with ``max_tokens=1`` feeds ``L`` positions, as a forward of those ``L`` tokens does in
  transformers;
- ``need <= L``: the model's own frequencies (``dynamic_yarn`` at ``L``, plain RoPE), exactly the unscaled model;
- else YaRN at the smallest factor ``s_k`` of the bucket set with ``need <= s_k L`` (``dynamic_yarn``'s formula at
  ``l = s_k L``, the same as ``yarn`` at ``s_k``), kept for the request's whole life, so no key is ever turned.
  rope-extend's patched model rounds ``l`` up to its re-rotation grid past ``L`` (``hf.rotary.bucket``), so at
  ``s_k L`` it runs yarn a little above ``s_k`` (``patched_factors``).

One cos/sin table holds every segment, one after another (segment 0: ``L`` rows of plain RoPE; segment ``k``:
``s_k L`` rows of YaRN at ``s_k``), and each token looks up row ``offset_k + position``: the per-token offset
vLLM uses for LongRoPE's short and long factors (``phi3_long_rope_scaled_rope.py``), chosen here per request.
Requests of different segments must never share cached blocks: ``salt`` gives each segment its own prefix-cache
salt (vLLM hashes the salt into a request's first block, and every later block hashes its parent).

Plain numbers in, plain numbers out (and the table, a tensor); nothing here imports an engine.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import RopeExtendError, UnsupportedModelError
from ..hf.rotary import bucket
from ..methods import registry
from ..methods._common import rope_frequencies
from ..methods.resolved import Scaling, resolve

CONFIG_KEY = "rope_extend_adaptive"  # the exported config.json's key: buckets, L, the model's own architecture
PREFIX = "RopeExtendAdaptive"  # the exported architecture: PREFIX + the model's own (vLLM's plugin registers it)
# checked end to end in vLLM: Llama on SmolLM2-135M, the others on tiny random models (tests/export/test_vllm_adaptive)
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM")
METHOD = "dynamic_yarn"
GLOBAL, LOCAL = "full_attention", "sliding_attention"  # Gemma 3's layer types: only the global ones are scaled


def default_buckets(factor: float) -> tuple[float, ...]:
    """The powers of two below ``factor``, then ``factor``: x2, x4, x8 for ``factor`` 8; x2, x3 for 3."""
    out, s = [], 2.0
    while s < factor:
        out.append(s)
        s *= 2
    return (*out, float(factor))


def check_buckets(buckets, factor: float) -> tuple[float, ...]:
    """``buckets`` (an iterable of factors, or a comma-separated string) sorted, each above 1; the largest must be
    ``factor`` (the length the engine serves), itself above 1: checked first, since at 1 no bucket can be right
    and the buckets are not what is wrong. None gives ``default_buckets``."""
    if not factor > 1.0:  # NaN too
        raise RopeExtendError(
            f"the length-adaptive vLLM export of {METHOD} needs a factor above 1, got {factor:g}: at factor 1 it "
            "serves L tokens, all with the model's own RoPE, so there is nothing to adapt; export without a method "
            "to serve the model as it is, or give a factor above 1"
        )
    if buckets is None:
        return default_buckets(factor)
    if isinstance(buckets, str):
        try:
            buckets = [float(b) for b in buckets.split(",") if b.strip()]
        except ValueError:
            raise RopeExtendError(f"buckets must be comma-separated factors such as 2,4,8, got {buckets!r}") from None
    values = sorted({float(b) for b in buckets})
    if not values or values[0] <= 1.0 or not all(math.isfinite(v) for v in values):
        raise RopeExtendError(f"buckets must be factors above 1, such as 2,4,8; got {list(buckets)}")
    if not math.isclose(values[-1], factor, rel_tol=1e-9):
        raise RopeExtendError(
            f"the largest bucket must be the factor {factor:g} (the length served is factor x L), got buckets "
            f"{','.join(f'{v:g}' for v in values)}"
        )
    return tuple(values)


@dataclass(frozen=True)
class BucketLayout:
    """The segments of one table: ``factors[0] = 1`` (plain), then the buckets; ``lengths[k] = floor(s_k L)``
    rows at ``offsets[k]``."""

    original: int
    factors: tuple[float, ...]

    def __post_init__(self):
        if not isinstance(self.original, int) or self.original < 1:
            raise RopeExtendError(f"original_max_position_embeddings must be a positive integer, got {self.original!r}")
        if self.factors[0] != 1.0 or list(self.factors) != sorted(set(self.factors)):
            raise RopeExtendError(f"the bucket layout's factors must be 1 then increasing buckets, got {self.factors}")

    @classmethod
    def of(cls, original: int, buckets) -> BucketLayout:
        return cls(int(original), (1.0, *(float(b) for b in buckets)))

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(math.floor(s * self.original) for s in self.factors)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, at = [], 0
        for n in self.lengths:
            out.append(at)
            at += n
        return tuple(out)

    @property
    def rows(self) -> int:
        return sum(self.lengths)

    @property
    def longest(self) -> int:
        return self.lengths[-1]

    def segment(self, need: int) -> int:
        """The segment of a request that can grow to ``need`` tokens: the first whose length covers it."""
        for k, n in enumerate(self.lengths):
            if need <= n:
                return k
        raise RopeExtendError(
            f"a request of {need} tokens is longer than the longest bucket ({self.longest} tokens, x{self.factors[-1]:g})"
        )

    def as_config(self) -> dict[str, Any]:
        return {"original_max_position_embeddings": self.original, "buckets": list(self.factors[1:])}

    @classmethod
    def from_config(cls, value: Any) -> BucketLayout:
        if not isinstance(value, dict) or "buckets" not in value or "original_max_position_embeddings" not in value:
            raise RopeExtendError(
                f"config {CONFIG_KEY} must be a dict with buckets and original_max_position_embeddings, got {value!r}"
            )
        return cls.of(value["original_max_position_embeddings"], value["buckets"])


def need(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The most positions the model is fed for a request. It grows to its prompt plus ``max_tokens`` (at most
    ``max_model_len``, where the engine stops it; without ``max_tokens`` to ``max_model_len``), and the last token
    it samples is never fed back: one less, but never less than the prompt, which is fed whole. A prompt of ``L``
    tokens with ``max_tokens=1`` (pure scoring) feeds ``L`` positions: the unscaled model, as transformers'
    ``dynamic_yarn`` on those ``L`` tokens."""
    grown = int(max_model_len) if max_tokens is None else min(int(prompt_tokens) + int(max_tokens), int(max_model_len))
    return max(grown - 1, int(prompt_tokens))


def patched_factors(layout: BucketLayout) -> tuple[float, ...]:
    """The yarn factor rope-extend's patched ``dynamic_yarn`` runs at each bucket's edge ``s_k L``: ``l / L`` with
    ``l`` rounded up to its re-rotation grid (``hf.rotary.bucket``), a little above ``s_k`` (x2.075 at 2L for
    L = 1024), where the plugin serves yarn at ``s_k``. Said in the export's note."""
    return tuple(bucket(n, layout.original) / layout.original for n in layout.lengths[1:])


def salt(layout: BucketLayout, segment: int, user_salt: str | None) -> str:
    """The prefix-cache salt of a request in ``segment``: the segment's factor before the user's own salt.

    Every request gets one (plain ones too), so two requests share a cached block only when they are in the
    same segment and gave the same salt: the factor part ends at the first ``|``, which no factor contains."""
    return f"rope-extend yarn x{layout.factors[segment]:g}|{user_salt or ''}"


def offsets_per_token(layout: BucketLayout, segments, counts) -> Any:
    """``offsets[segment]`` repeated ``counts`` times each: the row offset of every scheduled token, for requests in
    batch order with ``counts`` tokens each (numpy arrays in, a numpy int64 array out)."""
    table = np.asarray(layout.offsets, dtype=np.int64)
    return np.repeat(table[np.asarray(segments, dtype=np.int64)], np.asarray(counts, dtype=np.int64))


def scaling(layout: BucketLayout, params: dict[str, Any] | None = None) -> Scaling:
    """rope-extend's ``dynamic_yarn`` at the largest bucket with ``params`` (beta_fast, beta_slow, truncate,
    attention_factor, mscale, mscale_all_dim): its frequencies at ``s_k L`` are each segment's."""
    resolved = resolve(
        registry.get(METHOD),
        factor=layout.factors[-1],
        original_max_position_embeddings=layout.original,
        params=dict(params or {}),
    )
    if resolved.params.finetuned:
        raise RopeExtendError(
            "dynamic_yarn with finetuned=true keeps the factor inside L too: it is static yarn, exported as such"
        )
    return resolved


def table(layout: BucketLayout, method: Scaling | None, dim: int, base: float) -> torch.Tensor:
    """The cos/sin table of every segment, float32 ``[rows, dim]``: ``cat(cos, sin)`` over the ``dim / 2``
    frequencies (vLLM's ``cos_sin_cache`` layout), each times the segment's attention scale, as transformers
    computes ``cos(position * inv_freq) * attention_scaling``. ``method`` None: plain RoPE in every segment (Gemma
    3's sliding layers, which keep their own base unscaled, but are fed the same shifted positions)."""
    parts = []
    for n in layout.lengths:
        # dynamic_yarn at n = s L: yarn at s
        inv_freq, scale = (rope_frequencies(dim, base), 1.0) if method is None else method.compute(dim, base, n)
        angles = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq[None, :].to(torch.float32)
        parts.append(torch.cat((angles.cos() * scale, angles.sin() * scale), dim=-1))
    return torch.cat(parts, dim=0)


def check_architecture(architectures) -> str:
    """The model's own architecture, if the adaptive engine form is built for it; else refused."""
    found = list(architectures or [])
    if len(found) != 1 or found[0] not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"vLLM's length-adaptive dynamic_yarn (rope-extend's plugin) is built for {', '.join(ARCHITECTURES)}; "
            f"this model is {', '.join(found) or 'of no stated architecture'}: pass --approximate for static yarn"
        )
    return found[0]


def nested(rope: Any) -> bool:
    """Whether ``rope`` (a config's ``rope_parameters``) holds one dict per layer type (Gemma 3), not one flat
    dict."""
    return isinstance(rope, dict) and isinstance(rope.get(GLOBAL), dict)


def check_config(config, arch: str) -> None:
    """Refuse what the plugin cannot serve exactly in a model of ``arch`` (one of ``ARCHITECTURES``); ``config``
    is the transformers config, as the export and vLLM's model class both read it. The plugin changes the
    positions vLLM's model is handed, so anything else in the model that reads them would see shifted ones."""
    why = None
    if getattr(config, "llama_4_scaling", None) is not None:
        why = "its llama_4_scaling scales each query by its position, which the plugin shifts into the table"
    elif getattr(config, "dual_chunk_attention_config", None) is not None:
        why = "Dual Chunk Attention: vLLM 0.32 ships no attention backend that runs it"
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and getattr(config, "use_sliding_window", False):
        why = "its sliding-window layers (use_sliding_window) were not checked in vLLM with the plugin"
    elif arch == "Gemma3ForCausalLM":
        why = _gemma3_problem(config)
    elif nested(getattr(config, "rope_parameters", None)):
        why = "its rope_parameters are per layer type, which only Gemma 3's rule reads"
    if why is not None:
        raise UnsupportedModelError(
            f"vLLM's length-adaptive dynamic_yarn (rope-extend's plugin) cannot serve this {arch} exactly: {why}; "
            "pass --approximate for static yarn where the engine serves it"
        )


def _gemma3_problem(config) -> str | None:
    """Gemma 3 is served with its global layers scaled and its sliding ones at their own base, unscaled (as
    transformers and rope-extend's patch treat it); anything else in its rope settings is refused."""
    rope = getattr(config, "rope_parameters", None)
    types = set(getattr(config, "layer_types", None) or ())
    if (
        not isinstance(rope, dict)
        or set(rope) != {GLOBAL, LOCAL}
        or not all(isinstance(v, dict) for v in rope.values())
    ):
        return f"rope_parameters must be one dict for each of {GLOBAL} and {LOCAL}, got {rope!r}"
    if not types <= {GLOBAL, LOCAL}:
        return f"layer types {sorted(types - {GLOBAL, LOCAL})} (only {GLOBAL} and {LOCAL} are served)"
    if rope[LOCAL].get("rope_type", "default") != "default":
        return f"its {LOCAL} layers are scaled ({rope[LOCAL].get('rope_type')}), where Gemma 3 keeps them plain"
    return None


def global_rope(rope: dict[str, Any]) -> dict[str, Any]:
    """The rope dict of the layers the plugin scales: the whole dict, or the global layers' (Gemma 3)."""
    return rope[GLOBAL] if nested(rope) else rope


def plain_rope(rope: dict[str, Any]) -> dict[str, Any]:
    """``rope`` with the scaled layers' dict made plain RoPE at its own base (what vLLM builds the model with
    before the plugin gives each rotary embedding its table); Gemma 3's sliding dict kept as it is."""
    plain = {"rope_type": "default", "rope_theta": global_rope(rope)["rope_theta"]}
    return {**rope, GLOBAL: plain} if nested(rope) else plain


def scaled_layer(config, module_name: str) -> bool:
    """Whether the rotary embedding at ``module_name`` (``model.layers.3.self_attn.rotary_emb``) is scaled: every
    one for a flat rope dict; for Gemma 3 those of the global layers (``config.layer_types``)."""
    if not nested(getattr(config, "rope_parameters", None)):
        return True
    found = re.search(r"(?:^|\.)layers\.(\d+)\.", module_name)
    types = list(getattr(config, "layer_types", None) or ())
    if found is None or int(found.group(1)) >= len(types):
        raise UnsupportedModelError(f"cannot tell the layer type of the rotary embedding {module_name!r}")
    return types[int(found.group(1))] == GLOBAL
