"""vLLM 0.33.0 and SGLang 0.5.23 reading a transformers config: the rope dict each effectively computes.

Both engines compute the same formulas as transformers for a given dict (checked against their own rotary code
in tests/export/test_audit_engines.py); where they differ is what they read (``rope_extend/export/configs.py``
has the whole account):

- YaRN's scale: vLLM takes ``attention_factor`` (the final scale), else ``mscale`` / ``mscale_all_dim``, else
  ``0.1 ln s + 1`` (``yarn_scaling_rope.py``); SGLang ignores ``attention_factor`` and multiplies its own
  temperature by ``attn_factor`` (``yarn.py``). vLLM requires ``original_max_position_embeddings`` in a yarn dict
  (``get_rope`` raises a KeyError without it); SGLang falls back to ``max_position_embeddings``.
- LongRoPE: both use the long factors for every sequence once the served context (``--max-model-len`` /
  ``--context-length``) is longer than ``original_max_position_embeddings`` (``phi3_long_rope_scaled_rope.py``),
  where transformers switches per forward by the sequence's own length; the scale comes from ``short_mscale`` /
  ``long_mscale``.
- ``dynamic`` is static: the base NTK gives at the longest length ``factor x max_position_embeddings``.
- Per layer type: a config with one dict per layer type (Gemma 3) is read per type, as transformers does.
"""

from __future__ import annotations

from typing import Any

from ...errors import RopeExtendError
from . import reference
from .rope import Rope, mscale

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
    if kind == "yarn":
        notes += _yarn(out, engine, factor, max_positions)
    elif kind == "longrope":
        length, said = _longrope(out, max_positions, served)
        notes += said
    elif kind == "dynamic":
        length = int(factor * max_positions)
        notes.append(f"dynamic made static at {length} tokens (factor x max_position_embeddings)")
    return out, length, notes


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
    for key in ("mscale", "mscale_all_dim", "attn_factor"):
        out.pop(key, None)
    return notes


def _longrope(out: dict[str, Any], max_positions: int, served: int) -> tuple[int, list[str]]:
    """Rewrite a longrope dict ``out`` in place; returns the length whose factors the engine uses and a note."""
    original = int(out.get("original_max_position_embeddings") or max_positions)
    notes = []
    if served > original:
        notes.append(
            f"LongRoPE: long factors for every sequence (served context {served} > original {original}); "
            f"transformers uses the short ones for sequences up to {original}"
        )
    mscales = [out.pop(k, None) for k in ("short_mscale", "long_mscale")]
    chosen = mscales[1] if served > original else mscales[0]
    if chosen is not None:
        out["attention_factor"] = float(chosen)
    return (served if served <= original else max(served, original + 1)), notes


def layers(config, engine: str, served: int) -> tuple[list[tuple[str | None, Rope]], list[str]]:
    """``([(layer_type, Rope)], notes)``: what ``engine`` computes for each layer of ``config`` (a transformers text
    config built from the folder's config.json and the override JSON) when serving ``served`` tokens."""
    cache: dict[str | None, Rope] = {}
    notes: list[str] = []
    out = []
    for kind in reference.layer_types(config):
        if kind not in cache:
            params = reference.rope_params(config, kind)
            eff, length, said = effective(params, engine, int(config.max_position_embeddings), served)
            freqs, scale = reference.compute(config, kind, length, eff)
            cache[kind] = Rope(freqs, scale, f"{ENGINES[engine]}: {reference.describe(params)}")
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
