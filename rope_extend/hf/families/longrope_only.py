"""Phi-3 and Phi-4-multimodal: config classes that accept only ``default`` and ``longrope``; and the Phi-3
families' ``generate``, which swaps the cache for a new one at LongRoPE's switch (``generate_swaps_cache``).

Their ``validate_rope`` raises on any other type (at build and at save), and their loader renames a legacy
``yarn`` to ``longrope``. ``opened`` gives the class attributes under which such a class holds the types
rope-extend writes: its ``validate_rope`` runs transformers' general validation for those types (the family's
own checks are about longrope's factor lists), and a ``yarn`` dict without longrope's ``short_factor`` stays
``yarn`` (only Phi-3's legacy ``yarn``, a longrope in disguise, has one). Its own configs validate as before.
``hf.transformers_changes`` sets them (and puts the originals back).
"""

from __future__ import annotations

from typing import Any

from ...methods import registry
from ..rope_types import rope_type_of, split_rope_type
from .rule import Rule, constant


def _rope_extend_type(rope_type) -> bool:
    """Whether ``rope_type`` is one rope-extend writes (its own, or a transformers type it has a method for)."""
    return isinstance(rope_type, str) and registry.by_rope_type(split_rope_type(rope_type)[1]) is not None


def opened(cls) -> dict[str, Any]:
    """``{attribute: value}`` that lets the longrope-only config class ``cls`` hold rope-extend's types; {} when
    ``cls`` is open already."""
    from transformers.modeling_rope_utils import RotaryEmbeddingConfigMixin

    validate, convert = cls.validate_rope, cls.convert_rope_params_to_dict
    if hasattr(validate, "__wrapped__"):
        return {}

    def written(params) -> bool:
        rope_type = rope_type_of(params) if isinstance(params, dict) else None
        return (
            rope_type not in ("default", "longrope")
            and _rope_extend_type(rope_type)
            and (rope_type != "yarn" or "short_factor" not in params)
        )

    def validate_rope(self):
        if written(self.rope_parameters):
            return RotaryEmbeddingConfigMixin.validate_rope(self)
        return validate(self)

    def convert_rope_params_to_dict(self, *args, **kwargs):
        params = kwargs.get("rope_scaling") or self.rope_parameters
        keep = rope_type_of(params) if written(params) else None
        out = convert(self, *args, **kwargs)
        if keep is not None:
            self.rope_parameters["rope_type"] = keep
        return out

    validate_rope.__wrapped__ = validate  # type: ignore[attr-defined]
    convert_rope_params_to_dict.__wrapped__ = convert  # type: ignore[attr-defined]
    out: dict[str, Any] = {"validate_rope": validate_rope, "convert_rope_params_to_dict": convert_rope_params_to_dict}
    # huggingface_hub's @strict collected the class validators when the class was made
    validators = getattr(cls, "__class_validators__", None)
    if validators is not None:
        out["__class_validators__"] = [validate_rope if v is validate else v for v in validators]
    return out


PHI3_LONGROPE_ONLY = Rule("phi3_longrope_only", "longrope_only", constant(True), ("phi3", "phi4_multimodal"))


def _swaps_cache(config) -> str | None:
    """Their ``prepare_inputs_for_generation`` sets the cache to None when the input reaches
    ``original_max_position_embeddings + 1`` tokens while the cache holds no more, to recompute the prefix with
    LongRoPE's long factors, and ``generate`` goes on with a cache of its own: a cache with a policy of its own
    (``SinkCache``) would be replaced by a plain one, silently. With a prompt already that long, a passed cache
    that has its layers (``DynamicCache(config=...)``) is dropped before the first forward and stays empty
    (transformers 5.17 and 5.24, checked). On a patched model ``hf.generation.install_recompute`` makes that
    recompute cover the whole prefix (transformers 5.17, and 5.24's Phi-4-multimodal, feed the last token only)."""
    original = getattr(config, "original_max_position_embeddings", None)
    if original is None:
        return None
    return (
        f"replaces the cache by a new one once the sequence passes config.original_max_position_embeddings "
        f"({original}) tokens, to recompute it for LongRoPE"
    )


PHI3_GENERATE_SWAPS_CACHE = Rule(
    "phi3_generate_swaps_cache", "generate_swaps_cache", _swaps_cache, ("phi3", "phimoe", "phi4_multimodal")
)
