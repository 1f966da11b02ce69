"""Registration with transformers: the top of ``hf``, run once by ``import rope_extend``.

What it changes in transformers, and nothing else:

- ``modeling_rope_utils.ROPE_INIT_FUNCTIONS`` gains the rope types transformers lacks (``ntk``,
  ``dynamic_ntk``, ``ntk_by_parts``, ``dynamic_yarn``); an existing entry of the same name is never
  replaced (that raises);
- ``RotaryEmbeddingConfigMixin`` gains a validator per such type, which raises on a bad parameter
  (transformers' own validators only warn);
- ``PreTrainedModel.post_init`` is wrapped so that a model built from a config naming a rope-extend type
  gets rope-extend's rotary runtime (``hf.rotary.attach_from_config``); models without one are untouched.
"""

from __future__ import annotations

from ..errors import RopeExtendError
from ..methods import registry as M
from .config import config_scaling, original_length, rotary_geometry, scaling_from_dict
from .rotary import attach_from_config


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

    original_post_init = PreTrainedModel.post_init

    def post_init(self, *args, **kwargs):
        out = original_post_init(self, *args, **kwargs)
        attach_from_config(self)
        return out

    post_init.__wrapped__ = original_post_init
    PreTrainedModel.post_init = post_init
    _registered = True
