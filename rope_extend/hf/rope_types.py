"""Rope types and the keys of a rope dict: which type a dict names, on which rotary layout, and how a rewrite
keeps the keys that are not the old type's scaling parameters.

Proportional RoPE (Gemma 4's ``proportional``, "p-RoPE") rotates only the first ``int(partial_rotary_factor *
head_dim // 2)`` of the ``head_dim / 2`` plain-RoPE frequencies and keeps the rest at zero: a method scales the
rotating ones and the zeros stay (``hf.reading.rotating``). A config names such a layer's scaling
``proportional_<rope type>`` (a type rope-extend registers), since transformers' own types would read
``partial_rotary_factor`` as an ordinary partial rotary dimension.

Rewriting a rope dict (``scaled_rope_dict``) keeps every key that is not a scaling parameter of the old rope type
(Ministral 3's ``llama_4_scaling_beta``, M-RoPE's ``mrope_section``); the old type's own keys are taken from
transformers' validator for that type (``transformers_rope_type_keys``), or from the rope-extend method.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace
from typing import Any

from ..methods import registry
from ..methods.resolved import Scaling

# Keys of rope_parameters that are not method parameters.
BASE_KEYS = ("rope_type", "rope_theta", "partial_rotary_factor")
SCALING_KEYS = ("factor", "original_max_position_embeddings")
# Keys rope-extend writes into any rope type's parameters, transformers' own types included (scaled_rope_dict):
# logn, and L into linear where the old dict had it (a family may read it, as Ministral 3's llama-4 attention
# scale does).
EXTRA_KEYS = frozenset({"logn", "original_max_position_embeddings"})
# Rotary layouts a rope type can name besides the ordinary one (see the module docstring).
PROPORTIONAL = "proportional"
# In an attention method's rope dict written with keep_shipped: the shipped scaling it keeps (scaled_rope_dict).
SHIPPED_KEY = "shipped"


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


def own_rope_type(rope_type: Any) -> bool:
    """Whether ``rope_type`` is one rope-extend registers (not one of transformers' own)."""
    layout, rope_type = split_rope_type(rope_type)
    method = registry.by_rope_type(rope_type) if isinstance(rope_type, str) else None
    return method is not None and (layout is not None or not method.in_transformers)


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


def scaled_rope_dict(old: dict[str, Any], scaling: Scaling) -> dict[str, Any]:
    """A new rope dict for ``scaling``: the old one's base, partial rotary factor, rotary layout and every
    key that is not a scaling parameter of its rope type (``rope_type_keys``)."""
    old_type = rope_type_of(old)
    layout = split_rope_type(old_type)[0]
    drop = rope_type_keys(old_type)
    out: dict[str, Any] = {"rope_type": layout_rope_type(layout, scaling.method.rope_type)}
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


def keepable() -> list[str]:
    """The shipped rope types ``keep_shipped`` keeps: transformers' own types that rope-extend computes with the
    same numbers (``linear``, ``yarn``, ``llama3``, ``longrope``)."""
    return [m.rope_type for m in map(registry.get, registry.names()) if m.in_transformers]
