"""Reading and writing a transformers config's rotary settings.

- Reading: rotary geometry (head dim, base, partial rotary factor), the original length ``L``, the
  scaling a config already names, flat or per-layer-type (Gemma 3) ``rope_parameters``.
- Writing: ``configure`` puts a scaling into ``config.rope_parameters`` and raises
  ``max_position_embeddings``; ``snapshot``/``restore`` undo that exactly.

Layer types: a per-layer-type ``rope_parameters`` (Gemma 3, Gemma 4) scales its global types only, and reads
each type's geometry from the layer type's own config (Gemma 4's full layers have their own head dim,
``config.per_layer_config[layer_type]``). Proportional RoPE (Gemma 4's ``proportional``, "p-RoPE") rotates
only the first ``int(partial_rotary_factor * head_dim // 2)`` of the ``head_dim / 2`` plain-RoPE frequencies
and keeps the rest at zero: a method scales the rotating ones (computed for ``d = head_dim``, as
transformers lays them out) and the zeros stay; ``configure`` writes such a layer as
``proportional_<rope type>`` (a type rope-extend registers), since transformers' own types would read
``partial_rotary_factor`` as an ordinary partial rotary dimension.

Rewriting a rope dict keeps every key that is not a scaling parameter of the old rope type (Ministral 3's
``llama_4_scaling_beta``, M-RoPE's ``mrope_section``); the old type's own keys are taken from transformers'
validator for that type (``rope_type_keys``), or from the rope-extend method.

A scaling the model ships with (Llama 3.1's ``llama3``, GPT-OSS's ``yarn``, Phi-3's ``longrope``) is replaced, the
factor counting from the context it gives (``shipped_context``), or, with ``keep_shipped=True`` under an attention
method, kept (``kept_scaling``): the method's rope dict then records it under ``shipped`` and its own ``factor``
and ``original_max_position_embeddings`` count from that context.

Where ``L`` lives: transformers keeps it in ``rope_parameters["original_max_position_embeddings"]`` for
yarn/llama3/longrope, and Phi-3 also as a top-level config attribute. ``configure`` writes the top-level
attribute for every method (transformers keeps unknown config attributes through save and reload), so a
second ``configure`` on the same config reads the same ``L`` and never compounds.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import logging
import math
from types import SimpleNamespace
from typing import Any

import torch

from ..errors import RopeExtendError, UnsupportedModelError
from ..methods import registry
from ..methods._scaling import check_keep_shipped

logger = logging.getLogger("rope_extend")

# Keys of rope_parameters that are not method parameters.
BASE_KEYS = ("rope_type", "rope_theta", "partial_rotary_factor")
SCALING_KEYS = ("factor", "original_max_position_embeddings")
# Keys rope-extend writes into any rope type's parameters, transformers' own types included (scaled_rope_dict):
# logn, and L into linear where the old dict had it (a family may read it, as Ministral 3's llama-4 attention
# scale does).
EXTRA_KEYS = frozenset({"logn", "original_max_position_embeddings"})
# Families whose rotary module takes its attention scale from rope_parameters keys instead of the rope init
# function (PhiMoE: ``short_mscale`` up to L, ``long_mscale`` beyond, and it needs both for any scaled type):
# rope-extend writes the method's attention scale into each, so only a constant scale is possible.
SCALE_KEYS = {"phimoe": ("short_mscale", "long_mscale")}
# Rotary layouts a rope type can name besides the ordinary one (see the module docstring).
PROPORTIONAL = "proportional"
# Attention layer types that keep their own rotary (local windows); every other type is scaled.
LOCAL_LAYER_TYPES = ("sliding_attention", "chunked_attention", "local_attention", "hybrid_sliding", "window_attention")
_MISSING = object()


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


# ----------------------------------------------------------------------------------------------- reading
def own_temperature(holder) -> str | None:
    """Why log-n would compound on a model (a config or an attention module) that scales its NoPE layers'
    queries itself, or None. Llama 4's ``attn_temperature_tuning`` multiplies the query at position ``p`` by
    ``1 + attn_scale ln(1 + floor((p + 1) / floor_scale))`` (the config's values, copied onto each attention
    module); log-n would multiply it once more, so it is refused rather than stacked or silently swapped."""
    if not getattr(holder, "attn_temperature_tuning", False):
        return None
    scale, floor = getattr(holder, "attn_scale", None), getattr(holder, "floor_scale", None)
    return (
        f"its NoPE layers already scale their queries by Llama 4's temperature (attn_temperature_tuning: "
        f"1 + {scale} ln(1 + floor((p + 1) / {floor}))), and log-n would compound with it; load the model with "
        "attn_temperature_tuning=False to have log-n instead, or leave logn out to keep it"
    )


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
    config = layer_config(config, layer_type)
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


def split_rope_type(rope_type: Any) -> tuple[str | None, Any]:
    """``(layout, rope type)``: ``("proportional", "yarn")`` for ``proportional_yarn``, ``("proportional",
    "default")`` for transformers' ``proportional``, ``(None, rope_type)`` for every other type."""
    if rope_type == PROPORTIONAL:
        return PROPORTIONAL, "default"
    if isinstance(rope_type, str) and rope_type.startswith(PROPORTIONAL + "_"):
        return PROPORTIONAL, rope_type[len(PROPORTIONAL) + 1 :]
    return None, rope_type


def layout_rope_type(layout: str | None, rope_type: str) -> str:
    """The rope type a config names for ``rope_type`` on a layer with ``layout`` (inverse of split_rope_type)."""
    return rope_type if layout is None else f"{layout}_{rope_type}"


def rope_type_of(params: dict[str, Any]) -> str:
    return params.get("rope_type", params.get("type", "default"))


def rotary_geometry(config, layer_type: str | None = None) -> tuple[int, float]:
    """``(rotary_dim, base)`` of one rope dict: ``int(head_dim * partial_rotary_factor)`` and ``rope_theta``;
    for proportional RoPE ``head_dim`` itself (see ``rotating``)."""
    params = rope_dict(config, layer_type)
    prf = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    base = params.get("rope_theta", getattr(config, "rope_theta", None) or getattr(config, "default_theta", None))
    if isinstance(base, dict):  # Gemma 3 keeps {"global": ..., "local": ...} as its default_theta
        base = base.get("global")
    if base is None:
        raise UnsupportedModelError(f"{type(config).__name__}.rope_parameters has no rope_theta")
    if split_rope_type(rope_type_of(params))[0] == PROPORTIONAL:
        return registry.rotary_dim(head_dim(config, layer_type)), float(base)
    return registry.rotary_dim(head_dim(config, layer_type), prf), float(base)


def rotating(config, layer_type: str | None = None) -> int | None:
    """How many of the ``rotary_dim / 2`` frequencies rotate: None for all; for proportional RoPE
    ``int(partial_rotary_factor * head_dim // 2)``, as transformers' ``proportional`` init computes it."""
    params = rope_dict(config, layer_type)
    if split_rope_type(rope_type_of(params))[0] != PROPORTIONAL:
        return None
    return int(params.get("partial_rotary_factor", 1.0) * head_dim(config, layer_type) // 2)


def frequencies(scaling: registry.Scaling, dim: int, base: float, rotating: int | None, seq_len: int | None = None):
    """``scaling.compute(dim, base, seq_len)`` with the frequencies past ``rotating`` at zero (proportional
    RoPE: those dimensions never rotate, whatever the method)."""
    freqs, scale = scaling.compute(dim, base, seq_len)
    if rotating is not None and rotating < freqs.numel():
        freqs = torch.cat([freqs[:rotating], torch.zeros(freqs.numel() - rotating, dtype=freqs.dtype)])
    return freqs, scale


def original_length(config) -> int:
    """The pretraining length ``L``: the top-level or rope-dict ``original_max_position_embeddings``,
    else ``max_position_embeddings``."""
    value = config.__dict__.get("original_max_position_embeddings")
    if value is None:
        for lt in nested_layer_types(config) or [None]:
            params = config.rope_parameters if lt is None else config.rope_parameters.get(lt)
            if params and params.get("original_max_position_embeddings"):
                value = params["original_max_position_embeddings"]
                break
    if value is None:
        value = getattr(config, "max_position_embeddings", None)
        shipped = _linear_within_context(config)
        if value is not None and shipped:
            return max(1, round(value / shipped))
    if value is None:
        raise UnsupportedModelError(
            f"cannot tell the pretraining length of {type(config).__name__}: it has neither "
            "original_max_position_embeddings nor max_position_embeddings; pass original_max_position_embeddings="
        )
    return int(value)


# Families whose config ships a ``linear`` factor on the global layers with ``max_position_embeddings`` already the
# extended context (Gemma 3: pretrained at 32k, linear x8 on the global layers, 131072 in the config). A plain
# ``linear`` dict says nothing of which length it extends (Vicuna-16k ships linear x4 with 4096, the length before
# it), so the rule is the family's.
_LINEAR_WITHIN_CONTEXT = ("gemma3_text",)


def _linear_within_context(config) -> float | None:
    """The shipped ``linear`` factor of a family in ``_LINEAR_WITHIN_CONTEXT`` (its ``L`` is
    ``max_position_embeddings / factor``), else None."""
    if getattr(config, "model_type", None) not in _LINEAR_WITHIN_CONTEXT:
        return None
    for lt in nested_layer_types(config) or [None]:
        params = config.rope_parameters if lt is None else config.rope_parameters.get(lt)
        if params and split_rope_type(rope_type_of(params))[1] == "linear" and (params.get("factor") or 1) > 1:
            return float(params["factor"])
    return None


def scaling_from_dict(params: dict[str, Any], default_length: int, ignore_keys=()) -> registry.Scaling | None:
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
    scaling = registry.resolve(method, factor=params["factor"], original_max_position_embeddings=length, params=fields)
    if params.get(SHIPPED_KEY) is None:
        return scaling
    return dataclasses.replace(scaling, shipped=_kept_from_dict(params[SHIPPED_KEY], method, ignore_keys))


def _kept_from_dict(kept: Any, method: registry.Method, ignore_keys) -> registry.Scaling:
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
    return scaling_from_dict(kept, kept["original_max_position_embeddings"], ignore_keys)


def config_scaling(config, layer_type: str | None = None) -> registry.Scaling | None:
    """The scaling ``config`` names; the family's own rope keys (``ignore_keys_at_rope_validation``: Ministral 3's
    ``llama_4_scaling_beta``, M-RoPE's ``mrope_section``) are not method parameters."""
    return scaling_from_dict(rope_dict(config, layer_type), original_length(config), ignore_keys=family_keys(config))


def family_keys(config, ignore_keys=None) -> set[str]:
    """Rope keys of the family, not of a method: ``ignore_keys_at_rope_validation``, ``SCALE_KEYS`` and the keys
    of transformers' ``RopeParameters`` that no rope type's validator claims (``mrope_section``)."""
    keys = set(ignore_keys or getattr(config, "ignore_keys_at_rope_validation", None) or ())
    return keys | set(SCALE_KEYS.get(family(config), ())) | _layout_keys()


@functools.cache
def _layout_keys() -> frozenset[str]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters

    claimed = set(BASE_KEYS)
    for rope_type in ROPE_INIT_FUNCTIONS:
        claimed |= transformers_rope_type_keys(rope_type) or set()
    # M-RoPE's keys, which transformers 5.17's RopeParameters does not declare yet
    return frozenset((set(RopeParameters.__annotations__) | {"mrope_section", "mrope_interleaved"}) - claimed)


# ----------------------------------------------------------------------------------------------- writing
class _Keys(Exception):
    pass


def _capture_keys(rope_type, received_keys, required_keys, optional_keys=None, ignore_keys=None):
    raise _Keys(set(required_keys) | set(optional_keys or ()))


@functools.cache
def transformers_rope_type_keys(rope_type: str) -> frozenset[str] | None:
    """The keys transformers' validator for ``rope_type`` knows (required and optional), or None when
    transformers has no validator for it. Read by running the validator against a stand-in whose key check
    reports the keys and stops."""
    from transformers.modeling_rope_utils import RotaryEmbeddingConfigMixin

    validator = getattr(RotaryEmbeddingConfigMixin, f"_validate_{rope_type}_rope_parameters", None)
    if validator is None:
        return None
    try:
        validator(SimpleNamespace(_check_received_keys=_capture_keys), {"rope_type": rope_type})
    except _Keys as keys:
        return frozenset(keys.args[0])
    except Exception:  # noqa: BLE001 - one of rope-extend's own validators, which checks no key list
        return None
    return None


def rope_type_keys(rope_type: Any) -> frozenset[str]:
    """The scaling parameters of ``rope_type``: the keys a rewrite drops (every other key is kept).

    A rope-extend type's are its method's parameters with ``factor``, ``L`` and ``logn``; a transformers type's
    are what transformers' validator for it knows; a type neither knows (a family's own) drops only
    ``factor`` and ``L``. ``rope_theta`` and ``partial_rotary_factor`` are never dropped."""
    layout, base = split_rope_type(rope_type)
    method = registry.by_rope_type(base) if isinstance(base, str) else None
    if method is not None and (layout is not None or not method.in_transformers):
        keys = {f.name for f in dataclasses.fields(method.params)} | set(SCALING_KEYS)
    else:
        keys = set(transformers_rope_type_keys(layout or base) or ()) | set(SCALING_KEYS)
    return frozenset((keys | EXTRA_KEYS | {"type", SHIPPED_KEY}) - set(BASE_KEYS))


def scaled_rope_dict(old: dict[str, Any], scaling: registry.Scaling) -> dict[str, Any]:
    """A new rope dict for ``scaling``: the old one's base, partial rotary factor, rotary layout and every
    key that is not a scaling parameter of its rope type (``rope_type_keys``)."""
    old_type = rope_type_of(old)
    layout = split_rope_type(old_type)[0]
    drop = rope_type_keys(old_type)
    out = {"rope_type": layout_rope_type(layout, scaling.method.rope_type)}
    out.update((key, value) for key, value in old.items() if key not in drop and key != "rope_type")
    out["factor"] = scaling.factor
    # transformers' linear takes no L (plain transformers warns on one); kept where the old dict had it, since a
    # family may read it there (Ministral 3's llama-4 attention scale)
    if scaling.method.rope_type != "linear" or "original_max_position_embeddings" in old:
        out["original_max_position_embeddings"] = scaling.original_max_position_embeddings
    out.update(scaling.method.param_dict(scaling.params))
    if scaling.logn:
        out["logn"] = True
    if scaling.shipped is not None:  # keep_shipped: the kept scaling in full, with its own factor and L
        kept = scaling.shipped
        out[SHIPPED_KEY] = {
            "rope_type": kept.method.rope_type,
            "factor": kept.factor,
            "original_max_position_embeddings": kept.original_max_position_embeddings,
            **kept.method.param_dict(kept.params),
        }
    return out


SHIPPED_ATTR = "rope_extend_shipped_context"
# In an attention method's rope dict written with keep_shipped: the shipped scaling it keeps (scaled_rope_dict).
SHIPPED_KEY = "shipped"


def shipped_context(config) -> int:
    """The context ``C`` the model ships with, which a ``factor`` counts from: recorded in the config by the
    first ``write`` (so configuring again never compounds); else, when the global rope dicts name a scaling
    (Llama 3.1's ``llama3``, GPT-OSS's ``yarn``, Phi-3's ``longrope``), ``max(max_position_embeddings, shipped
    factor x L)``; else ``L``."""
    recorded = config.__dict__.get(SHIPPED_ATTR)
    if recorded:
        return int(recorded)
    length = original_length(config)
    context = length
    for lt in scaled_layer_types(config):
        params = rope_dict(config, lt) or {}
        if split_rope_type(rope_type_of(params))[1] in ("default", None):
            continue
        factor = params.get("factor") or 1.0
        context = max(context, int(getattr(config, "max_position_embeddings", None) or 0), math.ceil(factor * length))
    return context


def keepable() -> list[str]:
    """The shipped rope types ``keep_shipped`` keeps: transformers' own types that rope-extend computes with the
    same numbers (``linear``, ``yarn``, ``llama3``, ``longrope``)."""
    return [m.rope_type for m in map(registry.get, registry.names()) if m.in_transformers]


def kept_scaling(config) -> registry.Scaling | None:
    """The scaling the model ships with, as ``keep_shipped`` keeps it under an attention method; None when its
    global layers ship plain RoPE (``keep_shipped`` then changes nothing, as the authors' STRING code runs plain
    RoPE on a model without ``rope_scaling``).

    Read from the global rope dicts (one of ``keepable()``), or from the record of a config written with
    ``keep_shipped`` (``SHIPPED_KEY``). The factor is made explicit by transformers' own rule for a dict
    without one (``max_position_embeddings / L``: Phi-3's longrope), so raising ``max_position_embeddings``
    to the method's target does not change it. Refused, each with the reason: a rope type rope-extend does
    not compute as transformers does; a config in which a rope-extend write replaced the shipped scaling
    without recording it; a different scaling per layer type; a family whose own code reads the scaling's
    keys from ``rope_parameters`` (``_kept_reads``)."""
    found = []
    for lt in scaled_layer_types(config):
        params = rope_dict(config, lt)
        kept = _kept_one(config, params)
        if kept is not None:
            why = _kept_reads(config, {**params, **(params.get(SHIPPED_KEY) or {})})
            if why:
                raise UnsupportedModelError(
                    f"keep_shipped keeps the shipped {kept.method.rope_type} scaling, but {why}"
                )
        found.append(kept)
    if any(kept != found[0] for kept in found[1:]):
        raise UnsupportedModelError(
            "keep_shipped: the global layer types ship different scalings "
            f"({', '.join(str(k.describe() if k else 'plain RoPE') for k in found)}); rope-extend keeps one"
        )
    return found[0] if found else None


def _kept_one(config, params: dict[str, Any]) -> registry.Scaling | None:
    if params.get(SHIPPED_KEY) is not None:  # a config written with keep_shipped, reloaded
        return scaling_from_dict(params, original_length(config), ignore_keys=family_keys(config)).shipped
    rope_type = split_rope_type(rope_type_of(params))[1]
    if rope_type in ("default", None):
        return None
    recorded = config.__dict__.get(SHIPPED_ATTR)
    if recorded:  # rope-extend wrote this rope dict: it names rope-extend's scaling, not the shipped one
        if int(recorded) == original_length(config):
            return None  # the model shipped plain RoPE (its shipped context is L)
        raise UnsupportedModelError(
            f"keep_shipped: this config was written by rope-extend ({rope_type}, replacing the scaling the model "
            "shipped with), so the shipped scaling is not in it; load the model's own config"
        )
    method = registry.by_rope_type(rope_type)
    if method is None or not method.in_transformers:
        raise UnsupportedModelError(
            f"keep_shipped: the model ships rope_type {rope_type!r}, which rope-extend does not compute as "
            f"transformers does (it keeps {', '.join(keepable())}); leave keep_shipped out to replace it"
        )
    length = int(params.get("original_max_position_embeddings") or original_length(config))
    factor = params.get("factor") or config.max_position_embeddings / length  # transformers' rule without one
    kept = {**params, "factor": factor, "original_max_position_embeddings": length}
    return scaling_from_dict(kept, length, ignore_keys=family_keys(config))


def _kept_reads(config, params: dict[str, Any]) -> str | None:
    """Why a family's own code would not keep the shipped scaling once its keys are rewritten, or None: code that
    reads the scaling's keys from ``rope_parameters`` besides the rope init function."""
    if family(config) in SCALE_KEYS:
        return (
            f"{type(config).__name__}'s rotary reads its attention scale from rope_parameters "
            f"({' and '.join(SCALE_KEYS[family(config)])}) on each side of L at every forward"
        )
    if params.get("mscale_all_dim") and _builds_softmax_scale(config):
        return (
            f"{type(config).__name__}'s attention (MLA) builds its softmax scale from rope_parameters' factor and "
            "mscale_all_dim, and the method's own factor takes that key"
        )
    if params.get("llama_4_scaling_beta") is not None:
        return (
            "the family's attention scales its queries by llama_4_scaling_beta over rope_parameters' "
            "original_max_position_embeddings, which keep_shipped sets to the shipped context"
        )
    return None


def _builds_softmax_scale(config) -> bool:
    """Whether the family's modeling code scales its softmax by the rope dict when it builds its attention
    (transformers' ``yarn_apply_mscale``: DeepSeek V2/V3, Kimi, GLM-4 MoE Lite, MiniCPM3, Mistral 4, ...)."""
    name = type(config).__module__.replace(".configuration_", ".modeling_")
    try:
        return hasattr(importlib.import_module(name), "yarn_apply_mscale")
    except ImportError:
        return False


def snapshot(config) -> dict[str, Any]:
    """What ``write`` changes, to put back with ``restore``."""
    return {
        "rope_parameters": copy.deepcopy(config.rope_parameters),
        "max_position_embeddings": config.max_position_embeddings,
        "original_max_position_embeddings": config.__dict__.get("original_max_position_embeddings", _MISSING),
        "head_dim": config.__dict__.get("head_dim", _MISSING),
        SHIPPED_ATTR: config.__dict__.get(SHIPPED_ATTR, _MISSING),
    }


def restore(config, snap: dict[str, Any]) -> None:
    config.rope_parameters = copy.deepcopy(snap["rope_parameters"])
    config.max_position_embeddings = snap["max_position_embeddings"]
    if snap["original_max_position_embeddings"] is _MISSING:
        config.__dict__.pop("original_max_position_embeddings", None)
    else:
        config.original_max_position_embeddings = snap["original_max_position_embeddings"]
    if snap.get("head_dim", _MISSING) is not _MISSING:
        config.__dict__["head_dim"] = snap["head_dim"]
    if snap.get(SHIPPED_ATTR, _MISSING) is _MISSING:
        config.__dict__.pop(SHIPPED_ATTR, None)
    else:
        config.__dict__[SHIPPED_ATTR] = snap[SHIPPED_ATTR]


def plan(
    config, method: str, *, factor=None, target_length=None, original_max_position_embeddings=None, **params
) -> registry.Scaling:
    """Validate a configure/patch request against ``config`` and return the scaling; touches nothing.

    ``keep_shipped=True`` (attention methods): the scaling the model ships with (``kept_scaling``) stays, and the
    method counts from the shipped context ``C`` (``Scaling.shipped``); nothing to keep is a no-op."""
    m = registry.get(method)
    kept = kept_scaling(config) if check_keep_shipped(m, params.pop("keep_shipped", False)) else None
    if getattr(config, "max_position_embeddings", None) is None:
        window = getattr(config, "sliding_window", None)
        raise UnsupportedModelError(
            f"{type(config).__name__} has no max_position_embeddings: no context length to extend"
            + (f" (its attention is local, a {window}-token window)" if window else "")
        )
    length = original_length(config) if original_max_position_embeddings is None else original_max_position_embeddings
    if kept is not None and original_max_position_embeddings is None:
        length = shipped_context(config)  # the shipped frequencies stay: the method counts from C, as STRING's authors
    shipped = shipped_context(config) if original_max_position_embeddings is None else length
    if shipped > length and factor is not None and target_length is None:
        # the factor counts from the context the model ships with, never from its pretraining length alone
        factor, target_length = None, math.ceil(registry.check_factor(factor) * shipped)
    scaling = registry.resolve(
        m, factor=factor, target_length=target_length, original_max_position_embeddings=length, params=params
    )
    if kept is not None:
        scaling = dataclasses.replace(scaling, shipped=kept)
    if scaling.logn and own_temperature(config):
        raise UnsupportedModelError(own_temperature(config))
    if scaling.target_length < shipped:
        if target_length is None:
            raise RopeExtendError(
                f"{m.name} reaches {scaling.target_length} tokens, less than the {shipped} the model ships with "
                f"(its own {_shipped_name(config)}); pass a factor (it counts from {shipped}) or raise the method's "
                f"reach, or target_length={scaling.target_length} to accept the shorter context"
            )
        logger.warning(
            "target_length=%d is shorter than the %d tokens the model ships with: the model loses context",
            scaling.target_length,
            shipped,
        )
    layer_types = scaled_layer_types(config)
    if not layer_types:
        kinds = ", ".join(
            f"{lt}: {'no RoPE' if config.rope_parameters[lt] is None else 'local, kept'}"
            for lt in nested_layer_types(config)
        )
        raise UnsupportedModelError(
            f"{type(config).__name__} has no global (full-attention) rotary frequencies to scale ({kinds}); "
            "rope-extend scales global layers only"
        )
    if family(config) in SCALE_KEYS and m.dynamic and m.in_transformers:
        raise UnsupportedModelError(
            f"{type(config).__name__}'s rotary module recomputes its frequencies without the sequence length at "
            f"every forward, so transformers' own {m.rope_type} would never switch to its long frequencies once "
            "saved and reloaded"
        )
    for lt in layer_types:
        dim, base = rotary_geometry(config, lt)
        _, scale = scaling.compute(dim, base)  # raises on a parameter that does not fit the geometry (longrope)
        if family(config) in SCALE_KEYS and scaling.compute(dim, base, 4 * scaling.target_length)[1] != scale:
            raise UnsupportedModelError(
                f"{type(config).__name__} reads one attention scale per side of L from rope_parameters "
                f"({' and '.join(SCALE_KEYS[family(config)])}), but {m.name}'s attention scale changes with the "
                "length"
            )
    _check_transformers_accepts(config, scaling)
    return scaling


def _check_transformers_accepts(config, scaling: registry.Scaling) -> None:
    """Refuse a scaling the config class's own validation rejects (Cosmos3 Edge allows only ``default``): the
    patched model could not be saved, nor a configured config loaded. A config that fails already is let be."""
    validate = getattr(config, "validate", None)
    if not callable(validate):
        return
    probe = copy.deepcopy(config)
    try:
        validate()
    except Exception:  # noqa: BLE001 - the unscaled config is the family's own business
        return
    write(probe, scaling)
    try:
        probe.validate()
    except Exception as exc:
        reason = str(getattr(exc, "__cause__", None) or exc).strip().splitlines()[-1]
        raise UnsupportedModelError(
            f"transformers' {type(config).__name__} rejects the scaled rope_parameters, so the model could not be "
            f"saved and reloaded: {reason}"
        ) from exc


def _shipped_name(config) -> str:
    names = {rope_type_of(rope_dict(config, lt) or {}) for lt in scaled_layer_types(config)}
    return " / ".join(sorted(str(n) for n in names)) + " scaling"


def write(config, scaling: registry.Scaling) -> None:
    """Put ``scaling`` into ``config`` (the global rope dicts) and set ``max_position_embeddings`` to the target."""
    shipped = shipped_context(config)
    params = copy.deepcopy(config.rope_parameters)
    for lt in scaled_layer_types(config):
        old = params if lt is None else params[lt]
        if old.get("rope_type", "default") != "default":
            how = "keeping the frequencies of" if scaling.shipped is not None else "replacing"
            logger.info("%s rope_type %r with %s", how, old.get("rope_type"), scaling.describe())
        new = scaled_rope_dict(old, scaling)
        if family(config) in SCALE_KEYS:  # it also reads L there, for linear too
            new["original_max_position_embeddings"] = scaling.original_max_position_embeddings
            for key in SCALE_KEYS[family(config)]:
                new[key] = scaling.compute(*rotary_geometry(config, lt))[1]
        if lt is None:
            params = new
        else:
            params[lt] = new
    if config.__dict__.get("head_dim", _MISSING) is None and not own_rope_type(scaling.method.rope_type):
        # transformers' yarn and longrope read getattr(config, "head_dim", default), which is None here (Mixtral)
        config.head_dim = head_dim(config)
    config.original_max_position_embeddings = scaling.pretraining_length
    config.max_position_embeddings = scaling.target_length
    config.rope_parameters = params
    setattr(config, SHIPPED_ATTR, shipped)  # what a later configure counts from (never this write's target)


def configure(config, method: str, *, factor=None, target_length=None, original_max_position_embeddings=None, **params):
    """Write ``method`` into ``config.rope_parameters`` and raise ``max_position_embeddings`` to the target.

    ``factor`` counts from the context the model ships with (``shipped_context``: ``L``, or the context a
    shipped scaling gives); ``target_length`` is the alternative
    (``factor = target_length / L``). Configuring again replaces the scaling and never compounds. Then
    ``AutoModelForCausalLM.from_pretrained(name, config=config)`` builds the scaled model. A shipped scaling is
    replaced, or kept under an attention method with ``keep_shipped=True`` (as ``rope_extend.patch`` says).
    """
    cfg = text_config(config)
    with naming(config, method):
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
    m = registry.get(method)
    scaling = registry.resolve(
        m,
        factor=factor,
        target_length=target_length,
        original_max_position_embeddings=original_max_position_embeddings,
        params=params,
    )
    return scaled_rope_dict({"rope_theta": float(rope_theta)}, scaling)


def own_rope_type(rope_type: Any) -> bool:
    """Whether ``rope_type`` is one rope-extend registers (not one of transformers' own)."""
    layout, rope_type = split_rope_type(rope_type)
    method = registry.by_rope_type(rope_type) if isinstance(rope_type, str) else None
    return method is not None and (layout is not None or not method.in_transformers)
