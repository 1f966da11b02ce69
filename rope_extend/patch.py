"""Patch a loaded model in place: swap its rotary frequencies, keep them float32, undo exactly.

A rotary module is any module whose class name contains ``RotaryEmbedding`` and that keeps transformers'
buffers: ``inv_freq`` (one set) or ``{layer_type}_inv_freq`` (Gemma 3: one set per attention type).
``patch`` writes the scaling into the model's config, recomputes each buffer on its device, and installs
a small runtime as the module's ``forward`` that

- restores float32 frequencies if ``model.to(torch.bfloat16)`` / ``.half()`` cast the buffer (at
  position 32767 a bf16 ``inv_freq`` puts cos off by up to 2);
- for the dynamic methods (``dynamic``, ``dynamic_yarn``, ``longrope``), follows the longest position
  seen in the current sequence: a forward whose positions start at 0 begins a new sequence, later
  forwards (decoding with a cache) extend it; frequencies are measured against the original ``L``.

It then calls the module's own (undecorated) forward, so cos/sin are computed exactly as transformers
computes them. ``unpatch`` puts back the config, every buffer and attribute, and the class's forward.
"""

from __future__ import annotations

import copy
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import hf
from .errors import NotPatchedError, UnsupportedModelError
from .methods import registry as M

logger = logging.getLogger("rope_extend")

STATE_ATTR = "_rope_extend_state"
_SKIP_ATTRS = ("training", "config")
_INSTALLED = ("forward", "_apply")  # instance attributes the runtime sets on a rotary module


# ------------------------------------------------------------------------------------------ finding
def _buffer_name(layer_type: str | None) -> str:
    return "inv_freq" if layer_type is None else f"{layer_type}_inv_freq"


def _scale_name(layer_type: str | None) -> str:
    return "attention_scaling" if layer_type is None else f"{layer_type}_attention_scaling"


def _module_layer_types(module: nn.Module) -> list[str | None]:
    """The frequency sets a rotary module keeps: [None] for ``inv_freq``, else its layer types."""
    if "inv_freq" in module._buffers:
        return [None]
    layer_types = getattr(module, "layer_types", None) or []
    found = [lt for lt in layer_types if _buffer_name(lt) in module._buffers]
    if not found:
        raise UnsupportedModelError(
            f"{type(module).__name__} does not follow transformers' *RotaryEmbedding convention (an inv_freq "
            "buffer, or {layer_type}_inv_freq buffers): rope-extend cannot scale it"
        )
    return found


def rotary_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for every text rotary embedding module in ``model``; raises if there is none.

    Modules that carry a config with ``rope_parameters`` are the language model's; rotary modules without
    one (a vision tower's, say) are left alone when the language model has its own.
    """
    found = [(name, m) for name, m in model.named_modules() if "RotaryEmbedding" in type(m).__name__]
    if not found:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no rotary embedding module (a module whose class name contains "
            "'RotaryEmbedding', as in transformers' Llama, Mistral, Qwen, Gemma and Phi models): nothing to scale"
        )
    with_config = [(n, m) for n, m in found if getattr(getattr(m, "config", None), "rope_parameters", None)]
    return with_config or found


def _module_config(model: nn.Module, module: nn.Module):
    config = getattr(module, "config", None)
    if config is None:
        config = getattr(model, "config", None)
        config = hf.text_config(config) if config is not None else None
    if config is None or not getattr(config, "rope_parameters", None):
        raise UnsupportedModelError(
            f"cannot find the rope_parameters of {type(module).__name__}: neither it nor the model has a config "
            "with rope_parameters"
        )
    return config


# ------------------------------------------------------------------------------------------ runtime
@dataclass
class _Entry:
    """One frequency set a runtime manages."""

    scaling: M.Scaling
    dim: int
    base: float
    seen: int | None = None  # dynamic methods: the longest length of the current sequence
    static: tuple[torch.Tensor, float] | None = None  # static methods: computed once

    def __post_init__(self):
        if not self.scaling.method.dynamic:
            self.static = self.scaling.compute(self.dim, self.base)

    def initial(self) -> tuple[torch.Tensor, float]:
        """The frequencies before any forward: the static ones, or the dynamic ones at ``L``."""
        return self.static if self.static is not None else self.scaling.compute(self.dim, self.base)


class RotaryRuntime:
    """Installed as a rotary module's ``forward``; see the module docstring."""

    def __init__(self, module: nn.Module, entries: dict[str | None, _Entry]):
        self.module = module
        self.entries = entries

    def apply(self, fn, *args, **kwargs):
        """``nn.Module._apply`` (what ``.to``/``.half``/``.cuda`` call), then float32 frequencies again."""
        out = type(self.module)._apply(self.module, fn, *args, **kwargs)
        for layer_type, entry in self.entries.items():
            _keep_float32(self.module, layer_type, entry)
        return out

    def __call__(self, x, position_ids, *args, **kwargs):
        layer_type = args[0] if args else kwargs.get("layer_type")
        entry = self.entries.get(layer_type)
        if entry is not None:
            self._update(layer_type, entry, position_ids, x.device)
        with torch.no_grad():
            return _raw_forward(type(self.module))(self.module, x, position_ids, *args, **kwargs)

    def _update(self, layer_type, entry: _Entry, position_ids: torch.Tensor, device) -> None:
        stale = _stale(self.module._buffers.get(_buffer_name(layer_type)))
        if not entry.scaling.method.dynamic:
            if stale:
                set_frequencies(self.module, layer_type, entry.static[0], device)
            return
        # One host sync for both ends; positions starting at 0 mean a new sequence.
        low, high = torch.stack([position_ids.min(), position_ids.max()]).tolist()
        length = int(high) + 1
        seen = length if low == 0 or entry.seen is None else max(entry.seen, length)
        if seen != entry.seen or stale:
            freqs, scale = entry.scaling.compute(entry.dim, entry.base, seen)
            set_frequencies(self.module, layer_type, freqs, device)
            setattr(self.module, _scale_name(layer_type), scale)
            entry.seen = seen


_RAW_FORWARD: dict[type, Any] = {}


def _raw_forward(cls: type):
    """The class's forward without its decorators (transformers' ``dynamic_rope_update`` and ``no_grad``):
    the runtime does what the dynamic decorator did, measured against ``L``. Looked up per class, not
    stored on the runtime, so a patched model still pickles."""
    raw = _RAW_FORWARD.get(cls)
    if raw is None:
        raw = _RAW_FORWARD[cls] = inspect.unwrap(cls.forward)
    return raw


def set_frequencies(module: nn.Module, layer_type: str | None, freqs: torch.Tensor, device=None) -> None:
    """Replace the frequency buffers (current and ``original_``) with float32 ``freqs`` on the module's device."""
    name = _buffer_name(layer_type)
    current = module._buffers.get(name)
    if current is not None and current.device.type != "meta":
        device = current.device
    freqs = freqs.to(device=device, dtype=torch.float32)
    module._buffers[name] = freqs
    original = "original_inv_freq" if layer_type is None else f"{layer_type}_original_inv_freq"
    if original in module._buffers:
        module._buffers[original] = freqs.clone()


def _install(module: nn.Module, entries: dict[str | None, _Entry]) -> None:
    runtime = RotaryRuntime(module, entries)
    module.forward = runtime
    module._apply = runtime.apply


def _stale(buffer: torch.Tensor | None) -> bool:
    """A frequency buffer that must be rewritten: missing, cast away from float32, or still on meta."""
    return buffer is None or buffer.dtype != torch.float32 or buffer.device.type == "meta"


def _keep_float32(module: nn.Module, layer_type: str | None, entry: _Entry) -> None:
    buffer = module._buffers.get(_buffer_name(layer_type))
    if buffer is None or buffer.dtype == torch.float32 or buffer.device.type == "meta":
        return  # nothing cast; a missing or meta buffer is filled at the first forward
    if entry.static is not None:
        freqs = entry.static[0]
    else:  # recompute at the length in use rather than upcast rounded values
        freqs = entry.scaling.compute(entry.dim, entry.base, entry.seen)[0]
    set_frequencies(module, layer_type, freqs, buffer.device)


def _set_rope_type(module: nn.Module, layer_type: str | None, rope_type: str) -> None:
    if layer_type is None:
        module.rope_type = rope_type
    elif isinstance(getattr(module, "rope_type", None), dict):
        module.rope_type[layer_type] = rope_type


def attach_from_config(model: nn.Module) -> None:
    """Give a model built from a config that names a rope-extend type rope-extend's runtime.

    Runs from transformers' ``post_init`` (see ``hf.register``); the buffers transformers computed through
    rope-extend's registered init function stay; only dynamic behaviour and the float32 guard are added.
    """
    for _, module in model.named_modules():
        if "RotaryEmbedding" not in type(module).__name__ or "forward" in module.__dict__:
            continue
        config = getattr(module, "config", None)
        if config is None or not getattr(config, "rope_parameters", None):
            continue
        try:
            layer_types = _module_layer_types(module)
        except UnsupportedModelError:
            continue
        entries = {}
        for lt in layer_types:
            params = config.rope_parameters if lt is None else config.rope_parameters.get(lt)
            if not params or not hf.own_rope_type(params.get("rope_type")):
                continue
            scaling = hf.config_scaling(config, lt)
            dim, base = hf.rotary_geometry(config, lt)
            entries[lt] = _Entry(scaling, dim, base)
        if entries:
            _install(module, entries)


# ------------------------------------------------------------------------------------------ state
@dataclass
class _ModuleSnapshot:
    buffers: dict[str, torch.Tensor]
    attrs: dict[str, Any]


@dataclass
class PatchState:
    """What ``patch`` changed, to undo: config snapshots and module snapshots, plus the scaling applied."""

    scaling: M.Scaling
    configs: list[tuple[Any, dict]] = field(default_factory=list)
    modules: list[tuple[nn.Module, _ModuleSnapshot]] = field(default_factory=list)


def _snapshot_module(module: nn.Module) -> _ModuleSnapshot:
    buffers = {k: v.detach().clone() for k, v in module._buffers.items() if v is not None}
    attrs = {k: copy.copy(v) for k, v in module.__dict__.items() if _restorable(k)}
    return _ModuleSnapshot(buffers, attrs)


def _restorable(key: str) -> bool:
    return (not key.startswith("_") or key in _INSTALLED) and key not in _SKIP_ATTRS


def _restore_module(module: nn.Module, snap: _ModuleSnapshot) -> None:
    for name, value in snap.buffers.items():
        current = module._buffers.get(name)
        device = current.device if current is not None and current.device.type != "meta" else value.device
        module._buffers[name] = value.to(device)
    for key in [k for k in module.__dict__ if _restorable(k)]:
        if key not in snap.attrs:
            del module.__dict__[key]
    for key, value in snap.attrs.items():
        module.__dict__[key] = value


def _restore(state: PatchState) -> None:
    for config, snap in state.configs:
        hf.restore(config, snap)
    for module, snap in state.modules:
        _restore_module(module, snap)


def _pristine_config(config, state: PatchState | None):
    """The config as it was before any patch (a copy when a patch is in place)."""
    if state is None:
        return config
    for cfg, snap in state.configs:
        if cfg is config:
            pristine = copy.deepcopy(config)
            hf.restore(pristine, snap)
            return pristine
    return config


# ------------------------------------------------------------------------------------------ public
def patch(model: nn.Module, method: str, *, factor=None, target_length=None,
          original_max_position_embeddings=None, **params) -> nn.Module:
    """Scale ``model``'s rotary embeddings with ``method``, in place, and return it.

    ``factor`` is relative to the original pretraining length ``L`` (``original_max_position_embeddings``
    if the config has it, else ``max_position_embeddings`` before any patch); ``target_length`` is the
    alternative (``factor = target_length / L``). A new patch replaces the previous one and never
    compounds. A model that ships with scaling (Llama 3.1 ``llama3``, a Qwen YaRN config) has it
    replaced: the factor applies to the plain RoPE frequencies and is relative to that model's ``L``.
    Gemma 3 style models scale their global layers only; local sliding-window layers keep their rotary.
    Every argument is checked before the model is touched.
    """
    modules = rotary_modules(model)
    state: PatchState | None = model.__dict__.get(STATE_ATTR)

    # 1. Plan everything against the unpatched configs; raise before touching anything.
    plans = []  # (module, config, {layer_type: _Entry})
    scaling = None
    shipped = set()
    for _, module in modules:
        config = _module_config(model, module)
        pristine = _pristine_config(config, state)
        scaling = hf.plan(pristine, method, factor=factor, target_length=target_length,
                          original_max_position_embeddings=original_max_position_embeddings, **params)
        entries = {}
        present = _module_layer_types(module)
        for lt in hf.scaled_layer_types(pristine):
            if lt not in present:
                continue
            dim, base = hf.rotary_geometry(pristine, lt)
            buffer = module._buffers[_buffer_name(lt)]
            if buffer.numel() != dim // 2:
                raise UnsupportedModelError(
                    f"{type(module).__name__}.{_buffer_name(lt)} has {buffer.numel()} frequencies but the config "
                    f"implies a rotary dimension of {dim} ({dim // 2} frequencies): unsupported rotary layout"
                )
            old_type = hf.rope_dict(pristine, lt).get("rope_type", "default")
            if old_type != "default":
                shipped.add(f"{old_type} ({hf.rope_dict(pristine, lt).get('factor')})")
            entries[lt] = _Entry(scaling, dim, base)
        if not entries:
            raise UnsupportedModelError(f"{type(module).__name__} has no global rotary frequencies to scale")
        plans.append((module, config, entries))
    if shipped and state is None:
        logger.warning(
            "the model ships with rope scaling %s; rope-extend replaces it (it does not compound): %s is applied "
            "to the plain RoPE frequencies", ", ".join(sorted(shipped)), scaling.describe(),
        )

    # 2. Undo a previous patch, or remember the original state.
    if state is not None:
        _restore(state)
    configs = list({id(c): c for _, c, _ in plans}.values())
    state = PatchState(
        scaling,
        configs=[(c, hf.snapshot(c)) for c in configs],
        modules=[(m, _snapshot_module(m)) for m, _, _ in plans],
    )

    # 3. Apply.
    for config in configs:
        hf.write(config, scaling)
    for module, _, entries in plans:
        for lt, entry in entries.items():
            freqs, scale = entry.initial()
            set_frequencies(module, lt, freqs)
            setattr(module, _scale_name(lt), scale)
            _set_rope_type(module, lt, scaling.method.rope_type)
        _install(module, entries)
    model.__dict__[STATE_ATTR] = state
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo ``patch``: the config, every rotary buffer and attribute as they were (bit-identical logits)."""
    state = model.__dict__.pop(STATE_ATTR, None)
    if state is None:
        raise NotPatchedError(f"{type(model).__name__} was not patched by rope_extend.patch; nothing to undo")
    _restore(state)
    return model


def patched(model: nn.Module) -> M.Scaling | None:
    """The scaling ``patch`` applied to ``model``, or None."""
    state = model.__dict__.get(STATE_ATTR)
    return state.scaling if state is not None else None
