"""Families that take an attention scale or a query temperature from somewhere else than the rope init function.

- PhiMoE's rotary reads its attention scale from ``rope_parameters`` (``short_mscale`` up to ``L``,
  ``long_mscale`` beyond) and needs both for any scaled type: rope-extend writes the method's scale into each,
  so only a constant scale is possible (``scale_keys``).
- Llama 4's NoPE layers multiply the query at position ``p`` by ``1 + attn_scale ln(1 + floor((p + 1) /
  floor_scale))`` when ``attn_temperature_tuning`` is set (the config's values, copied onto each attention
  module); log-n would multiply it once more, so it is refused rather than stacked or silently swapped
  (``own_temperature``).
- Code that reads a shipped scaling's keys besides the rope init function (``kept_reads``): PhiMoE's scale keys;
  the MLA families' softmax scale, built from ``factor`` and ``mscale_all_dim`` by transformers'
  ``yarn_apply_mscale`` (DeepSeek V2/V3, Kimi, GLM-4 MoE Lite, MiniCPM3, Mistral 4, ...); Ministral 3's
  ``llama_4_scaling_beta`` over ``original_max_position_embeddings``.
"""

from __future__ import annotations

import importlib
from typing import Any

from .rule import Rule, ask, constant

# The function of transformers' MLA modeling modules that builds the softmax scale from the rope dict.
MSCALE_FUNCTION = "yarn_apply_mscale"


def _llama4_temperature(holder) -> str | None:
    if not getattr(holder, "attn_temperature_tuning", False):
        return None
    scale, floor = getattr(holder, "attn_scale", None), getattr(holder, "floor_scale", None)
    return (
        f"its NoPE layers already scale their queries by Llama 4's temperature (attn_temperature_tuning: "
        f"1 + {scale} ln(1 + floor((p + 1) / {floor}))), and log-n would compound with it; load the model with "
        "attn_temperature_tuning=False to have log-n instead, or leave logn out to keep it"
    )


def builds_softmax_scale(config) -> bool:
    """Whether the family's modeling code scales its softmax by the rope dict when it builds its attention
    (its modeling module has ``MSCALE_FUNCTION``)."""
    name = type(config).__module__.replace(".configuration_", ".modeling_")
    try:
        return hasattr(importlib.import_module(name), MSCALE_FUNCTION)
    except ImportError:
        return False


def _reads_scale_keys(config, params: dict[str, Any]) -> str | None:
    keys = ask("scale_keys", config)
    if not keys:
        return None
    return (
        f"{type(config).__name__}'s rotary reads its attention scale from rope_parameters "
        f"({' and '.join(keys)}) on each side of L at every forward"
    )


def _builds_mla_scale(config, params: dict[str, Any]) -> str | None:
    if not (params.get("mscale_all_dim") and builds_softmax_scale(config)):
        return None
    return (
        f"{type(config).__name__}'s attention (MLA) builds its softmax scale from rope_parameters' factor and "
        "mscale_all_dim, and the method's own factor takes that key"
    )


def _reads_llama4_beta(config, params: dict[str, Any]) -> str | None:
    if params.get("llama_4_scaling_beta") is None:
        return None
    return (
        "the family's attention scales its queries by llama_4_scaling_beta over rope_parameters' "
        "original_max_position_embeddings, which keep_shipped sets to the shipped context"
    )


PHIMOE_SCALE_KEYS = Rule("phimoe_scale_keys", "scale_keys", constant(("short_mscale", "long_mscale")), ("phimoe",))
LLAMA4_TEMPERATURE = Rule("llama4_temperature", "own_temperature", _llama4_temperature)
SCALE_KEYS_KEPT = Rule("scale_keys_kept", "kept_reads", _reads_scale_keys)
MLA_SOFTMAX_SCALE_KEPT = Rule("mla_softmax_scale_kept", "kept_reads", _builds_mla_scale)
LLAMA4_SCALING_BETA_KEPT = Rule("llama4_scaling_beta_kept", "kept_reads", _reads_llama4_beta)
