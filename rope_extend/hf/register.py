"""Registration with transformers: the top of ``hf``, run once by ``import rope_extend``.

What it changes in transformers, and nothing else:

- ``modeling_rope_utils.ROPE_INIT_FUNCTIONS`` gains the rope types transformers lacks (``ntk``,
  ``dynamic_ntk``, ``ntk_by_parts``, ``dynamic_yarn``); an existing entry of the same name is never
  replaced (that raises);
- ``RotaryEmbeddingConfigMixin`` gains a validator per such type, which raises on a bad parameter
  (transformers' own validators only warn);
- ``PreTrainedModel.post_init`` is wrapped so that a model built from a config naming a rope-extend type
  gets rope-extend's rotary runtime (``attach_from_config`` below, with the cache keeper of ``hf.cache``), and one
  naming an attention method or ``logn`` gets rope-extend's attention (``hf.attention``); models without one
  are untouched;
- ``AttentionInterface`` and ``AttentionMaskInterface`` gain the name ``rope_extend`` (``hf.attention``);
- ``RotaryEmbeddingConfigMixin._check_received_keys`` ignores the keys rope-extend adds to transformers'
  own rope types (``logn``, see ``config.EXTRA_KEYS``), so that a config written by ``configure`` (``yarn`` with
  ``logn``) loads without transformers' "Unrecognized keys" warning; every other key is checked as before.
"""

from __future__ import annotations

from torch import nn

from ..errors import RopeExtendError, UnsupportedModelError
from ..methods import registry as M
from . import attention as A
from . import cache
from . import rotary as R
from .config import EXTRA_KEYS, config_scaling, original_length, own_rope_type, rotary_geometry, scaling_from_dict


def _init_function(config, device=None, seq_len=None, layer_type=None, **_ignored):
    """A ``ROPE_INIT_FUNCTIONS`` entry for a rope-extend type: reads the config, calls the pure math."""
    scaling = config_scaling(config, layer_type)
    dim, base = rotary_geometry(config, layer_type)
    length = int(seq_len) if seq_len is not None else None
    freqs, scale = scaling.compute(dim, base, length)
    return freqs.to(device) if device is not None else freqs, scale


def _validator(self, rope_parameters, ignore_keys=None):
    """Config validation for a rope-extend type: raises (transformers' own validators only warn)."""
    scaling_from_dict(rope_parameters, original_length(self), ignore_keys=ignore_keys)


def _ignoring_extra_keys(check):
    """Wrap transformers' ``_check_received_keys`` so that ``EXTRA_KEYS`` count as known."""

    def _check_received_keys(rope_type, received_keys, required_keys, optional_keys=None, ignore_keys=None):
        return check(
            rope_type, received_keys, required_keys, optional_keys, ignore_keys=set(ignore_keys or ()) | EXTRA_KEYS
        )

    _check_received_keys.__wrapped__ = check
    return staticmethod(_check_received_keys)


_registered = False


def register() -> None:
    """Register rope-extend's own rope types with transformers. Idempotent; runs on ``import rope_extend``."""
    global _registered
    if _registered:
        return
    from transformers import modeling_rope_utils as mru
    from transformers.modeling_utils import PreTrainedModel

    for method in map(M.get, M.names()):
        if method.in_transformers:
            continue
        existing = mru.ROPE_INIT_FUNCTIONS.get(method.rope_type)
        if existing is not None and existing is not _init_function:
            raise RopeExtendError(
                f"transformers already defines rope_type {method.rope_type!r}; rope-extend will not replace it"
            )
        mru.ROPE_INIT_FUNCTIONS[method.rope_type] = _init_function
        setattr(mru.RotaryEmbeddingConfigMixin, f"_validate_{method.rope_type}_rope_parameters", _validator)

    mixin = mru.RotaryEmbeddingConfigMixin
    if not hasattr(mixin._check_received_keys, "__wrapped__"):
        mixin._check_received_keys = _ignoring_extra_keys(mixin._check_received_keys)

    original_post_init = PreTrainedModel.post_init

    def post_init(self, *args, **kwargs):
        out = original_post_init(self, *args, **kwargs)
        attach_from_config(self)
        return out

    A.register()
    post_init.__wrapped__ = original_post_init
    PreTrainedModel.post_init = post_init
    _registered = True


def attach_from_config(model: nn.Module) -> None:
    """Give a model built from a config that names a rope-extend type rope-extend's runtime.

    Runs from transformers' ``post_init`` (see ``hf.register``); the buffers transformers computed through
    rope-extend's registered init function stay; only dynamic behaviour (with the cache keeper, ``hf.cache``)
    and the float32 guard are added.
    """
    for _, module in model.named_modules():
        if "RotaryEmbedding" not in type(module).__name__ or "forward" in module.__dict__:
            continue
        config = getattr(module, "config", None)
        if config is None or not getattr(config, "rope_parameters", None):
            continue
        try:
            layer_types = R.module_layer_types(module)
        except UnsupportedModelError:
            continue
        entries, in_attention = {}, None
        for lt in layer_types:
            params = config.rope_parameters if lt is None else config.rope_parameters.get(lt)
            if not params:
                continue
            if params.get("logn") or own_rope_type(params.get("rope_type")):
                scaling = config_scaling(config, lt)
                if scaling is not None and scaling.in_attention:
                    in_attention = scaling
            if not own_rope_type(params.get("rope_type")):
                continue
            scaling = config_scaling(config, lt)
            dim, base = rotary_geometry(config, lt)
            entries[lt] = R.Entry(scaling, dim, base)
        if entries:
            cache.install(model, R.install(module, entries), config)
        if in_attention is not None:
            A.install(config, A.plans(model, config, in_attention, [module]))
