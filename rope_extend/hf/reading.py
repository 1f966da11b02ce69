"""Reading a transformers config's rotary settings: rotary geometry (head dim, base, partial rotary factor), the
original length ``L``, the context ``C`` the model ships with, and the scaling a config already names, flat or
per-layer-type (Gemma 3) ``rope_parameters``.

Layer types: a per-layer-type ``rope_parameters`` (Gemma 3, Gemma 4) scales its global types only (every type but
``families.LOCAL_LAYER_TYPES``), and reads each type's geometry from the layer type's own config (Gemma 4's full
layers have their own head dim, ``config.per_layer_config[layer_type]``). Proportional RoPE (``hf.rope_types``):
a method scales the rotating frequencies (computed for ``d = head_dim``, as transformers lays them out) and the
zeros stay.

Where ``L`` lives: transformers keeps it in ``rope_parameters["original_max_position_embeddings"]`` for
yarn/llama3/longrope, and Phi-3 also as a top-level config attribute. ``hf.config.write`` writes the top-level
attribute for every method (transformers keeps unknown config attributes through save and reload), so a second
``configure`` on the same config reads the same ``L`` and never compounds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any

import torch

from ..errors import RopeExtendError, UnsupportedModelError
from ..methods import registry
from ..methods._common import (
    Method,
    check_factor,
    check_int,
    check_length,
    check_number,
    check_original_length,
    check_partial_rotary_factor,
    rotary_dim,
)
from ..methods.resolved import Scaling, resolve
from . import families
from .names import SHIPPED_ATTR
from .rope_types import (
    BASE_KEYS,
    PROPORTIONAL,
    SCALING_KEYS,
    SHIPPED_KEY,
    keepable,
    rope_type_of,
    split_rope_type,
    transformers_rope_type_keys,
)


# ----------------------------------------------------------------------------------------------- errors
def family(config) -> str:
    """How messages name a model: its ``model_type`` (``gemma4``), else its class name."""
    return getattr(config, "model_type", None) or type(config).__name__


@contextlib.contextmanager
def naming(config, method: Any):
    """Re-raise rope-extend's refusals with the family and the method named: ``gemma4: cannot apply 'yarn': ...``."""
    try:
        yield
    except (RopeExtendError, UnsupportedModelError) as exc:
        raise type(exc)(f"{family(config)}: cannot apply {method!r}: {exc}") from exc


def text_config(config):
    """The decoder's config of a composite model (e.g. Gemma 3 with vision), else ``config`` itself."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def attn_implementation(config) -> str | None:
    """The attention implementation a model's layers use (``eager``, ``sdpa``, ``flash_attention_2``, a
    registered name such as rope-extend's own), read from transformers' private ``config._attn_implementation``;
    None for an object without one."""
    return getattr(config, "_attn_implementation", None) if config is not None else None


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
    return [lt for lt in nested if lt not in families.LOCAL_LAYER_TYPES and config.rope_parameters[lt] is not None]


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


def layer_config(config, layer_type: str | None = None):
    """The config a layer type's attention is built from: ``config.per_layer_config[layer_type]`` for a
    heterogeneous config (Gemma 4's full layers have their own head dim), else ``config``."""
    if layer_type is None or not getattr(config, "is_heterogeneous", False):
        return config
    try:
        return config.per_layer_config[layer_type]
    except ValueError as exc:  # the layer type's layers differ from each other
        raise UnsupportedModelError(
            f"{type(config).__name__}: the {layer_type!r} layers do not share one configuration ({exc})"
        ) from exc


def head_dim(config, layer_type: str | None = None) -> int:
    """The head dimension: ``config.head_dim``, else ``hidden_size // num_attention_heads`` when it is unset (None
    or 0: transformers' rotary init reads it with ``or``, so rope-extend reads it as transformers does). Each
    value is checked before it is computed with (``check_int``): a config is a user's file, and ``int()`` made
    ``"16"`` a head dim, ``16.5`` a truncated one, and NaN a traceback."""
    config = layer_config(config, layer_type)
    value = getattr(config, "head_dim", None)
    if value:
        return check_int("head_dim", value, minimum=2)
    try:
        hidden, heads = config.hidden_size, config.num_attention_heads
    except AttributeError as exc:
        raise UnsupportedModelError(
            f"cannot tell the head dimension of {type(config).__name__}: it has no head_dim, hidden_size or "
            "num_attention_heads"
        ) from exc
    return check_int("hidden_size", hidden) // check_int("num_attention_heads", heads)


def rotary_geometry(config, layer_type: str | None = None) -> tuple[int, float]:
    """``(rotary_dim, base)`` of one rope dict: ``int(head_dim * partial_rotary_factor)`` and ``rope_theta``;
    for proportional RoPE ``head_dim`` itself (see ``rotating``). Each is checked (``rotary_dim``,
    ``check_number``, ``partial_rotary_factor``): a string, NaN, zero or negative value is one ``RopeExtendError``
    naming the field."""
    params = rope_dict(config, layer_type)
    prf = partial_rotary_factor(config, layer_type)
    base = params.get("rope_theta", getattr(config, "rope_theta", None) or getattr(config, "default_theta", None))
    if isinstance(base, dict):  # Gemma 3 keeps {"global": ..., "local": ...} as its default_theta
        base = base.get("global")
    if base is None:
        raise UnsupportedModelError(f"{type(config).__name__}.rope_parameters has no rope_theta")
    base = check_number("rope_theta", base, above=1.0)  # as Geometry checks it; float("1e4") read a string
    if split_rope_type(rope_type_of(params))[0] == PROPORTIONAL:
        return rotary_dim(head_dim(config, layer_type)), base
    return rotary_dim(head_dim(config, layer_type), prf), base


def partial_rotary_factor(config, layer_type: str | None = None) -> float:
    """The share of each head that rotates, read here alone and checked (``check_partial_rotary_factor``: a number
    in (0, 1]; a string made proportional RoPE's count a TypeError): the rope dict's, else the config's top-level
    one (unset when 0 or None, as transformers reads it), else 1; for proportional RoPE the rope dict's alone,
    as transformers' ``proportional`` init reads it."""
    params = rope_dict(config, layer_type)
    if split_rope_type(rope_type_of(params))[0] == PROPORTIONAL:
        return check_partial_rotary_factor(params.get("partial_rotary_factor", 1.0))
    return check_partial_rotary_factor(
        params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    )


def rotating(config, layer_type: str | None = None) -> int | None:
    """How many of the ``rotary_dim / 2`` frequencies rotate: None for all; for proportional RoPE
    ``int(partial_rotary_factor * head_dim // 2)``, as transformers' ``proportional`` init computes it."""
    params = rope_dict(config, layer_type)
    if split_rope_type(rope_type_of(params))[0] != PROPORTIONAL:
        return None
    return int(partial_rotary_factor(config, layer_type) * head_dim(config, layer_type) // 2)


def frequencies(scaling: Scaling, dim: int, base: float, rotating: int | None, seq_len: int | None = None):
    """``scaling.compute(dim, base, seq_len)`` with the frequencies past ``rotating`` at zero (proportional
    RoPE: those dimensions never rotate, whatever the method)."""
    freqs, scale = scaling.compute(dim, base, seq_len)
    if rotating is not None and rotating < freqs.numel():
        freqs = torch.cat([freqs[:rotating], torch.zeros(freqs.numel() - rotating, dtype=freqs.dtype)])
    return freqs, scale


def original_length(config) -> int:
    """The pretraining length ``L``: the top-level or rope-dict ``original_max_position_embeddings``,
    else ``max_position_embeddings``. Checked as the audit checks it (``check_original_length``: an integer from 2
    to ``MAX_LENGTH``): a config is a user's file, and ``int()`` made ``"4096"`` a length and NaN a traceback."""
    name = "original_max_position_embeddings"
    value = config.__dict__.get(name)
    if value is None:
        for lt in nested_layer_types(config) or (None,):
            params = config.rope_parameters if lt is None else config.rope_parameters.get(lt)
            if params and params.get(name):
                value = params[name]
                break
    if value is None:
        name, value = "max_position_embeddings", getattr(config, "max_position_embeddings", None)
        shipped = _linear_within_context(config)
        if value is not None and shipped:
            context = check_length(name, value)
            return check_original_length(round(context / shipped), f"{name} / the shipped linear factor {shipped:g}")
    if value is None:
        raise UnsupportedModelError(
            f"cannot tell the pretraining length of {type(config).__name__}: it has neither "
            "original_max_position_embeddings nor max_position_embeddings; pass original_max_position_embeddings="
        )
    return check_original_length(value, name)


def _linear_within_context(config) -> float | None:
    """The shipped ``linear`` factor of a family whose ``L`` is ``max_position_embeddings / factor``
    (``families``' ``linear_within_context``: Gemma 3), else None."""
    if not families.ask("linear_within_context", config):
        return None
    for lt in nested_layer_types(config) or (None,):
        params = config.rope_parameters if lt is None else config.rope_parameters.get(lt)
        if params and split_rope_type(rope_type_of(params))[1] == "linear":
            factor = check_factor(params.get("factor") or 1.0)
            if factor > 1:
                return factor
    return None


def scaling_from_dict(params: dict[str, Any], default_length: int, ignore_keys=()) -> Scaling | None:
    """The rope-extend scaling a rope dict names, or None for plain RoPE or a type rope-extend lacks.

    Raises ``RopeExtendError`` for a rope-extend type with unknown or invalid parameters."""
    rope_type = split_rope_type(rope_type_of(params))[1]
    method = registry.by_rope_type(rope_type)
    if method is None:
        return None
    fields = {
        k: v
        for k, v in params.items()
        if k not in BASE_KEYS + SCALING_KEYS + ("type", SHIPPED_KEY) and k not in set(ignore_keys or ())
    }
    length = params.get("original_max_position_embeddings") or default_length
    if params.get("factor") is None:
        raise RopeExtendError(f"rope_parameters with rope_type {rope_type!r} needs a factor (a number >= 1)")
    scaling = resolve(method, factor=params["factor"], original_max_position_embeddings=length, params=fields)
    if params.get(SHIPPED_KEY) is None:
        return scaling
    return dataclasses.replace(scaling, shipped=_kept_from_dict(params[SHIPPED_KEY], method, ignore_keys))


def _kept_from_dict(kept: Any, method: Method, ignore_keys) -> Scaling:
    """The shipped scaling a ``keep_shipped`` rope dict records under ``SHIPPED_KEY`` (``scaled_rope_dict``)."""
    if not method.attention:
        raise RopeExtendError(
            f"rope_parameters.{SHIPPED_KEY} (a shipped scaling kept by keep_shipped) goes with an attention method, "
            f"not {method.name}"
        )
    rope_type = rope_type_of(kept) if isinstance(kept, dict) else None
    inner = registry.by_rope_type(rope_type) if isinstance(rope_type, str) else None
    if inner is None or not inner.in_transformers or not kept.get("original_max_position_embeddings"):
        raise RopeExtendError(
            f"rope_parameters.{SHIPPED_KEY} must be a rope dict of one of transformers' types "
            f"({', '.join(keepable())}) with its factor and original_max_position_embeddings, got {kept!r}"
        )
    scaling = scaling_from_dict(kept, kept["original_max_position_embeddings"], ignore_keys)
    assert scaling is not None  # None only for a type the registry lacks, and ``inner`` is that type's method
    return scaling


def config_scaling(config, layer_type: str | None = None) -> Scaling | None:
    """The scaling ``config`` names; the family's own rope keys (``ignore_keys_at_rope_validation``: Ministral 3's
    ``llama_4_scaling_beta``, M-RoPE's ``mrope_section``) are not method parameters."""
    return scaling_from_dict(rope_dict(config, layer_type), original_length(config), ignore_keys=family_keys(config))


def family_keys(config, ignore_keys=None) -> set[str]:
    """Rope keys of the family, not of a method: ``ignore_keys_at_rope_validation``, the family's ``scale_keys``
    (``families``) and the keys of transformers' ``RopeParameters`` that no rope type's validator claims
    (``mrope_section``)."""
    keys = set(ignore_keys or getattr(config, "ignore_keys_at_rope_validation", None) or ())
    return keys | set(families.ask("scale_keys", config) or ()) | _layout_keys()


@functools.cache
def _layout_keys() -> frozenset[str]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters

    claimed = set(BASE_KEYS)
    for rope_type in ROPE_INIT_FUNCTIONS:
        claimed |= transformers_rope_type_keys(rope_type) or set()
    # M-RoPE's keys, which transformers 5.17's RopeParameters does not declare yet
    return frozenset((set(RopeParameters.__annotations__) | families.MROPE_KEYS) - claimed)


def shipped_context(config) -> int:
    """The context ``C`` the model ships with, which a ``factor`` counts from: recorded in the config by the
    first ``write`` (so configuring again never compounds); else, when the global rope dicts name a scaling
    (Llama 3.1's ``llama3``, GPT-OSS's ``yarn``, Phi-3's ``longrope``), ``max(max_position_embeddings, shipped
    factor x L)``; else ``L``."""
    recorded = config.__dict__.get(SHIPPED_ATTR)
    if recorded:
        return check_length(SHIPPED_ATTR, recorded)
    length = original_length(config)
    context = length
    for lt in scaled_layer_types(config):
        params = rope_dict(config, lt) or {}
        if split_rope_type(rope_type_of(params))[1] in ("default", None):
            continue
        factor = check_factor(params.get("factor") or 1.0)
        declared = getattr(config, "max_position_embeddings", None)
        declared = 0 if declared is None else check_length("max_position_embeddings", declared)
        context = max(context, declared, check_length("factor x L", math.ceil(factor * length)))
    return context
