"""Everything ``rope_extend.patch`` will change in a model, computed and checked before anything is touched.

``plan`` returns one ``PatchPlan``: the scaling, each text config's edit (``hf.config.ConfigEdit``: computed once,
written into one copy that transformers validated and that each rotary module's class rebuilds from), each rotary
module's frequency sets (``hf.rotary_plan.RotaryPlan``, checked against its buffers, their frequencies the ones the edit
computed) and the attention method's plans (``hf.attention.plans``; none for a frequency method). It raises before
anything is touched; ``hf.installed.install`` puts the plan into the model.

A model patched before is planned against its configs and buffers as they were before that patch (``previous``,
the handle of the patch in place): a new patch replaces the previous one and never compounds.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..methods.resolved import Scaling
from . import attention, rotary, rotary_reads
from . import config as hf_config
from .attention.state import AttentionPlan
from .config import ConfigEdit, edit
from .reading import frequencies, naming, rope_dict, scaled_layer_types, text_config
from .rope_types import own_rope_type, rope_type_of, split_rope_type
from .rotary_plan import RotaryPlan, entry

logger = logging.getLogger("rope_extend")


@dataclass
class ModuleSnapshot:
    """A rotary module before a patch: its buffers and restorable instance attributes, and the config its
    frequencies come from."""

    buffers: dict[str, torch.Tensor]
    attrs: dict[str, Any]
    config: Any = None


class Previous(Protocol):
    """A patch in place (``hf.installed.Installed``), as the planner reads it: the configs and rotary modules as
    they were before it."""

    def pristine(self, config) -> Any: ...

    def snapshot(self, module: nn.Module) -> ModuleSnapshot | None: ...


@dataclass(frozen=True)
class Request:
    """What ``patch`` was asked: the method, its reach (``factor`` or ``target_length``), ``L`` when the config's is
    not the pretraining length, and the method's own parameters (``logn`` and ``keep_shipped`` among them)."""

    method: str
    factor: float | None = None
    target_length: int | None = None
    original_max_position_embeddings: int | None = None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ConfigPlan:
    """One text config of the model (several rotary modules may share it) and its edit."""

    config: Any  # the model's own config object, which ``install`` writes
    pristine: Any  # the config as it was before any patch: ``config`` itself, or a copy when a patch is in place
    edit: ConfigEdit


@dataclass(frozen=True)
class PatchPlan:
    """A patch, planned: ``install`` puts it into the model, without another check."""

    scaling: Scaling
    configs: list[ConfigPlan]
    rotaries: list[RotaryPlan]
    attention: list[tuple[nn.Module, AttentionPlan]]  # empty for a frequency method
    modules: list[nn.Module]  # every text rotary module (the attention layers rotate with them)


def plan(model: nn.Module, request: Request, previous: Previous | None) -> PatchPlan:
    """Plan ``request`` on ``model`` (patched by ``previous``, or not); raises before anything is touched, with
    the family and the method named (``hf.reading.naming``)."""
    with naming(getattr(model, "config", None) or model, request.method):
        modules = [m for _, m in rotary.rotary_modules(model)]
        configs: dict[int, ConfigPlan] = {}
        rotaries: list[RotaryPlan] = []
        replaced: set[str] = set()
        for module in modules:
            config = rotary.module_config(model, module)
            if id(config) not in configs:
                pristine = previous.pristine(config) if previous is not None else config
                configs[id(config)] = ConfigPlan(config, pristine, _edit(pristine, request))
            planned = configs[id(config)]
            entries = _entries(module, planned, previous, replaced)
            rotary.check_rebuilds(module, planned.edit.scaled)
            rotaries.append(RotaryPlan(module, config, entries))
        scaling = next(iter(configs.values())).edit.scaling
        text = text_config(rotaries[0].config)
        planned_attention = []
        if scaling.in_attention:
            planned_attention = attention.plans(model, text, scaling, modules)
        elif previous is None:  # a model patched before passed this check; the answer is the model's, not the method's
            why = rotary_reads.unread(model, text, modules, scaling.pretraining_length)
            if why is not None:
                raise UnsupportedModelError(why)
    if replaced and previous is None:
        logger.warning(
            "the model ships with rope scaling %s; rope-extend replaces it (it does not compound): %s is applied "
            "to the plain RoPE frequencies (the factor counts from the shipped context)",
            ", ".join(sorted(replaced)),
            scaling.describe(),
        )
    return PatchPlan(scaling, list(configs.values()), rotaries, planned_attention, modules)


def _edit(config, request: Request) -> ConfigEdit:
    return edit(
        config,
        request.method,
        factor=request.factor,
        target_length=request.target_length,
        original_max_position_embeddings=request.original_max_position_embeddings,
        **copy.copy(request.params),  # ``edit`` takes keep_shipped out of them
    )


def _entries(
    module: nn.Module, planned: ConfigPlan, previous: Previous | None, replaced: set[str]
) -> dict[str | None, rotary.Entry]:
    """The module's frequency sets under the edit (``hf.rotary_plan.entry``: the buffers hold what the config implies),
    their frequencies the ones the edit computed; adds to ``replaced`` each shipped scaling the method replaces."""
    before, scaling = planned.pristine, planned.edit.scaling
    entries = {}
    present = rotary.module_layer_types(module)
    for lt in scaled_layer_types(before):
        if lt not in present:
            continue
        entries[lt] = entry(module, before, scaling, lt, planned.edit.frequencies[lt])
        old = rope_dict(before, lt)
        if scaling.shipped is None and split_rope_type(rope_type_of(old))[1] != "default":
            replaced.add(f"{rope_type_of(old)} ({old.get('factor')})")
        if scaling.shipped is not None and not own_rope_type(rope_type_of(old)):  # transformers built it
            _check_kept(module, lt, entries[lt], previous)
    if not entries:
        raise UnsupportedModelError(f"{type(module).__name__} has no global rotary frequencies to scale")
    return entries


def _check_kept(module: nn.Module, layer_type, planned: rotary.Entry, previous: Previous | None) -> None:
    """``keep_shipped`` keeps the frequencies and attention scale the model's rotary holds (as transformers built
    them, before any patch: ``original_inv_freq`` for a dynamic type, which starts there); rope-extend's reading of
    the shipped scaling must give them, within 4 units in the last place of the buffer's dtype, or the model is
    refused rather than run on other frequencies."""
    kept = planned.scaling.shipped
    if kept is None:  # keep_shipped not asked: no shipped frequencies to reproduce
        return
    snap = previous.snapshot(module) if previous is not None else None
    buffers, attrs = (snap.buffers, snap.attrs) if snap is not None else (rotary.buffers(module), module.__dict__)
    name = rotary.buffer_name(layer_type)
    held = buffers.get(name.replace("inv_freq", "original_inv_freq"), buffers.get(name))
    if held is None or held.device.type == "meta":
        return  # built from the config on meta: the frequencies come from the same reading of it
    freqs, scale = frequencies(kept, planned.dim, planned.base, planned.rotating)
    held_scale = float(attrs.get(rotary.scale_name(layer_type), 1.0))
    tolerance = 4 * torch.finfo(held.dtype).eps
    if not torch.allclose(freqs, held.detach().float().cpu(), rtol=tolerance, atol=0) or not math.isclose(
        scale, held_scale, rel_tol=tolerance
    ):
        off = (freqs - held.detach().float().cpu()).abs().max().item()
        raise UnsupportedModelError(
            f"keep_shipped: rope-extend's {kept.describe()} does not reproduce {type(module).__name__}'s own "
            f"frequencies (off by up to {off:.3g}) and attention scale ({scale:.6g} against {held_scale:.6g}), so it "
            "cannot keep them exactly; leave keep_shipped out to replace them"
        )


def pristine_copy(config, snap: dict[str, Any]):
    """A copy of ``config`` as ``snap`` (``hf.config.snapshot``) recorded it, before a patch wrote it."""
    out = copy.deepcopy(config)
    hf_config.restore(out, snap)
    return out
