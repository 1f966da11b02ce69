"""transformers as the reference: the inverse frequencies and cos/sin scale its rotary module gives each layer.

Frequencies come from transformers' own code: ``ROPE_INIT_FUNCTIONS[rope_type]`` (``modeling_rope_utils.py``) for
the scaled types, the model's own ``*RotaryEmbedding.compute_default_rope_parameters`` for ``default``, per layer
type for models whose ``rope_parameters`` hold one dict per type (Gemma 3, ``layer_types``). A length-dependent
type (``longrope``, ``dynamic``) is computed for a sequence of ``length`` tokens, as its forward would.
"""

from __future__ import annotations

import copy
import importlib
from pathlib import Path
from typing import Any

from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ...errors import RopeExtendError, UnsupportedModelError
from ...hf import reading
from ...loading import CONFIG_ERRORS, error_line
from ...methods._common import Geometry, check_factor, check_int, check_length, check_number, check_original_length
from ...methods.llama3 import Llama3Params
from ...methods.longrope import LongRopeParams
from ...methods.yarn import NTKByPartsParams
from ...untrusted import read_json
from .rope import MAX_LAYERS, MAX_ROTARY_DIM, Rope

ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")
COUNTS = ("num_hidden_layers", "max_position_embeddings")  # checked again on the built config (check)


def load(source, overrides: dict[str, Any] | None = None):
    """The text config of a transformers folder or ``config.json`` (``source``), with ``overrides`` (vLLM's
    ``--hf-overrides`` / SGLang's ``--json-model-override-args``) merged into its JSON first; every value the
    audit computes with is checked (``check``)."""
    path = Path(source)
    file = path / "config.json" if path.is_dir() else path
    data = read_json(file, name=f"the transformers config {file}", fix="give the config.json of a transformers model")
    if not isinstance(data, dict) or "model_type" not in data:
        raise RopeExtendError(f"{file} is not a transformers config (no model_type)")
    if overrides is not None and not isinstance(overrides, dict):
        raise RopeExtendError(f"the override JSON must be an object, got {type(overrides).__name__}")
    data = merge(data, overrides or {})
    kind = data.pop("model_type")
    if not isinstance(kind, str):
        raise RopeExtendError(f"{file}: model_type must be a string, got {kind!r}"[:300])
    said = " (with the override JSON)" if overrides else ""
    try:  # before transformers, which divides by some of these values as it builds the config
        for key in COUNTS:
            if key in data:
                check_int(key, data[key], minimum=1)
        for where, params in _raw_rope_dicts(data):
            try:
                _check_rope(params)
            except RopeExtendError as exc:
                raise RopeExtendError(f"{where}: {exc}") from None
    except RopeExtendError as exc:
        raise RopeExtendError(f"{file}{said}: {exc}") from None
    try:
        config = AutoConfig.for_model(kind, **data).get_text_config()
    except CONFIG_ERRORS as exc:  # transformers on values of the wrong type or shape: one line (``loading``)
        raise RopeExtendError(f"transformers cannot build a {kind!r} config from {file}: {error_line(exc)}") from None
    try:
        check(config)
    except (RopeExtendError, UnsupportedModelError) as exc:
        raise RopeExtendError(f"{file}{said}: {exc}") from None
    return config


def _raw_rope_dicts(data: dict[str, Any]):
    """``(where, dict)`` for each rope dict in a config's JSON: ``rope_parameters`` or the older ``rope_scaling``,
    one flat dict or one per layer type."""
    for key in ("rope_parameters", "rope_scaling"):
        value = data.get(key)
        if isinstance(value, dict):
            nested = [(f"{key}[{k!r}]", v) for k, v in value.items() if isinstance(v, dict)]
            yield from nested or [(key, value)]


def check(config) -> None:
    """Refuse a config whose values the audit cannot compute with: a layer count, length or rope value of the
    wrong type or out of its range (the methods' own checks, ``methods.check_*`` and their parameter classes, and
    ``hf.reading``'s rotary geometry)."""
    n_layers = check_int("num_hidden_layers", getattr(config, "num_hidden_layers", None), minimum=1)
    types = getattr(config, "layer_types", None)
    if types is not None and (not isinstance(types, list) or not all(isinstance(t, str) for t in types)):
        raise RopeExtendError(f"layer_types must be a list of layer type names, got {types!r}"[:300])
    if max(n_layers, len(types or ())) > MAX_LAYERS:
        raise RopeExtendError(f"{max(n_layers, len(types or ()))} layers: the audit reads at most {MAX_LAYERS}")
    check_length("max_position_embeddings", getattr(config, "max_position_embeddings", None))
    if config.__dict__.get("original_max_position_embeddings") is not None:  # Phi-3 keeps L at the top level too
        check_original_length(config.original_max_position_embeddings)
    for kind in dict.fromkeys(layer_types(config)):
        where = "rope_parameters" + (f"[{kind!r}]" if kind else "")
        params = rope_params(config, kind)
        try:
            _check_rope(params)
            dim = _rotary_dim(config, kind)
        except (RopeExtendError, UnsupportedModelError) as exc:
            raise RopeExtendError(f"{where}: {exc}") from None
        for name in ("short_factor", "long_factor") if params.get("rope_type") == "longrope" else ():
            if len(params[name]) != dim // 2:
                raise RopeExtendError(
                    f"{where}.{name} has {len(params[name])} values; rotary dimension/2 is {dim // 2}"
                )


# rope dict key: the range check_number holds it to (the types' own rules where the methods have one: a base
# > 1 as Geometry's; every scale > 0; mscale and mscale_all_dim >= 0, as vLLM and SGLang read 0 as "not set")
NUMBERS = {
    "rope_theta": {"above": 1.0},
    "attention_factor": {"above": 0.0},
    "attn_factor": {"above": 0.0},
    "short_mscale": {"above": 0.0},
    "long_mscale": {"above": 0.0},
    "mscale": {"minimum": 0.0},
    "mscale_all_dim": {"minimum": 0.0},
    "extrapolation_factor": {},
}
# rope dict key: the least value of a length key (an original length of 1 makes LongRoPE's scale divide by ln 1 = 0:
# ``check_original_length``); every length is at most ``methods.MAX_LENGTH``
INTEGERS = {"original_max_position_embeddings": 2, "max_trained_positions": 1}


def _check_rope(params: dict[str, Any]) -> None:
    """One rope dict's values, each with the package's own check for it."""
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str):
        raise RopeExtendError(f"rope_type must be a name, got {kind!r}"[:300])
    for key, bounds in NUMBERS.items():
        if params.get(key) is not None:
            check_number(key, params[key], **bounds)
    for key, least in INTEGERS.items():
        if params.get(key) is not None:
            check_length(key, params[key], minimum=least)
    if params.get("factor") is not None:
        check_factor(params["factor"])
    if kind == "yarn":
        NTKByPartsParams(**{k: params[k] for k in ("beta_fast", "beta_slow", "truncate") if params.get(k) is not None})
    elif kind == "llama3":
        Llama3Params(**{k: params[k] for k in ("low_freq_factor", "high_freq_factor") if k in params})
    elif kind == "longrope":
        LongRopeParams(params.get("short_factor"), params.get("long_factor"))


def _rotary_dim(config, kind: str | None) -> int:
    """The rotary dimension of a layer type by ``hf.reading``'s rule (even, >= 2, partial rotary factor in (0, 1]),
    the numbers it divides checked first (``reading.head_dim`` takes them as they are); its base held to
    ``Geometry``'s rule."""
    layer = reading.layer_config(config, kind)
    if getattr(layer, "head_dim", None):
        check_int("head_dim", layer.head_dim, minimum=2)
    else:
        check_int("hidden_size", getattr(layer, "hidden_size", None), minimum=1)
        check_int("num_attention_heads", getattr(layer, "num_attention_heads", None), minimum=1)
    dim, base = reading.rotary_geometry(config, kind)
    Geometry(dim, base, 2)
    if dim > MAX_ROTARY_DIM:
        raise RopeExtendError(f"rotary dimension {dim}: the audit reads at most {MAX_ROTARY_DIM}")
    return dim


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


def named(params: dict[str, Any]) -> tuple[int | None, float]:
    """``(original length, factor)`` a rope dict names, for ``Rope``: the original length of the types that
    depend on it, the factor (1 when absent)."""
    kind = params.get("rope_type", "default")
    original = params.get("original_max_position_embeddings") if kind in ("yarn", "longrope", "llama3") else None
    return original, float(params.get("factor") or 1.0)


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
            params = rope_params(config, kind)
            cache[kind] = Rope(freqs, scale, "transformers: " + describe(params), *named(params))
        out.append((kind, cache[kind]))
    return out
