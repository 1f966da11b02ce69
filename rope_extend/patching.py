"""Patch a loaded model in place: swap its rotary frequencies, keep them float32, undo exactly.

``patch`` plans everything against the unpatched config (raising before anything is touched), writes the
scaling into the model's config, recomputes each rotary buffer on its device, and installs rope-extend's
rotary runtime (``hf.rotary``: float32 frequencies, dynamic methods). ``unpatch`` puts back the config,
every buffer and attribute, and the class's forward.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import nn

from .errors import NotPatchedError, RopeExtendError, UnsupportedModelError
from .hf import attach, attention, cache, generation, rotary, rotary_reads
from .hf import config as hf_config
from .methods import registry

logger = logging.getLogger("rope_extend")

STATE_ATTR = "_rope_extend_state"
_SKIP_ATTRS = ("training", "config")


# ------------------------------------------------------------------------------------------ state
@dataclass
class _ModuleSnapshot:
    buffers: dict[str, torch.Tensor]
    attrs: dict[str, Any]
    config: Any = None  # the config the module's frequencies come from


@dataclass
class PatchState:
    """What ``patch`` changed, to undo: config snapshots and module snapshots, plus the scaling applied."""

    scaling: registry.Scaling
    configs: list[tuple[Any, dict]] = field(default_factory=list)
    modules: list[tuple[nn.Module, _ModuleSnapshot]] = field(default_factory=list)
    hooks: list[tuple[nn.Module, int]] = field(default_factory=list)  # cache keepers patch installed (hf.attach)
    softmax: list[tuple[nn.Module, float]] = field(default_factory=list)  # MLA softmax scales before the patch
    attention: tuple[Any, Any, str, list[nn.Module]] | None = None  # (model, config, implementation before, modules)
    generation: nn.Module | None = None  # the model whose generate no longer warns past L (hf.generation)


class _SoftmaxScaled(Protocol):
    """An MLA attention module whose softmax scale is a float (``rotary.softmax_scales`` finds only those; torch
    types any module attribute ``Tensor | Module``)."""

    scaling: float


def _snapshot_module(module: nn.Module, config) -> _ModuleSnapshot:
    buffers = {k: v.detach().clone() for k, v in rotary.buffers(module).items()}
    attrs = {k: copy.copy(v) for k, v in module.__dict__.items() if _restorable(k)}
    return _ModuleSnapshot(buffers, attrs, config)


def _restorable(key: str) -> bool:
    return (not key.startswith("_") or key in rotary.INSTALLED) and key not in _SKIP_ATTRS


def _original_buffers(state: PatchState) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """``[(module, buffer name, original value)]`` on each buffer's current device. A buffer saved on the meta
    device (a model loaded with deferred weights) is recomputed from the unpatched config."""
    pristine = {}
    for config, config_snap in state.configs:
        pristine[id(config)] = copy.deepcopy(config)
        hf_config.restore(pristine[id(config)], config_snap)
    buffers = []
    for module, snap in state.modules:
        for name, value in snap.buffers.items():
            current = rotary.buffers(module).get(name)
            if value.device.type == "meta" and current is not None and current.device.type != "meta":
                config = pristine.get(id(snap.config), snap.config)
                value = rotary.original_frequencies(module, config, name, current.device)
            elif current is not None and current.device.type != "meta":
                value = value.to(current.device)
            buffers.append((module, name, value))
    return buffers


def _restore(state: PatchState) -> None:
    """Put every config and module back. All new values are computed first, so a failure changes nothing."""
    buffers = _original_buffers(state)
    for config, config_snap in state.configs:
        hf_config.restore(config, config_snap)
    for decoder, hook in state.hooks:
        cache.remove(decoder, hook)
    if state.attention is not None:
        attention.remove(*state.attention)
    if state.generation is not None:
        generation.remove(state.generation)
    for module, name, value in buffers:
        rotary.set_buffer(module, name, value)
    for module, scale in state.softmax:
        cast(_SoftmaxScaled, module).scaling = scale
    for module, snap in state.modules:
        _put_attrs(module, snap.attrs)


def _pristine_config(config, state: PatchState | None):
    """The config as it was before any patch (a copy when a patch is in place)."""
    if state is None:
        return config
    for cfg, snap in state.configs:
        if cfg is config:
            pristine = copy.deepcopy(config)
            hf_config.restore(pristine, snap)
            return pristine
    return config


def _plan(model, modules, state, method, *, factor, target_length, original_max_position_embeddings, params):
    """``(plans, scaling, shipped)``: per rotary module ``(module, config, {layer_type: Entry})``, checked
    against the unpatched configs (``hf.attach.entry``: the buffers hold what the config implies); raises before
    anything is touched. ``patch``'s length arguments and method ``params`` by name."""
    plans, scaling, shipped = [], None, set()
    for _, module in modules:
        config = rotary.module_config(model, module)
        pristine = _pristine_config(config, state)
        scaling = hf_config.plan(
            pristine,
            method,
            factor=factor,
            target_length=target_length,
            original_max_position_embeddings=original_max_position_embeddings,
            **params,
        )
        entries = {}
        present = rotary.module_layer_types(module)
        for lt in hf_config.scaled_layer_types(pristine):
            if lt not in present:
                continue
            entries[lt] = attach.entry(module, pristine, scaling, lt)
            old = hf_config.rope_dict(pristine, lt)
            if scaling.shipped is None and hf_config.split_rope_type(hf_config.rope_type_of(old))[1] != "default":
                shipped.add(f"{hf_config.rope_type_of(old)} ({old.get('factor')})")
            if scaling.shipped is not None and not hf_config.own_rope_type(
                hf_config.rope_type_of(old)
            ):  # transformers built it
                _check_kept(module, lt, entries[lt], state)
        if not entries:
            raise UnsupportedModelError(f"{type(module).__name__} has no global rotary frequencies to scale")
        scaled = copy.deepcopy(pristine)
        hf_config.write(scaled, scaling)
        rotary.check_rebuilds(module, scaled)
        plans.append((module, config, entries))
    return plans, scaling, shipped


def _check_kept(module: nn.Module, layer_type, entry: rotary.Entry, state: PatchState | None) -> None:
    """``keep_shipped`` keeps the frequencies and attention scale the model's rotary holds (as transformers built
    them, before any patch: ``original_inv_freq`` for a dynamic type, which starts there); rope-extend's reading of
    the shipped scaling must give them, within 4 units in the last place of the buffer's dtype, or the model is
    refused rather than run on other frequencies."""
    kept = entry.scaling.shipped
    if kept is None:  # keep_shipped not asked: no shipped frequencies to reproduce
        return
    snap = next((s for m, s in state.modules if m is module), None) if state is not None else None
    buffers, attrs = (snap.buffers, snap.attrs) if snap is not None else (rotary.buffers(module), module.__dict__)
    name = rotary.buffer_name(layer_type)
    held = buffers.get(name.replace("inv_freq", "original_inv_freq"), buffers.get(name))
    if held is None or held.device.type == "meta":
        return  # built from the config on meta: the frequencies come from the same reading of it
    freqs, scale = hf_config.frequencies(kept, entry.dim, entry.base, entry.rotating)
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


# ------------------------------------------------------------------------------------------ public
def patch(
    model: nn.Module, method: str, *, factor=None, target_length=None, original_max_position_embeddings=None, **params
) -> nn.Module:
    """Scale ``model``'s rotary embeddings with ``method``, in place, and return it.

    ``factor`` counts from the context the model ships with (``hf.config.shipped_context``): its pretraining
    length ``L`` (``original_max_position_embeddings`` if the config has it, else ``max_position_embeddings``),
    or, for a model that ships a scaling (Llama 3.1 ``llama3``, GPT-OSS ``yarn``, Phi-3 ``longrope``), the
    context that scaling gives. ``target_length`` is the alternative. The method replaces the shipped scaling
    on the plain RoPE frequencies, at ``target / L``, so a factor never shortens the usable context; a method
    whose reach is shorter than the shipped context (an attention method without a factor) is refused unless
    ``target_length`` asks for exactly that. A new patch replaces the previous one and never compounds. Gemma 3
    style models scale their global layers only; local sliding-window layers keep their rotary. Every argument
    is checked before the model is touched, and so is that the patch changes something: an attention method on
    a NoPE hybrid whose RoPE layers are all local (Cohere 2, EXAONE 4, Llama 4) has no layer to change and is
    refused; ``logn=True`` scales the NoPE layers' queries (alone: ``"linear"`` at ``factor=1``), and is
    refused on a model that applies its own temperature there (Llama 4's ``attn_temperature_tuning``). A
    frequency method on a model none of whose layers reads the rotary embedding (every layer linear attention
    or convolution, every attention layer NoPE: ``hf.rotary_reads.unread``, one probe forward) is refused too.

    ``keep_shipped=True`` (the attention methods, with or without ``logn``) keeps the shipped scaling instead:
    the rotary keeps its frequencies (``llama3``, ``yarn``, ``longrope`` switching at its ``L``, ``linear``) and
    its attention scale, times the method's own (STRING's factor, Dual Chunk's temperature), and the method
    re-rotates with them. Everything the method counts from ``L`` counts from the shipped context ``C``: its
    default parameters, reach, factor (``target / C``), log-n's ``ln L`` and Dual Chunk's temperature. That is the
    STRING authors' rule (HKUNLP/STRING, ``string_for_llama.py`` and its test scripts: Llama 3.1 keeps its llama3
    frequencies, ``L = max_position_embeddings = 131072``, ``shifted_offset = 0.33 L = 43253``), applied to every
    attention method. A frequency method with it is refused (it replaces the frequencies by definition); on a
    model that ships plain RoPE it changes nothing. The kept scaling is written into ``rope_parameters``
    (``shipped``), so a saved and reloaded model runs the same.

    Args:
        model: a loaded transformers model with rotary embeddings (a composite one included: its language model
            is patched).
        method: a registered method name (``rope_extend.method_names()``).
        factor: ``s = target / L``; give it or ``target_length``, not both (an attention method may take neither).
        target_length: the context to reach, in tokens.
        original_max_position_embeddings: ``L`` when the config's is not the pretraining length.
        **params: the method's own parameters (``beta_fast``, ``group_size``, ...), ``logn`` and
            ``keep_shipped``.

    Returns:
        ``model`` itself, patched in place.

    Raises:
        RopeExtendError: a bad argument (an unknown method or parameter, a value out of range).
        UnsupportedModelError: a model, layer or cache the method cannot run on exactly; nothing was changed.
    """
    state: PatchState | None = model.__dict__.get(STATE_ATTR)

    # 1. Plan everything against the unpatched configs; raise before touching anything.
    with hf_config.naming(getattr(model, "config", None) or model, method):
        modules = rotary.rotary_modules(model)
        plans, scaling, shipped = _plan(
            model,
            modules,
            state,
            method,
            factor=factor,
            target_length=target_length,
            original_max_position_embeddings=original_max_position_embeddings,
            params=params,
        )
        attention_plans = []
        config = hf_config.text_config(rotary.module_config(model, modules[0][1]))
        if scaling.in_attention:
            attention_plans = attention.plans(model, config, scaling, [m for _, m in modules])
        elif state is None:  # a model patched before passed this check; the answer is the model's, not the method's
            why = rotary_reads.unread(model, config, [m for _, m in modules], scaling.pretraining_length)
            if why is not None:
                raise UnsupportedModelError(why)
    if shipped and state is None:
        logger.warning(
            "the model ships with rope scaling %s; rope-extend replaces it (it does not compound): %s is applied "
            "to the plain RoPE frequencies (the factor counts from the shipped context)",
            ", ".join(sorted(shipped)),
            scaling.describe(),
        )

    # 2. Undo a previous patch, or remember the original state.
    if state is not None:
        _restore(state)
    configs = list({id(c): c for _, c, _ in plans}.values())
    state = PatchState(
        scaling,
        configs=[(c, hf_config.snapshot(c)) for c in configs],
        modules=[(m, _snapshot_module(m, c)) for m, c, _ in plans],
    )

    # 3. Apply.
    for config in configs:
        hf_config.write(config, scaling)
        for module, apply in rotary.softmax_scales(model, config):
            attention_module = cast(_SoftmaxScaled, module)
            state.softmax.append((module, attention_module.scaling))
            attention_module.scaling = rotary.softmax_scale(module, apply, config)
    for module, config, entries in plans:
        for lt, entry in entries.items():
            freqs, scale = entry.initial()
            rotary.set_frequencies(module, lt, freqs)
            setattr(module, rotary.scale_name(lt), scale)
            rotary.set_rope_type(module, lt, hf_config.rope_type_of(hf_config.rope_dict(config, lt)))
    attached = attach.attach(model, plans, scaling, attention_plans, [m for _, m in modules])
    state.hooks, state.attention, state.generation = attached.hooks, attached.attention, attached.generation
    model.__dict__[STATE_ATTR] = state
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo ``patch``: the config, every rotary buffer and attribute as they were (bit-identical logits).

    Args:
        model: a model ``patch`` patched.

    Returns:
        ``model`` itself, as it was before ``patch``.

    Raises:
        NotPatchedError: ``patch`` never touched ``model``.
    """
    state = model.__dict__.get(STATE_ATTR)
    if state is None:
        raise NotPatchedError(f"{type(model).__name__} was not patched by rope_extend.patch; nothing to undo")
    _restore(state)  # raises before changing anything, and then the patch stays in place and recorded
    del model.__dict__[STATE_ATTR]
    return model


def patched(model: nn.Module) -> registry.Scaling | None:
    """The scaling ``patch`` applied to ``model``, or None; its ``kernel`` names the attention that runs now (on
    the model's device): the model's own implementation for a frequency method (``'sdpa'``), and for an
    attention method the kernel of rope-extend's passes and what the layers it leaves alone keep
    (``'cpu_flash; other layers: sdpa'``; ``hf.attention.kernel``); for log-n alone the model's implementation,
    since it only scales the queries (of NoPE layers too) before it.

    Args:
        model: any model.

    Returns:
        The ``Scaling`` in force (method, parameters, factor, ``kernel``), or None for a model ``patch`` never
        touched (or one it undid).
    """
    state = model.__dict__.get(STATE_ATTR)
    if state is None:
        return None
    if state.attention is None:
        kernel = hf_config.attn_implementation(hf_config.text_config(model.config))
    else:
        kernel = attention.kernel(*state.attention)
    return dataclasses.replace(state.scaling, kernel=kernel)


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
    state = model.__dict__.get(STATE_ATTR)
    if state is None:
        raise NotPatchedError(f"{type(model).__name__} was not patched by rope_extend.patch; no original rope to use")
    if state.attention is not None or state.softmax:
        raise RopeExtendError(
            f"{state.scaling.method} changes the attention, not only the rotary frequencies: the original rope "
            "cannot be switched in for part of a run; use a frequency method (yarn, longrope, linear, ...)"
        )
    saved = [
        (m, dict(rotary.buffers(m)), {k: v for k, v in m.__dict__.items() if _restorable(k)}) for m, _ in state.modules
    ]
    originals = _original_buffers(state)
    try:
        for module, name, value in originals:
            rotary.set_buffer(module, name, value)
        for module, snap in state.modules:
            _put_attrs(module, snap.attrs)
        yield
    finally:
        for module, buffers, attrs in saved:
            for name, value in buffers.items():
                rotary.set_buffer(module, name, value)
            _put_attrs(module, attrs)


def _put_attrs(module: nn.Module, attrs: dict[str, Any]) -> None:
    """Make ``attrs`` the module's restorable instance attributes (the runtime's ``forward`` among them)."""
    for key in [k for k in module.__dict__ if _restorable(k)]:
        if key not in attrs:
            del module.__dict__[key]
    module.__dict__.update(attrs)
