"""Writing a transformers config's rotary settings, and the names callers read a config by.

- ``configure`` puts a scaling into ``config.rope_parameters`` and raises ``max_position_embeddings``
  (``edit`` validates the request and computes the edit once, ``ConfigEdit.apply`` writes it);
  ``snapshot``/``restore`` undo that exactly.
- Reading a config is ``hf.reading`` (geometry, ``L``, the shipped context, the scaling a config names) and the
  rope dict's vocabulary is ``hf.rope_types``: callers import those names from there. Each family's quirks are
  rules in ``hf.families``, asked by what they are about (``families.ask``).

A scaling the model ships with (Llama 3.1's ``llama3``, GPT-OSS's ``yarn``, Phi-3's ``longrope``) is replaced, the
factor counting from the context it gives (``shipped_context``), or, with ``keep_shipped=True`` under an attention
method, kept (``kept_scaling``): the method's rope dict then records it under ``shipped`` and its own ``factor``
and ``original_max_position_embeddings`` count from that context.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import RopeExtendError, UnsupportedModelError
from ..methods import registry
from ..methods._common import check_factor
from ..methods.resolved import Scaling, check_keep_shipped, resolve
from . import families
from .names import SHIPPED_ATTR
from .reading import (
    family_keys,
    frequencies,
    head_dim,
    naming,
    nested_layer_types,
    original_length,
    rope_dict,
    rotary_geometry,
    rotating,
    scaled_layer_types,
    scaling_from_dict,
    shipped_context,
    text_config,
)
from .rope_types import (
    SHIPPED_KEY,
    keepable,
    own_rope_type,
    rope_type_of,
    scaled_rope_dict,
    split_rope_type,
)

logger = logging.getLogger("rope_extend")

_MISSING = object()


def kept_scaling(config) -> Scaling | None:
    """The scaling the model ships with, as ``keep_shipped`` keeps it under an attention method; None when its
    global layers ship plain RoPE (``keep_shipped`` then changes nothing, as the authors' STRING code runs plain
    RoPE on a model without ``rope_scaling``).

    Read from the global rope dicts (one of ``keepable()``), or from the record of a config written with
    ``keep_shipped`` (``SHIPPED_KEY``). The factor is made explicit by transformers' own rule for a dict
    without one (``max_position_embeddings / L``: Phi-3's longrope), so raising ``max_position_embeddings``
    to the method's target does not change it. Refused, each with the reason: a rope type rope-extend does
    not compute as transformers does; a config in which a rope-extend write replaced the shipped scaling
    without recording it; a different scaling per layer type; a family whose own code reads the scaling's
    keys from ``rope_parameters`` (``families``' ``kept_reads``)."""
    found = []
    for lt in scaled_layer_types(config):
        params = rope_dict(config, lt)
        kept = _kept_one(config, params)
        if kept is not None:
            why = families.ask("kept_reads", config, {**params, **(params.get(SHIPPED_KEY) or {})})
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


def _kept_one(config, params: dict[str, Any]) -> Scaling | None:
    if params.get(SHIPPED_KEY) is not None:  # a config written with keep_shipped, reloaded
        written = scaling_from_dict(params, original_length(config), ignore_keys=family_keys(config))
        if written is None:  # not one keep_shipped wrote: the record sits beside a type rope-extend lacks
            raise RopeExtendError(
                f"rope_parameters.{SHIPPED_KEY} (a shipped scaling kept by keep_shipped) goes with an attention "
                f"method, not rope_type {rope_type_of(params)!r}"
            )
        return written.shipped
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


def snapshot(config) -> dict[str, Any]:
    """What ``ConfigEdit.apply`` changes, to put back with ``restore``."""
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


@dataclass(frozen=True)
class ConfigEdit:
    """A scaling's write into one config, computed once (``edit``): the values written (``values``: attribute ->
    value), the frequencies and attention scale of each scaled layer type at ``L`` (``frequencies``, from the same
    computation that checked the parameters against the geometry), and ``scaled``, a copy of the config with the
    values written, which transformers' own validation of the config class accepted. ``apply`` writes the values
    into a config; ``snapshot``/``restore`` undo that."""

    scaling: Scaling
    values: dict[str, Any]
    frequencies: dict[str | None, tuple[torch.Tensor, float]]
    scaled: Any

    def apply(self, config) -> None:
        """Write the edit into ``config`` (the config it was computed from, or one equal to it)."""
        for key, value in self.values.items():
            setattr(config, key, copy.deepcopy(value) if key == "rope_parameters" else value)


def scaling_for(
    config, method: str, *, factor=None, target_length=None, original_max_position_embeddings=None, **params
) -> Scaling:
    """Validate a configure/patch request against ``config`` and return the scaling; touches nothing
    (``edit(...).scaling``)."""
    return edit(
        config,
        method,
        factor=factor,
        target_length=target_length,
        original_max_position_embeddings=original_max_position_embeddings,
        **params,
    ).scaling


def edit(
    config, method: str, *, factor=None, target_length=None, original_max_position_embeddings=None, **params
) -> ConfigEdit:
    """Validate a configure/patch request against ``config`` and compute its edit; touches nothing.

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
        factor, target_length = None, math.ceil(check_factor(factor) * shipped)
    scaling = resolve(
        m, factor=factor, target_length=target_length, original_max_position_embeddings=length, params=params
    )
    if kept is not None:
        scaling = dataclasses.replace(scaling, shipped=kept)
    if scaling.logn and families.ask("own_temperature", config):
        raise UnsupportedModelError(families.ask("own_temperature", config))
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
    scale_keys = families.ask("scale_keys", config)  # PhiMoE: one attention scale per side of L, from the dict
    if scale_keys and m.dynamic and m.in_transformers:
        raise UnsupportedModelError(
            f"{type(config).__name__}'s rotary module recomputes its frequencies without the sequence length at "
            f"every forward, so transformers' own {m.rope_type} would never switch to its long frequencies once "
            "saved and reloaded"
        )
    computed = {}
    for lt in layer_types:
        dim, base = rotary_geometry(config, lt)
        with torch.device("cpu"):  # not on meta inside from_pretrained's meta-device context
            # raises on a parameter that does not fit the geometry (longrope); the runtime starts from these
            computed[lt] = frequencies(scaling, dim, base, rotating(config, lt))
        scale = computed[lt][1]
        if scale_keys and scaling.compute(dim, base, 4 * scaling.target_length)[1] != scale:
            raise UnsupportedModelError(
                f"{type(config).__name__} reads one attention scale per side of L from rope_parameters "
                f"({' and '.join(scale_keys)}), but {m.name}'s attention scale changes with the "
                "length"
            )
    values = _values(config, scaling, computed)
    scaled = copy.deepcopy(config)  # the one copy: transformers checks it here, and ``patch`` rebuilds from it
    done = ConfigEdit(scaling, values, computed, scaled)
    done.apply(scaled)
    _check_transformers_accepts(config, scaled)
    return done


def _check_transformers_accepts(config, scaled) -> None:
    """Refuse a scaling the config class's own validation rejects (Cosmos3 Edge allows only ``default``): the
    patched model could not be saved, nor a configured config loaded. A config that fails already is let be."""
    validate = getattr(config, "validate", None)
    if not callable(validate):
        return
    try:
        validate()
    except Exception:  # noqa: BLE001 - the unscaled config is the family's own business
        return
    try:
        scaled.validate()
    except Exception as exc:
        reason = str(getattr(exc, "__cause__", None) or exc).strip().splitlines()[-1]
        raise UnsupportedModelError(
            f"transformers' {type(config).__name__} rejects the scaled rope_parameters, so the model could not be "
            f"saved and reloaded: {reason}"
        ) from exc


def _shipped_name(config) -> str:
    names = {rope_type_of(rope_dict(config, lt) or {}) for lt in scaled_layer_types(config)}
    return " / ".join(sorted(str(n) for n in names)) + " scaling"


def _values(config, scaling: Scaling, computed: dict) -> dict[str, Any]:
    """What writing ``scaling`` into ``config`` sets: the global rope dicts, ``max_position_embeddings`` at the
    target, ``L``, and the context a later configure counts from; ``computed`` holds each layer type's frequencies
    and attention scale."""
    shipped = shipped_context(config)
    params = copy.deepcopy(config.rope_parameters)
    scale_keys = families.ask("scale_keys", config)
    for lt in scaled_layer_types(config):
        old = params if lt is None else params[lt]
        if old.get("rope_type", "default") != "default":
            how = "keeping the frequencies of" if scaling.shipped is not None else "replacing"
            logger.info("%s rope_type %r with %s", how, old.get("rope_type"), scaling.describe())
        new = scaled_rope_dict(old, scaling)
        if scale_keys:  # it also reads L there, for linear too
            new["original_max_position_embeddings"] = scaling.original_max_position_embeddings
            for key in scale_keys:
                new[key] = computed[lt][1]
        if lt is None:
            params = new
        else:
            params[lt] = new
    values: dict[str, Any] = {}
    if config.__dict__.get("head_dim", _MISSING) is None and not own_rope_type(scaling.method.rope_type):
        # transformers' yarn and longrope read getattr(config, "head_dim", default), which is None here (Mixtral)
        values["head_dim"] = head_dim(config)
    values["original_max_position_embeddings"] = scaling.pretraining_length
    values["max_position_embeddings"] = scaling.target_length
    values["rope_parameters"] = params
    values[SHIPPED_ATTR] = shipped  # what a later configure counts from (never this write's target)
    return values


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
        planned = edit(
            cfg,
            method,
            factor=factor,
            target_length=target_length,
            original_max_position_embeddings=original_max_position_embeddings,
            **params,
        )
    planned.apply(cfg)
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
    scaling = resolve(
        m,
        factor=factor,
        target_length=target_length,
        original_max_position_embeddings=original_max_position_embeddings,
        params=params,
    )
    return scaled_rope_dict({"rope_theta": float(rope_theta)}, scaling)
