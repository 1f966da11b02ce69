"""vLLM 0.33.0 and SGLang 0.5.23 reading a transformers config: the rope dict each effectively computes.

Both engines compute transformers' formulas for most dicts (checked against their own rotary code, run through
their own forward, in tests/export/test_audit_vllm_sglang.py); where they differ is what they read
(``rope_extend/export/configs.py`` has the whole account). File names below are in the wheels'
``model_executor/layers/rotary_embedding/`` (vLLM) and ``srt/layers/rotary_embedding/`` (SGLang):

- YaRN's scale: vLLM takes ``attention_factor`` (the final scale), else ``mscale`` / ``mscale_all_dim`` (both
  non-zero), else ``0.1 ln s + 1`` (``yarn_scaling_rope.py``, ``YaRNScalingRotaryEmbedding.__init__``); SGLang
  ignores ``attention_factor``: ``mscale`` / ``mscale_all_dim`` (both not None, so ``0`` counts), else
  ``yarn_get_mscale_simple`` = ``0.1 ln s + 1``, times ``attn_factor`` (``yarn.py``,
  ``YaRNScalingRotaryEmbedding.__init__``). SGLang also reads ``extrapolation_factor``, which the audit refuses.
  A dict without ``original_max_position_embeddings`` gets ``max_position_embeddings`` from transformers'
  ``standardize_rope_params`` (vLLM calls it in ``patch_rope_parameters``); vLLM's ``get_rope`` itself would
  raise a KeyError, SGLang's falls back to ``max_position_embeddings``.
- LongRoPE (``phi3_long_rope_scaled_rope.py`` / ``rope_variant.py``, ``Phi3LongRoPEScaledRotaryEmbedding``):
  vLLM uses the long factors for every sequence once ``--max-model-len`` is longer than
  ``original_max_position_embeddings`` (``__init__``: ``use_long_rope``); SGLang switches per forward batch, to
  the long factors for the whole batch when any of its positions is past the original length (``forward``:
  ``positions > k``), one token later than transformers' ``seq_len > original``; position ``k`` itself, the largest
  of its batch, is read from row ``k`` of its short table, which is the long table's row 0 (angle 0). Both ignore
  ``attention_factor`` and ``factor``: the scale is ``short_mscale`` / ``long_mscale``, by default
  ``sqrt(1 + ln(N / original) / ln original)`` with ``N = max_position_embeddings``.
- ``dynamic``: SGLang makes it static at ``factor x max_position_embeddings`` (``rope_variant.py``,
  ``DynamicNTKScalingRotaryEmbedding._compute_cos_sin_cache``). vLLM's base is
  ``base (factor N / max_trained_positions - (factor - 1))^(d/(d-2))`` with ``max_trained_positions = N`` when the
  dict has none (``__init__.py``, ``get_rope``; ``dynamic_ntk_scaling_rope.py``): plain RoPE, in a table of ``N``
  rows, while it serves ``factor x N`` tokens.
- ``linear``: an integer ``factor`` stops both at startup (``LinearScalingRotaryEmbedding.__init__`` wraps only a
  ``float`` in a list, then iterates it: TypeError).
- Per layer type: a config with one dict per layer type (Gemma 3) is read per type, as transformers does; SGLang's
  Gemma 3 keeps its local layers at plain RoPE whatever their dict says (``srt/models/gemma3_causal.py``,
  ``Gemma3TextModel.__init__``: ``rope_type`` ``default`` and the local ``rope_theta``).
"""

from __future__ import annotations

import math
from typing import Any

from ...errors import RopeExtendError
from ...methods.yarn import mscale
from . import reference
from .rope import Rope

ENGINES = {"vllm": "vLLM 0.33.0", "sglang": "SGLang 0.5.23"}
KNOWN = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def effective(params: dict[str, Any], engine: str, max_positions: int, served: int) -> tuple[dict, int, list[str]]:
    """``(dict, length, notes)``: the transformers rope dict whose numbers ``engine`` computes from ``params``,
    the sequence length to compute it at, and what the engine reads differently (said in the report)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in KNOWN:
        raise RopeExtendError(f"the audit does not model {ENGINES[engine]}'s rope type {kind!r}; known: {KNOWN}")
    out, notes, length = dict(params), [], served
    out["rope_type"] = kind
    factor = float(params.get("factor", 1.0) or 1.0)
    if kind == "linear" and isinstance(params.get("factor"), int):
        raise RopeExtendError(
            f"{ENGINES[engine]} cannot load this linear dict: factor {params['factor']!r} is an integer, which "
            f"LinearScalingRotaryEmbedding iterates as a list of factors (TypeError at startup); write "
            f"{float(params['factor'])}"
        )
    if kind == "yarn":
        notes += _yarn(out, engine, factor, max_positions)
    elif kind == "longrope":
        length, said = _longrope(out, engine, max_positions, served)
        notes += said
    elif kind == "dynamic" and engine == "vllm":
        length, said = _vllm_dynamic(out, max_positions, served)
        notes += said
    elif kind == "dynamic":
        length = int(factor * max_positions)
        notes.append(f"dynamic made static at {length} tokens (factor x max_position_embeddings)")
    return out, length, notes


def _vllm_dynamic(out: dict[str, Any], max_positions: int, served: int) -> tuple[int, list[str]]:
    """vLLM's ``dynamic``: its base factor ``factor N / max_trained_positions - (factor - 1)`` is 1 without
    ``max_trained_positions`` (plain RoPE), and its table has ``N`` rows."""
    if "max_trained_positions" in out:
        raise RopeExtendError("the audit does not model vLLM's dynamic with max_trained_positions")
    for key in ("rope_type", "factor"):
        out.pop(key, None)
    out["rope_type"] = "default"
    notes = ["vLLM's dynamic is plain RoPE (without max_trained_positions its NTK base factor is 1): no scaling at all"]
    if served > max_positions:
        notes.append(
            f"vLLM's dynamic table has max_position_embeddings = {max_positions} rows, but it serves {served}: "
            f"positions past {max_positions} have no rotary entries"
        )
    return min(served, max_positions), notes


def _yarn(out: dict[str, Any], engine: str, factor: float, max_positions: int) -> list[str]:
    """Rewrite a yarn dict ``out`` in place into what ``engine`` computes; returns what it reads differently."""
    notes = []
    if "original_max_position_embeddings" not in out:
        if engine == "vllm":
            raise RopeExtendError(
                "vLLM 0.33.0 cannot load this yarn dict: get_rope reads original_max_position_embeddings from it "
                "(KeyError at startup)"
            )
        out["original_max_position_embeddings"] = max_positions
        notes.append(f"SGLang takes original_max_position_embeddings = max_position_embeddings = {max_positions}")
    if engine != "sglang":
        out.pop("attn_factor", None)
        return notes
    if float(out.get("extrapolation_factor", 1.0)) != 1.0:
        raise RopeExtendError("the audit does not model SGLang's yarn extrapolation_factor other than 1")
    if out.get("mscale") is not None and out.get("mscale_all_dim") is not None:
        scale = mscale(factor, out["mscale"]) / mscale(factor, out["mscale_all_dim"])
    else:
        scale = mscale(factor)
    scale *= float(out.get("attn_factor", 1.0))
    if "attention_factor" in out and abs(scale / out["attention_factor"] - 1) > 1e-6:
        notes.append(
            f"SGLang ignores attention_factor {out['attention_factor']}: its scale is attn_factor "
            f"{out.get('attn_factor', 1.0)} x (0.1 ln s + 1) = {scale:.6g}"
        )
    out["attention_factor"] = scale
    for key in ("mscale", "mscale_all_dim", "attn_factor", "extrapolation_factor"):
        out.pop(key, None)
    return notes


def _longrope(out: dict[str, Any], engine: str, max_positions: int, served: int) -> tuple[int, list[str]]:
    """Rewrite a longrope dict ``out`` in place (its scale made explicit); returns the length whose factors the
    engine uses for a sequence of ``served`` tokens, and what it does differently."""
    original = int(out.get("original_max_position_embeddings") or max_positions)
    ratio = max_positions / original
    default = 1.0 if ratio <= 1.0 else math.sqrt(1 + math.log(ratio) / math.log(original))
    mscales = [out.pop(k, None) for k in ("short_mscale", "long_mscale")]
    ignored = out.pop("attention_factor", None)
    long = served > original if engine == "vllm" else served - 1 > original
    chosen = mscales[1] if long else mscales[0]
    scale = default if chosen is None else float(chosen)
    out["attention_factor"] = scale
    notes = []
    if ignored is not None and abs(float(ignored) / scale - 1) > 1e-6:
        notes.append(
            f"{ENGINES[engine]} ignores a longrope attention_factor {ignored}: its scale is "
            f"{'long' if long else 'short'}_mscale, by default sqrt(1 + ln(N / original) / ln original) = {scale:.6g}"
        )
    if long and engine == "vllm":
        notes.append(
            f"LongRoPE: long factors for every sequence (served context {served} > original {original}); "
            f"transformers uses the short ones for sequences up to {original}"
        )
    elif long:
        notes.append(
            f"LongRoPE: long factors for every sequence in a batch that holds a position past {original} (SGLang "
            f"switches per batch); transformers switches per sequence, past {original} tokens"
        )
    if engine == "sglang" and served > original:
        notes.append(
            f"LongRoPE: SGLang rotates position {original} by angle 0 in a batch whose largest position it is (its "
            f"forward takes the long table only past {original}, and row {original} of its short table is the long "
            f"table's row 0): a sequence that reaches it one token at a time keeps that key unrotated"
        )
    if engine == "sglang" and served == original + 1:
        notes.append(
            f"LongRoPE: SGLang keeps the short factors up to {original + 1} tokens, transformers to {original}"
        )
    return (max(served, original + 1) if long else min(served, original)), notes


def layers(config, engine: str, served: int) -> tuple[list[tuple[str | None, Rope]], list[str]]:
    """``([(layer_type, Rope)], notes)``: what ``engine`` computes for each layer of ``config`` (a transformers text
    config built from the folder's config.json and the override JSON) when serving ``served`` tokens."""
    cache: dict[str | None, Rope] = {}
    notes: list[str] = []
    out = []
    for kind in reference.layer_types(config):
        if kind not in cache:
            params = reference.rope_params(config, kind)
            if engine == "sglang" and kind == "sliding_attention" and config.model_type.startswith("gemma3"):
                if params.get("rope_type", "default") != "default":
                    notes.append(
                        f"SGLang's Gemma 3 keeps sliding_attention layers at plain RoPE, not {params['rope_type']}"
                    )
                params = {"rope_type": "default", "rope_theta": params.get("rope_theta", 10000.0)}
            eff, length, said = effective(params, engine, int(config.max_position_embeddings), served)
            freqs, scale = reference.compute(config, kind, length, eff)
            cache[kind] = Rope(
                freqs, scale, f"{ENGINES[engine]}: {reference.describe(params)}", *reference.named(params)
            )
            notes += [f"{kind or 'all layers'}: {n}" if kind else n for n in said]
        out.append((kind, cache[kind]))
    return out, notes


def longest(config, engine: str) -> int:
    """The longest context the engine serves from the config without flags (vLLM's ``_get_and_verify_max_len``):
    ``max_position_embeddings``, times ``factor`` for every type but yarn, llama3 and longrope."""
    params = reference.rope_params(config, reference.layer_types(config)[0])
    kind = params.get("rope_type", "default")
    n = int(config.max_position_embeddings)
    if kind in ("linear", "dynamic"):
        return int(n * float(params.get("factor", 1.0)))
    return n
