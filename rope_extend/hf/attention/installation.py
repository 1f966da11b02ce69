"""Install and remove: give every planned attention module its plan and point the config at rope-extend's
attention; take it all back; and report which kernels run the patched layers.

A model planned before its weights were loaded (``plans(defer=True)``, or on the meta device) is probed at its
first forward by a pre-hook on the decoder, which completes the plans (or refuses the model) before any layer
runs.
"""

from __future__ import annotations

from torch import nn

from .. import layout as rope_layout
from .. import mrope, slots
from ..names import INNER_ATTR, PLAN_ATTR, POSITIONS_HOOK, PROBE_HOOK, TABLES_ATTR, WORKSPACE_ATTR
from ..reading import naming, text_config
from . import keys as kept_keys
from .kernels import passes_kernel
from .plan import _plan_modules
from .positions import keep_positions
from .registration import is_registered_name, registered_name
from .state import attention_modules


def install(model: nn.Module, config, planned, scaling=None, rotary=()) -> None:
    """Give every planned module its plan and point the config at ``NAME``. Plans of a model that was on the
    meta device are completed by a probe at its first forward (which raises if the model is refused).

    Args:
        model: the model ``plans`` planned.
        config: its config; its ``_attn_implementation`` becomes ``registered_name`` of the model's own, kept
            as ``names.INNER_ATTR`` for ``remove``.
        planned: ``plans``' answer.
        scaling: the scaling planned for (M-RoPE's runtime and the deferred probe read it).
        rotary: the model's rotary modules.
    """
    config = text_config(config)
    if not is_registered_name(config._attn_implementation):
        setattr(config, INNER_ATTR, config._attn_implementation)
    decoder = rope_layout.decoder_of(model)
    recorder = slots.install(decoder)
    for module, plan in planned:
        plan.recorder = recorder
        module.__dict__[PLAN_ATTR] = plan
    kept_keys.install([module for module, _ in planned])
    mrope.install(model, config, scaling, list(rotary))
    mrope.attach(model, [module for module, _ in planned])
    name = config._attn_implementation = registered_name(getattr(config, INNER_ATTR))
    pending = any(plan.active and plan.layout is None for _, plan in planned)
    keep_positions(decoder, planned)
    if pending and PROBE_HOOK not in decoder.__dict__:
        inner = getattr(config, INNER_ATTR)
        for module in decoder.modules():  # an inner model's own (its post_init ran first: Llama 4's text model)
            earlier = module.__dict__.pop(PROBE_HOOK, None)  # is superseded: its probe would run inside this one's
            if earlier is not None:
                earlier.remove()

        def complete(_module, _args, kwargs):
            decoder.__dict__.pop(PROBE_HOOK).remove()
            config._attn_implementation = inner
            try:
                with naming(config, scaling.method.name):
                    probed = rope_layout.probe(model, config, list(rotary), scaling.pretraining_length)
                    final = _plan_modules(model, config, scaling, inner, probed)
            finally:
                config._attn_implementation = name
            for module, plan in final:
                plan.recorder = recorder
                module.__dict__[PLAN_ATTR] = plan
            kept_keys.install([module for module, _ in final])
            mrope.attach(model, [module for module, _ in final])
            keep_positions(decoder, final)
            keeper = decoder.__dict__.get(POSITIONS_HOOK)
            if keeper is not None:  # this forward's own position ids: its pre-hooks ran before this one's probe
                keeper[0](decoder, _args, kwargs)

        decoder.__dict__[PROBE_HOOK] = decoder.register_forward_pre_hook(complete, with_kwargs=True)


def kernel(model: nn.Module, config, inner: str, modules) -> str:
    """What runs the patched layers' attention now: ``cpu_flash`` (aten's CPU flash attention with its
    log-sum-exp) for the method's passes on the CPU, ``torch_tiles`` (plain torch over key tiles) with logit
    softcapping or on another device; then the implementation the other layers keep (local layers; log-n alone
    scales the queries and keeps it), when there are any. For inference: a forward under autograd (training
    through the method) takes ``torch_tiles`` for its passes (``passes_kernel``).

    Args:
        model: the patched model.
        config: its config.
        inner: the implementation the model used before the patch.
        modules: the patched attention modules.

    Returns:
        For example ``'cpu_flash'``, ``'cpu_flash; other layers: sdpa'``, or ``inner`` for log-n alone.
    """
    config = text_config(config)
    param = next(model.parameters(), None)
    device = param.device.type if param is not None else "cpu"
    passes = passes_kernel(device, getattr(config, "attn_logit_softcapping", None) is not None)

    def passes_run(module) -> bool:  # log-n alone scales the queries and keeps the model's implementation
        plan = module.__dict__.get(PLAN_ATTR)
        return plan is not None and plan.rules is not None

    every = list(dict.fromkeys([*modules, *attention_modules(model, config)]))
    ran = sum(map(passes_run, every))
    if not ran:
        return inner
    return passes if ran == len(every) else f"{passes}; other layers: {inner}"


def remove(model: nn.Module, config, inner: str, modules) -> None:
    """Undo ``install``: the plans, the rotation tables and work space on the rotary modules, the decoder's hooks
    (probe, cache recorder, position keeper), M-RoPE's runtime, and the config's implementation (back to
    ``inner``)."""
    config = text_config(config)
    kept_keys.remove(model.modules())  # also on modules a deferred probe planned
    for module in modules:
        plan = module.__dict__.pop(PLAN_ATTR, None)
        if plan is not None and plan.layout is not None:  # its frequency set's cos/sin tables and work space
            plan.layout.rotary.__dict__.pop(TABLES_ATTR, None)
            plan.layout.rotary.__dict__.pop(WORKSPACE_ATTR, None)
    decoder = rope_layout.decoder_of(model)
    hook = decoder.__dict__.pop(PROBE_HOOK, None)
    if hook is not None:
        hook.remove()
    slots.remove(decoder)
    keeper = decoder.__dict__.pop(POSITIONS_HOOK, None)
    if keeper is not None:
        keeper[1].remove()
    mrope.remove(model, modules)
    config._attn_implementation = inner
    config.__dict__.pop(INNER_ATTR, None)
