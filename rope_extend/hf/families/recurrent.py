"""Layers whose KV cache slot holds a recurrent or convolution state instead of (or beside) keys and values.

Hybrid families (Qwen3-Next and Qwen3.5's gated delta nets, LFM2's short convolutions, Bamba's and Granite
4.0-H's Mamba layers, Falcon-H1's Mamba heads beside attention in every layer) name those layers in their
config's ``layer_types`` (``linear_attention``, ``conv``, ``hybrid``, ``hybrid_sliding``), and transformers' own
``DynamicCache(config=...)`` gives each such layer a cache layer that keeps the state
(``cache_utils.LinearAttentionCacheLayerMixin``: ``LinearAttentionLayer``, ``LinearAttentionAndFullAttentionLayer``,
...). The rule asks transformers' own mapping from layer type to cache layer, so a new state kind that
transformers adds is found without a change here.

What it is for: a state summarizes every token the layer has seen, so no token can be taken out of it
(``SinkCache`` refuses such a model); and it holds no key that a rotation could turn (the dynamic methods' cache
keeper turns only the attention layers' keys, ``hf.cache_keeper``).
"""

from __future__ import annotations

from .rule import Rule

# layers without attention or state (a feed-forward block), which transformers 5.17 gives a LinearAttentionLayer as a
# placeholder that stays empty (5.24 a DummyLayer)
PLACEHOLDERS = ("moe", "mlp")


def _state_layers(config) -> dict[int, str] | None:
    """``{layer index: layer type}`` for the layers whose cache transformers builds with a recurrent or convolution
    state (``config.layer_types`` through ``DYNAMIC_LAYER_TYPE_MAPPING``); None when there is none (or no
    ``layer_types``)."""
    from transformers import cache_utils

    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    mapping = getattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING", None)
    types = getattr(config, "layer_types", None)
    if mixin is None or not isinstance(mapping, dict) or not isinstance(types, list | tuple):
        return None
    found = {}
    for index, layer_type in enumerate(types):
        layer = mapping.get(layer_type) if isinstance(layer_type, str) else None
        if layer_type in PLACEHOLDERS:
            continue
        if isinstance(layer, type) and issubclass(layer, mixin):
            found[index] = layer_type
    return found or None


def spans(indices: list[int]) -> str:
    """``[0, 1, 2, 4]`` as ``"0-2, 4"``: the layers a message names, short for a deep model."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def describe(state: dict[int, str]) -> str:
    """``{0: "conv", 1: "conv", 3: "linear_attention"}`` as ``"layers 0, 1 (conv) and 3 (linear_attention)"``."""
    kinds: dict[str, list[int]] = {}
    for index, kind in state.items():
        kinds.setdefault(kind, []).append(index)
    parts = [f"{spans(indices)} ({kind})" for kind, indices in kinds.items()]
    word = "layer" if len(state) == 1 else "layers"
    return f"{word} {' and '.join(parts)}"


RECURRENT_STATE_LAYERS = Rule("recurrent_state_layers", "state_layers", _state_layers)
