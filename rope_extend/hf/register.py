"""Registration with transformers: the top of ``hf``, run once after ``import rope_extend``
(when transformers loads its rope utilities: ``rope_extend.deferred``).

What it changes in transformers, and nothing else:

- ``modeling_rope_utils.ROPE_INIT_FUNCTIONS`` gains the rope types transformers lacks (``ntk``,
  ``dynamic_ntk``, ``ntk_by_parts``, ``dynamic_yarn``) and, for proportional RoPE (Gemma 4's full layers),
  ``proportional_<type>`` for every method (``hf.config``); an existing entry of the same name is never
  replaced (that raises);
- ``RotaryEmbeddingConfigMixin`` gains a validator per such type, which raises on a bad parameter
  (transformers' own validators only warn);
- ``PreTrainedModel.post_init`` is wrapped so that a model built from a config naming a rope-extend type
  gets rope-extend's rotary runtime (``attach_from_config`` below, with the cache keeper of ``hf.cache``), and one
  naming an attention method or ``logn`` gets rope-extend's attention (``hf.attention``); models without one
  are untouched;
- the config classes of ``LONGROPE_ONLY`` (Phi-3, Phi-4-multimodal), whose ``validate_rope`` rejects every type
  but ``default`` and ``longrope`` and whose loader renames ``yarn`` to ``longrope``, accept the types
  rope-extend writes (``_open_longrope_only``); their own configs validate as before;
- ``AttentionInterface`` and ``AttentionMaskInterface`` gain the name ``rope_extend`` (``hf.attention``);
- ``RotaryEmbeddingConfigMixin._check_received_keys`` ignores the keys rope-extend adds to transformers'
  own rope types (``logn``, see ``config.EXTRA_KEYS``), so that a config written by ``configure`` (``yarn`` with
  ``logn``) loads without transformers' "Unrecognized keys" warning; every other key is checked as before.
"""

from __future__ import annotations

from torch import nn

from ..errors import RopeExtendError, UnsupportedModelError
from ..methods import registry
from . import attach, attention, rotary
from .config import (
    EXTRA_KEYS,
    PROPORTIONAL,
    config_scaling,
    family_keys,
    frequencies,
    layout_rope_type,
    naming,
    original_length,
    own_rope_type,
    rope_type_of,
    rotary_geometry,
    rotating,
    scaling_from_dict,
    split_rope_type,
)


def _init_function(config, device=None, seq_len=None, layer_type=None, **_ignored):
    """A ``ROPE_INIT_FUNCTIONS`` entry for a rope-extend type: reads the config, calls the pure math."""
    scaling = config_scaling(config, layer_type)
    dim, base = rotary_geometry(config, layer_type)
    length = int(seq_len) if seq_len is not None else None
    freqs, scale = frequencies(scaling, dim, base, rotating(config, layer_type), length)
    return freqs.to(device) if device is not None else freqs, scale


def _validator(self, rope_parameters, ignore_keys=None):
    """Config validation for a rope-extend type: raises (transformers' own validators only warn)."""
    scaling_from_dict(rope_parameters, original_length(self), ignore_keys=family_keys(self, ignore_keys))


def _ignoring_extra_keys(check):
    """Wrap transformers' ``_check_received_keys`` so that ``EXTRA_KEYS`` count as known."""

    def _check_received_keys(rope_type, received_keys, required_keys, optional_keys=None, ignore_keys=None):
        extra = EXTRA_KEYS - set(required_keys)  # a key the type requires stays checked
        return check(rope_type, received_keys, required_keys, optional_keys, ignore_keys=set(ignore_keys or ()) | extra)

    _check_received_keys.__wrapped__ = check
    return staticmethod(_check_received_keys)


# Families whose config accepts only "default" and "longrope" (its validate_rope raises on any other type, at
# build and at save) and renames a legacy "yarn" to "longrope" on load: Phi-3 and Phi-4-multimodal.
LONGROPE_ONLY = ("phi3", "phi4_multimodal")


def _open_longrope_only(cls) -> None:
    """Let a longrope-only config class (``LONGROPE_ONLY``) hold the rope types rope-extend writes.

    Its ``validate_rope`` runs transformers' general validation for those types (the family-specific checks
    are about longrope's factor lists), and a ``yarn`` dict without longrope's ``short_factor`` stays ``yarn``
    (only Phi-3's legacy ``yarn``, a longrope in disguise, has one). Other configs are validated as before."""
    from transformers.modeling_rope_utils import RotaryEmbeddingConfigMixin

    validate, convert = cls.validate_rope, cls.convert_rope_params_to_dict
    if hasattr(validate, "__wrapped__"):
        return

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

    validate_rope.__wrapped__ = validate
    convert_rope_params_to_dict.__wrapped__ = convert
    cls.validate_rope = validate_rope
    cls.convert_rope_params_to_dict = convert_rope_params_to_dict
    # huggingface_hub's @strict collected the class validators when the class was made
    validators = getattr(cls, "__class_validators__", None)
    if validators is not None:
        cls.__class_validators__ = [validate_rope if v is validate else v for v in validators]


def _rope_extend_type(rope_type) -> bool:
    """Whether ``rope_type`` is one rope-extend writes (its own, or a transformers type it has a method for)."""
    return isinstance(rope_type, str) and registry.by_rope_type(split_rope_type(rope_type)[1]) is not None


_registered = False


def _install_rope_types(method) -> None:
    """Put ``method``'s rope types (its own, unless transformers has it, and its proportional variant) into
    ``ROPE_INIT_FUNCTIONS`` with a validator; a name transformers already uses for something else raises."""
    from transformers import modeling_rope_utils as mru

    types = [] if method.in_transformers else [method.rope_type]
    types.append(layout_rope_type(PROPORTIONAL, method.rope_type))
    for rope_type in types:
        existing = mru.ROPE_INIT_FUNCTIONS.get(rope_type)
        if existing is not None and existing is not _init_function:
            raise RopeExtendError(
                f"transformers already defines rope_type {rope_type!r}; rope-extend will not replace it"
            )
    for rope_type in types:
        mru.ROPE_INIT_FUNCTIONS[rope_type] = _init_function
        setattr(mru.RotaryEmbeddingConfigMixin, f"_validate_{rope_type}_rope_parameters", _validator)


def register() -> None:
    """Register rope-extend's own rope types with transformers. Idempotent; ``import rope_extend`` arranges it (``deferred``)."""
    global _registered
    if _registered:
        return
    from transformers import modeling_rope_utils as mru
    from transformers.modeling_utils import PreTrainedModel

    for method in map(registry.get, registry.names()):
        _install_rope_types(method)
    registry.on_register(_install_rope_types)  # a method registered later reaches transformers too

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type in LONGROPE_ONLY:
        if model_type in CONFIG_MAPPING:
            _open_longrope_only(CONFIG_MAPPING[model_type])

    mixin = mru.RotaryEmbeddingConfigMixin
    if not hasattr(mixin._check_received_keys, "__wrapped__"):
        mixin._check_received_keys = _ignoring_extra_keys(mixin._check_received_keys)

    original_post_init = PreTrainedModel.post_init

    def post_init(self, *args, **kwargs):
        out = original_post_init(self, *args, **kwargs)
        attach_from_config(self)
        return out

    attention.register()
    post_init.__wrapped__ = original_post_init
    PreTrainedModel.post_init = post_init
    _registered = True


def attach_from_config(model: nn.Module) -> None:
    """Give a model built from a config that names a rope-extend type rope-extend's runtime.

    Runs from transformers' ``post_init`` (see ``hf.register``); the buffers transformers computed through
    rope-extend's registered init function stay. The runtime goes in as ``patch`` puts it (``hf.attach``, with the
    same checks): the language model's rotary modules (``rotary.rotary_modules``; a model without one is left
    alone), their dynamic behaviour (with the cache keeper, ``hf.cache``) and float32 guard, the attention method
    its config names (planned at the first forward: the weights are not loaded yet), and ``generate``'s reminder.
    A rotary module that already has its runtime (an inner model's ``post_init`` ran first) is passed over.
    """
    modules = [m for _, m in rotary.rotary_modules(model, required=False)]
    runtimes, in_attention, named = [], None, None
    for module in modules:
        config = getattr(module, "config", None)
        if "forward" in module.__dict__ or config is None or not getattr(config, "rope_parameters", None):
            continue
        try:
            layer_types = rotary.module_layer_types(module)
        except UnsupportedModelError:
            continue
        entries = {}
        for lt in layer_types:
            params = config.rope_parameters if lt is None else config.rope_parameters.get(lt)
            if not params:
                continue
            if params.get("logn") or own_rope_type(params.get("rope_type")):
                scaling = config_scaling(config, lt)
                if scaling is not None and scaling.in_attention:
                    in_attention, named = scaling, config
            if own_rope_type(params.get("rope_type")):
                entries[lt] = attach.entry(module, config, config_scaling(config, lt), lt)
        if entries:
            runtimes.append((module, config, entries))
    planned = []
    if in_attention is not None:
        with naming(named, in_attention.method.name):
            planned = attention.plans(model, named, in_attention, modules, defer=True)
    attach.attach(model, runtimes, in_attention, planned, modules)
