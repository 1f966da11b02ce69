"""Reading and writing a transformers config's rotary settings.

- Reading: rotary geometry (head dim, base, partial rotary factor), the original length ``L``, the
  scaling a config already names, flat or per-layer-type (Gemma 3) ``rope_parameters``.
- Writing: ``configure`` puts a scaling into ``config.rope_parameters`` and raises
  ``max_position_embeddings``; ``snapshot``/``restore`` undo that exactly.

Where ``L`` lives: transformers keeps it in ``rope_parameters["original_max_position_embeddings"]`` for
yarn/llama3/longrope, and Phi-3 also as a top-level config attribute. ``configure`` writes the top-level
attribute for every method (transformers keeps unknown config attributes through save and reload), so a
second ``configure`` on the same config reads the same ``L`` and never compounds.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from ..errors import RopeExtendError, UnsupportedModelError
from ..methods import registry as M

logger = logging.getLogger("rope_extend")

# Keys of rope_parameters that are not method parameters.
BASE_KEYS = ("rope_type", "rope_theta", "partial_rotary_factor")
SCALING_KEYS = ("factor", "original_max_position_embeddings")
# Keys rope-extend writes into any rope type's parameters, transformers' own types included (scaled_rope_dict).
EXTRA_KEYS = frozenset({"logn"})
# Attention layer types that keep their own rotary (local windows); every other type is scaled.
LOCAL_LAYER_TYPES = ("sliding_attention", "chunked_attention", "local_attention")
_MISSING = object()


# ----------------------------------------------------------------------------------------------- reading
def text_config(config):
    """The decoder's config of a composite model (e.g. Gemma 3 with vision), else ``config`` itself."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def nested_layer_types(config) -> list[str]:
    """The layer types ``rope_parameters`` is keyed by (Gemma 3), or [] when it is one flat dict."""
    params = getattr(config, "rope_parameters", None) or {}
    labels = getattr(config, "_rope_type_labels", None) or getattr(config, "layer_types", None) or ()
    return [key for key in params if key in labels]


def scaled_layer_types(config) -> list[str | None]:
    """Which rope dicts a patch scales: [None] for a flat dict; the global (non-local) types when nested."""
    nested = nested_layer_types(config)
    if not nested:
        return [None]
    return [lt for lt in nested if lt not in LOCAL_LAYER_TYPES and config.rope_parameters[lt] is not None]


def rope_dict(config, layer_type: str | None = None) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None)
    if not params:
        raise UnsupportedModelError(
            f"{type(config).__name__} has no rope_parameters: the model does not use rotary position embeddings"
        )
    if layer_type is not None:
        params = params.get(layer_type)
        if params is None:
            raise UnsupportedModelError(f"{type(config).__name__} has no rope_parameters for layer type {layer_type!r}")
    return params


def head_dim(config) -> int:
    value = getattr(config, "head_dim", None)
    if value:
        return int(value)
    try:
        return int(config.hidden_size // config.num_attention_heads)
    except AttributeError as exc:
        raise UnsupportedModelError(
            f"cannot tell the head dimension of {type(config).__name__}: it has no head_dim, hidden_size or "
            "num_attention_heads"
        ) from exc


def rotary_geometry(config, layer_type: str | None = None) -> tuple[int, float]:
    """``(rotary_dim, base)`` of one rope dict: ``int(head_dim * partial_rotary_factor)`` and ``rope_theta``."""
    params = rope_dict(config, layer_type)
    prf = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    base = params.get("rope_theta", getattr(config, "rope_theta", None) or getattr(config, "default_theta", None))
    if isinstance(base, dict):  # Gemma 3 keeps {"global": ..., "local": ...} as its default_theta
        base = base.get("global")
    if base is None:
        raise UnsupportedModelError(f"{type(config).__name__}.rope_parameters has no rope_theta")
    return M.rotary_dim(head_dim(config), prf), float(base)


def original_length(config) -> int:
    """The pretraining length ``L``: the top-level or rope-dict ``original_max_position_embeddings``,
    else ``max_position_embeddings``."""
    value = config.__dict__.get("original_max_position_embeddings")
    if value is None:
        for lt in nested_layer_types(config) or [None]:
            params = rope_dict(config, lt) if getattr(config, "rope_parameters", None) else {}
            if params and params.get("original_max_position_embeddings"):
                value = params["original_max_position_embeddings"]
                break
    if value is None:
        value = getattr(config, "max_position_embeddings", None)
    if value is None:
        raise UnsupportedModelError(
            f"cannot tell the pretraining length of {type(config).__name__}: it has neither "
            "original_max_position_embeddings nor max_position_embeddings; pass original_max_position_embeddings="
        )
    return int(value)


def scaling_from_dict(params: dict[str, Any], default_length: int, ignore_keys=()) -> M.Scaling | None:
    """The rope-extend scaling a rope dict names, or None for plain RoPE or a type rope-extend lacks.

    Raises ``RopeExtendError`` for a rope-extend type with unknown or invalid parameters."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    method = M.by_rope_type(rope_type)
    if method is None:
        return None
    fields = {
        k: v
        for k, v in params.items()
        if k not in BASE_KEYS + SCALING_KEYS + ("type",) and k not in set(ignore_keys or ())
    }
    length = params.get("original_max_position_embeddings") or default_length
    if params.get("factor") is None:
        raise RopeExtendError(f"rope_parameters with rope_type {rope_type!r} needs a factor (a number >= 1)")
    return M.resolve(method, factor=params["factor"], original_max_position_embeddings=length, params=fields)


def config_scaling(config, layer_type: str | None = None) -> M.Scaling | None:
    return scaling_from_dict(rope_dict(config, layer_type), original_length(config))


# ----------------------------------------------------------------------------------------------- writing
def scaled_rope_dict(old: dict[str, Any], scaling: M.Scaling) -> dict[str, Any]:
    """A new rope dict for ``scaling`` that keeps the old one's base and partial rotary factor."""
    out = {key: old[key] for key in BASE_KEYS[1:] if key in old}
    out["rope_type"] = scaling.method.rope_type
    out["factor"] = scaling.factor
    # transformers' own linear type takes no original length; rope-extend keeps it top-level anyway
    if scaling.method.rope_type != "linear":
        out["original_max_position_embeddings"] = scaling.original_max_position_embeddings
    out.update(scaling.method.param_dict(scaling.params))
    if scaling.logn:
        out["logn"] = True
    return out


def snapshot(config) -> dict[str, Any]:
    """What ``write`` changes, to put back with ``restore``."""
    return {
        "rope_parameters": copy.deepcopy(config.rope_parameters),
        "max_position_embeddings": config.max_position_embeddings,
        "original_max_position_embeddings": config.__dict__.get("original_max_position_embeddings", _MISSING),
    }


def restore(config, snap: dict[str, Any]) -> None:
    config.rope_parameters = copy.deepcopy(snap["rope_parameters"])
    config.max_position_embeddings = snap["max_position_embeddings"]
    if snap["original_max_position_embeddings"] is _MISSING:
        config.__dict__.pop("original_max_position_embeddings", None)
    else:
        config.original_max_position_embeddings = snap["original_max_position_embeddings"]


def plan(
    config, method: str, *, factor=None, target_length=None, original_max_position_embeddings=None, **params
) -> M.Scaling:
    """Validate a configure/patch request against ``config`` and return the scaling; touches nothing."""
    m = M.get(method)
    length = original_length(config) if original_max_position_embeddings is None else original_max_position_embeddings
    scaling = M.resolve(
        m, factor=factor, target_length=target_length, original_max_position_embeddings=length, params=params
    )
    layer_types = scaled_layer_types(config)
    if not layer_types:
        raise UnsupportedModelError(f"{type(config).__name__} has no global rope parameters to scale")
    for lt in layer_types:
        dim, base = rotary_geometry(config, lt)
        scaling.compute(dim, base)  # raises on a parameter that does not fit the geometry (longrope factors)
    return scaling


def write(config, scaling: M.Scaling) -> None:
    """Put ``scaling`` into ``config`` (the global rope dicts) and set ``max_position_embeddings`` to the target."""
    params = copy.deepcopy(config.rope_parameters)
    for lt in scaled_layer_types(config):
        old = params if lt is None else params[lt]
        if old.get("rope_type", "default") != "default":
            logger.info("replacing rope_type %r with %s", old.get("rope_type"), scaling.describe())
        new = scaled_rope_dict(old, scaling)
        if lt is None:
            params = new
        else:
            params[lt] = new
    config.original_max_position_embeddings = scaling.original_max_position_embeddings
    config.max_position_embeddings = scaling.target_length
    config.rope_parameters = params


def configure(config, method: str, *, factor=None, target_length=None, original_max_position_embeddings=None, **params):
    """Write ``method`` into ``config.rope_parameters`` and raise ``max_position_embeddings`` to the target.

    ``factor`` is relative to the original pretraining length ``L`` (``original_max_position_embeddings``
    if the config has it, else ``max_position_embeddings``); ``target_length`` is the alternative
    (``factor = target_length / L``). Configuring again replaces the scaling and never compounds. Then
    ``AutoModelForCausalLM.from_pretrained(name, config=config)`` builds the scaled model.
    """
    cfg = text_config(config)
    scaling = plan(
        cfg,
        method,
        factor=factor,
        target_length=target_length,
        original_max_position_embeddings=original_max_position_embeddings,
        **params,
    )
    write(cfg, scaling)
    return config


def rope_parameters(
    method: str,
    *,
    factor=None,
    target_length=None,
    original_max_position_embeddings: int,
    rope_theta: float = 10000.0,
    **params,
) -> dict[str, Any]:
    """The ``rope_parameters`` dict for ``method``, ready for a config: ``{"rope_type": ..., "factor": ...}``."""
    m = M.get(method)
    scaling = M.resolve(
        m,
        factor=factor,
        target_length=target_length,
        original_max_position_embeddings=original_max_position_embeddings,
        params=params,
    )
    return scaled_rope_dict({"rope_theta": float(rope_theta)}, scaling)


def own_rope_type(rope_type: Any) -> bool:
    """Whether ``rope_type`` is one rope-extend registers (not one of transformers' own)."""
    method = M.by_rope_type(rope_type) if isinstance(rope_type, str) else None
    return method is not None and not method.in_transformers
