"""transformers as the reference: the inverse frequencies and cos/sin scale its rotary module gives each layer.

Frequencies come from transformers' own code: ``ROPE_INIT_FUNCTIONS[rope_type]`` (``modeling_rope_utils.py``) for
the scaled types, the model's own ``*RotaryEmbedding.compute_default_rope_parameters`` for ``default``, per layer
type for models whose ``rope_parameters`` hold one dict per type (Gemma 3, ``layer_types``). A length-dependent
type (``longrope``, ``dynamic``) is computed for a sequence of ``length`` tokens, as its forward would.
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ...errors import RopeExtendError
from .rope import Rope

ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")


def load(source, overrides: dict[str, Any] | None = None):
    """The text config of a transformers folder or ``config.json`` (``source``), with ``overrides`` (vLLM's
    ``--hf-overrides`` / SGLang's ``--json-model-override-args``) merged into its JSON first."""
    path = Path(source)
    file = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RopeExtendError(f"cannot read a transformers config at {source}: {exc}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise RopeExtendError(f"{file} is not a transformers config (no model_type)")
    data = merge(data, overrides or {})
    kind = data.pop("model_type")
    try:
        config = AutoConfig.for_model(kind, **data)
    except (ValueError, KeyError, TypeError) as exc:
        raise RopeExtendError(f"transformers cannot build a {kind!r} config from {file}: {exc}") from None
    return config.get_text_config()


def merge(data: dict, overrides: dict) -> dict:
    """``data`` with ``overrides`` merged in (nested dicts key by key, as vLLM's ``--hf-overrides`` does)."""
    out = dict(data)
    for key, value in overrides.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def layer_types(config) -> list[str | None]:
    """Each layer's rope key: its layer type where ``rope_parameters`` holds one dict per type, else None."""
    params = getattr(config, "rope_parameters", None) or {}
    types = getattr(config, "layer_types", None)
    if types and all(isinstance(params.get(t), dict) for t in set(types)):
        return list(types)
    return [None] * int(config.num_hidden_layers)


def rope_params(config, layer_type: str | None) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None)
    if not params:
        raise RopeExtendError(f"{config.model_type} has no rope_parameters: it uses no rotary position embeddings")
    return dict(params[layer_type] if layer_type is not None else params)


def _rotary_class(config):
    """The model's ``*RotaryEmbedding`` class (for its ``compute_default_rope_parameters``), or None."""
    try:  # the modeling module beside the config's own (gemma3_text's is gemma3's)
        module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        return None
    found = [v for k, v in vars(module).items() if k.endswith("RotaryEmbedding") and hasattr(v, "__init__")]
    return next((c for c in found if hasattr(c, "compute_default_rope_parameters")), None)


def compute(config, layer_type: str | None, length: int, params: dict[str, Any] | None = None) -> tuple:
    """``(inv_freq, scale)`` transformers computes for ``layer_type`` at a sequence of ``length`` tokens; with
    ``params``, for that rope dict in place of the config's own (how the engine models say "transformers'
    numbers for the dict the engine effectively reads")."""
    if params is not None:
        config = copy.deepcopy(config)
        if layer_type is None:
            config.rope_parameters = dict(params)
        else:
            config.rope_parameters = {**config.rope_parameters, layer_type: dict(params)}
    rope_type = rope_params(config, layer_type).get("rope_type", "default")
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    if rope_type == "default":
        klass = _rotary_class(config)
        if klass is None:
            raise RopeExtendError(f"no rotary module for {config.model_type!r} in this transformers")
        inv_freq, scale = klass.compute_default_rope_parameters(config, **kwargs)
    elif rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=length, **kwargs)
    else:
        raise RopeExtendError(f"transformers has no rope type {rope_type!r}; known: {', '.join(ROPE_INIT_FUNCTIONS)}")
    return inv_freq.double().numpy(), float(scale)


def describe(params: dict[str, Any]) -> str:
    keys = ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "truncate")
    parts = [str(params.get("rope_type", "default")), f"theta {params.get('rope_theta', '?'):g}"]
    parts += [f"{k} {params[k]}" for k in keys if k in params]
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        parts.append(f"partial_rotary_factor {params['partial_rotary_factor']}")
    return ", ".join(parts)


def layers(config, length: int) -> list[tuple[str | None, Rope]]:
    """``[(layer_type, Rope)]`` for every layer, as transformers computes them at ``length`` tokens."""
    cache: dict[str | None, Rope] = {}
    out = []
    for kind in layer_types(config):
        if kind not in cache:
            freqs, scale = compute(config, kind, length)
            cache[kind] = Rope(freqs, scale, "transformers: " + describe(rope_params(config, kind)))
        out.append((kind, cache[kind]))
    return out


def dims(config, layer_type: str | None = None) -> tuple[int, float]:
    """``(rotated dimensions, base)`` of a layer type."""
    params = rope_params(config, layer_type)
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head * params.get("partial_rotary_factor", 1.0)), float(params.get("rope_theta", 10000.0))


def plain(dim: int, base: float) -> np.ndarray:
    return 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
