"""A ``PatchPlan`` put into a model, and the one handle that takes it out again (``Installed.undo``).

``install`` remembers what it changes (each config's values, each rotary module's buffers and instance attributes,
the MLA softmax scales), writes each config's edit, sets each rotary module's frequencies and attention scale,
and hands the rest to ``hf.attach`` (the rotary runtime, its cache keeper, the attention method, ``generate``'s
reminders), whose ``Attached`` the handle keeps. ``undo`` puts everything back, bit for bit; it computes every
value it will write first, so a failure changes nothing. The handle lives on the model (``names.PATCH_STATE``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import nn

from ..errors import NotPatchedError, RopeExtendError
from . import config as hf_config
from . import rotary
from .attach import Attached, attach
from .names import PATCH_STATE, ROTARY_INSTALLED
from .patch_plan import ModuleSnapshot, PatchPlan, pristine_copy
from .reading import rope_dict
from .rope_types import rope_type_of

_SKIP_ATTRS = ("training", "config")


class _SoftmaxScaled(Protocol):
    """An MLA attention module whose softmax scale is a float (``rotary.softmax_scales`` finds only those; torch
    types any module attribute ``Tensor | Module``)."""

    scaling: float


@dataclass
class Installed:
    """A patch in a model: the plan, what it changed (to undo) and what ``hf.attach`` installed."""

    model: nn.Module
    plan: PatchPlan
    configs: list[tuple[Any, dict]] = field(default_factory=list)  # (config, hf.config.snapshot before)
    modules: list[tuple[nn.Module, ModuleSnapshot]] = field(default_factory=list)
    softmax: list[tuple[nn.Module, float]] = field(default_factory=list)  # MLA softmax scales before the patch
    attached: Attached = field(default_factory=Attached)

    def pristine(self, config):
        """``config`` as it was before this patch (a copy), or ``config`` itself when the patch did not write it."""
        for cfg, snap in self.configs:
            if cfg is config:
                return pristine_copy(config, snap)
        return config

    def snapshot(self, module: nn.Module) -> ModuleSnapshot | None:
        return next((s for m, s in self.modules if m is module), None)

    def undo(self) -> None:
        """Put every config and module back and take the handle off the model (``rope_extend.unpatch``). All new
        values are computed first, so a failure changes nothing (the patch stays in place and recorded)."""
        buffers = self.original_buffers()
        for config, before in self.configs:
            hf_config.restore(config, before)
        self.attached.detach()
        for module, name, value in buffers:
            rotary.set_buffer(module, name, value)
        for module, scale in self.softmax:
            cast(_SoftmaxScaled, module).scaling = scale
        for module, snap in self.modules:
            _put_attrs(module, snap.attrs)
        self.model.__dict__.pop(PATCH_STATE, None)

    def original_buffers(self) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """``[(module, buffer name, original value)]`` on each buffer's current device. A buffer saved on the meta
        device (a model loaded with deferred weights) is recomputed from the unpatched config."""
        pristine = {id(config): pristine_copy(config, snap) for config, snap in self.configs}
        buffers = []
        for module, snap in self.modules:
            for name, value in snap.buffers.items():
                current = rotary.buffers(module).get(name)
                if value.device.type == "meta" and current is not None and current.device.type != "meta":
                    config = pristine.get(id(snap.config), snap.config)
                    value = rotary.original_frequencies(module, config, name, current.device)
                elif current is not None and current.device.type != "meta":
                    value = value.to(current.device)
                buffers.append((module, name, value))
        return buffers


def installed(model: nn.Module) -> Installed | None:
    """The patch in ``model``, or None."""
    return model.__dict__.get(PATCH_STATE)


def install(model: nn.Module, plan: PatchPlan) -> Installed:
    """Put ``plan`` into ``model`` (unpatched: undo a patch in place first) and return its handle, kept on the
    model. Everything was checked by the planner; this only writes."""
    done = Installed(
        model,
        plan,
        configs=[(p.config, hf_config.snapshot(p.config)) for p in plan.configs],
        modules=[(r.module, _snapshot_module(r.module, r.config)) for r in plan.rotaries],
    )
    for planned in plan.configs:
        planned.edit.apply(planned.config)
        for module, apply in rotary.softmax_scales(model, planned.config):
            attention_module = cast(_SoftmaxScaled, module)
            done.softmax.append((module, attention_module.scaling))
            attention_module.scaling = rotary.softmax_scale(module, apply, planned.config)
    for planned_rotary in plan.rotaries:
        for lt, entry in planned_rotary.entries.items():
            freqs, scale = entry.initial()
            rotary.set_frequencies(planned_rotary.module, lt, freqs)
            setattr(planned_rotary.module, rotary.scale_name(lt), scale)
            rotary.set_rope_type(planned_rotary.module, lt, rope_type_of(rope_dict(planned_rotary.config, lt)))
    done.attached = attach(model, plan.rotaries, plan.scaling, plan.attention, plan.modules)
    model.__dict__[PATCH_STATE] = done
    return done


@contextlib.contextmanager
def original_rope(model: nn.Module) -> Iterator[None]:
    """Inside this block the rotary modules of a patched ``model`` compute cos and sin as before ``patch``
    (the original frequencies and attention scale, and the modules' own forward), and after it as patched again;
    the weights are shared, so one model serves both. For mixed context window training (LongRoPE2, Shang et
    al. 2025, section 3.3: sequences within ``L`` keep the original rope). Frequency methods only: an attention
    method's passes change the attention itself, which this does not undo, so it is refused.

    Raises:
        NotPatchedError: ``patch`` never touched ``model``.
        RopeExtendError: ``model`` is patched with an attention method.
    """
    handle = installed(model)
    if handle is None:
        raise NotPatchedError(f"{type(model).__name__} was not patched by rope_extend.patch; no original rope to use")
    if handle.attached.attention is not None or handle.softmax:
        raise RopeExtendError(
            f"{handle.plan.scaling.method} changes the attention, not only the rotary frequencies: the original rope "
            "cannot be switched in for part of a run; use a frequency method (yarn, longrope, linear, ...)"
        )
    saved = [
        (m, dict(rotary.buffers(m)), {k: v for k, v in m.__dict__.items() if _restorable(k)}) for m, _ in handle.modules
    ]
    originals = handle.original_buffers()
    try:
        for module, name, value in originals:
            rotary.set_buffer(module, name, value)
        for module, snap in handle.modules:
            _put_attrs(module, snap.attrs)
        yield
    finally:
        for module, buffers, attrs in saved:
            for name, value in buffers.items():
                rotary.set_buffer(module, name, value)
            _put_attrs(module, attrs)


def _snapshot_module(module: nn.Module, config) -> ModuleSnapshot:
    buffers = {k: v.detach().clone() for k, v in rotary.buffers(module).items()}
    attrs = {k: copy.copy(v) for k, v in module.__dict__.items() if _restorable(k)}
    return ModuleSnapshot(buffers, attrs, config)


def _restorable(key: str) -> bool:
    return (not key.startswith("_") or key in ROTARY_INSTALLED) and key not in _SKIP_ATTRS


def _put_attrs(module: nn.Module, attrs: dict[str, Any]) -> None:
    """Make ``attrs`` the module's restorable instance attributes (the runtime's ``forward`` among them)."""
    for key in [k for k in module.__dict__ if _restorable(k)]:
        if key not in attrs:
            del module.__dict__[key]
    module.__dict__.update(attrs)
