"""What rope-extend registers with transformers: the functions, not the registering (``hf.transformers_changes``,
the only module that imports this one, makes every change, and undoes it).

- ``init_function``: the ``ROPE_INIT_FUNCTIONS`` entry of every rope type transformers lacks (``ntk``,
  ``dynamic_ntk``, ``ntk_by_parts``, ``dynamic_yarn``) and of ``proportional_<type>`` for every method
  (``hf.rope_types``), with ``validator``, which raises on a bad parameter (transformers' own validators only
  warn);
- ``ignoring_extra_keys``: transformers' ``_check_received_keys``, with the keys rope-extend adds to
  transformers' own rope types (``logn``, ``rope_types.EXTRA_KEYS``) counted as known, so that a config written by
  ``configure`` (``yarn`` with ``logn``) loads without transformers' "Unrecognized keys" warning;
- ``wrapped_post_init``: ``PreTrainedModel.post_init`` followed by ``attach_from_config``, so that a model built
  from a config naming a rope-extend type gets rope-extend's rotary runtime (with the cache keeper of
  ``hf.cache_keeper``), and one naming an attention method or ``logn`` gets rope-extend's attention (``hf.attention``);
  models without one are untouched.
"""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError
from . import attach, attention, rotary, rotary_plan
from .reading import (
    config_scaling,
    family_keys,
    frequencies,
    naming,
    original_length,
    rotary_geometry,
    rotating,
    scaling_from_dict,
)
from .rope_types import EXTRA_KEYS, own_rope_type


def init_function(config, device=None, seq_len=None, layer_type=None, **_ignored):
    """A ``ROPE_INIT_FUNCTIONS`` entry for a rope-extend type: reads the config, calls the pure math."""
    scaling = config_scaling(config, layer_type)
    if scaling is None:  # transformers calls this only for a rope-extend type, which always names a scaling
        raise UnsupportedModelError(
            f"{type(config).__name__} names no rope-extend scaling for layer type {layer_type!r}"
        )
    dim, base = rotary_geometry(config, layer_type)
    length = int(seq_len) if seq_len is not None else None
    freqs, scale = frequencies(scaling, dim, base, rotating(config, layer_type), length)
    return freqs.to(device) if device is not None else freqs, scale


def validator(self, rope_parameters, ignore_keys=None):
    """Config validation for a rope-extend type: raises (transformers' own validators only warn)."""
    scaling_from_dict(rope_parameters, original_length(self), ignore_keys=family_keys(self, ignore_keys))


def ignoring_extra_keys(check):
    """Wrap transformers' ``_check_received_keys`` so that ``EXTRA_KEYS`` count as known."""

    def _check_received_keys(rope_type, received_keys, required_keys, optional_keys=None, ignore_keys=None):
        extra = EXTRA_KEYS - set(required_keys)  # a key the type requires stays checked
        return check(rope_type, received_keys, required_keys, optional_keys, ignore_keys=set(ignore_keys or ()) | extra)

    _check_received_keys.__wrapped__ = check  # type: ignore[attr-defined]
    return staticmethod(_check_received_keys)


def wrapped_post_init(original):
    """transformers' ``PreTrainedModel.post_init``, followed by ``attach_from_config``."""

    def post_init(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        attach_from_config(self)
        return out

    post_init.__wrapped__ = original  # type: ignore[attr-defined]
    return post_init


def attach_from_config(model: nn.Module) -> None:
    """Give a model built from a config that names a rope-extend type rope-extend's runtime.

    Runs from transformers' ``post_init`` (see ``hf.register``); the buffers transformers computed through
    rope-extend's registered init function stay. The runtime goes in as ``patch`` puts it (``hf.attach``, with the
    same checks): the language model's rotary modules (``rotary.rotary_modules``; a model without one is left
    alone), their dynamic behaviour (with the cache keeper, ``hf.cache_keeper``) and float32 guard, the attention method
    its config names (planned at the first forward: the weights are not loaded yet), and ``generate``'s reminder.
    A rotary module that already has its runtime (an inner model's ``post_init`` ran first) is passed over.
    """
    modules = [m for _, m in rotary.rotary_modules(model, required=False)]
    runtimes: list[rotary_plan.RotaryPlan] = []
    in_attention, named = None, None
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
                entries[lt] = rotary_plan.entry(module, config, config_scaling(config, lt), lt)
        if entries:
            runtimes.append(rotary_plan.RotaryPlan(module, config, entries))
    planned = []
    if in_attention is not None:
        with naming(named, in_attention.method.name):
            planned = attention.plans(model, named, in_attention, modules, defer=True)
    attach.attach(model, runtimes, in_attention, planned, modules)
