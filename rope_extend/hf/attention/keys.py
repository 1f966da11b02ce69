"""Kept keys: the cached keys in the form a pass reads them, kept beside the cache so a decode step turns only
the new ones.

A pass whose keys move (Self-Extend's grouped keys at ``floor(j / G)``, ReRoPE's far keys at 0, leaky ReRoPE's at
``j / k``) reads every cached key turned by ``key_position(j) - j``. That turn depends on the key's position only,
never on the query's, so the turned key of slot ``u`` is the same at every step: a decode step that turned every
cached key again (``passes._rotate``) spent about the attention's own time on it. Here each key group's turned keys
are kept in a second tensor on the cache layer (``KEPT_ATTR``), and a step turns only the slots added since the
last one: with the same cos and sin, the same operations, so the same bits as turning them all.

The cost is memory: one more key tensor per layer and moving key group, in the passes' dtype (``compute_dtype``:
float32 for a float32 model, the model's for bf16/fp16), with a quarter of headroom so that steps append in place.

A kept copy must never be read after the cache changed under it. It is used only where the layer's keys are
exactly transformers' append-only ``DynamicLayer`` of a plain ``DynamicCache`` (``torch.cat`` of the old keys and
the new: the kept slots are still the first ones), and a forward pre-hook on the attention module
(``check``) confirms before each call that the layer still holds the very tensor the copy was made from
(identity and in-place version): a crop, a beam reorder, an eviction or a keeper's turn replace or change that
tensor, and the copy is dropped and rebuilt from all the keys. Every other cache (static, sliding-window,
quantized, offloaded (``offloading=True``), ``SinkCache``, an encoder-decoder cache), prefill (more than
``passes.REUSE_ROWS`` rows), autograd and a batch whose rows sit at different positions take the per-step turn,
which gives the same numbers. ``KEEP = False`` turns kept keys off (the benchmark's and tests' switch).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import slots
from ..names import KEPT_ATTR, KEPT_HOOK, PLAN_ATTR

KEEP = True  # keep turned keys beside a DynamicCache (set here: the functions below read it)


@dataclass
class _Kept:
    """One cache layer's kept keys: per key group a tensor ``(B, H_kv, capacity, D)`` whose first ``filled`` slots
    hold the layer's key slots ``offset ..`` turned for that group."""

    owner: object  # the layout that turned them (the same module's plan)
    offset: int  # the first cache slot kept (slots before it are padding at negative positions)
    first: int  # that slot's position
    spaces: dict = field(default_factory=dict)  # group -> [tensor, filled]
    source: weakref.ref | None = None  # the layer's key tensor once the copy was brought up to date
    version: int = -1  # that tensor's in-place version then
    valid: bool = False  # confirmed by ``check`` for the call under way


def holder(plan, module: nn.Module, key: torch.Tensor):
    """The cache layer whose keys ``key`` is, when kept keys can be used for it: ``KEEP``, a plain
    ``DynamicCache`` (not offloaded) with a full ``DynamicLayer`` (append-only), and ``key`` its key tensor itself;
    else None."""
    if not KEEP:
        return None
    from transformers.cache_utils import DynamicCache, DynamicLayer

    cache = plan.recorder.cache if plan.recorder is not None else None
    if type(cache) is not DynamicCache:  # subclasses (SinkCache, quantized caches) change keys in their own ways
        return None
    if getattr(cache, "offloading", False):  # moved off the device between layers: a kept copy would stay on it
        return None
    layer = slots.layer_of(plan.recorder, module)
    if type(layer) is not DynamicLayer or getattr(layer, "keys", None) is not key:
        return None
    return layer


def reserve(layer, group: str, *, owner, shape, dtype, offset: int, first: int) -> tuple[torch.Tensor, int]:
    """Space for keys of ``shape`` ``(B, H_kv, S, D)`` (the layer's slots ``offset ..``, at positions ``first ..``)
    turned for ``group`` by ``owner`` (the layer's layout), in ``dtype``: ``(tensor (B, H_kv, S, D), done)``, where
    the first ``done`` slots already hold them (kept from the steps before) and the caller turns the rest into it.
    ``done`` is 0 when nothing valid was kept."""
    kept = layer.__dict__.get(KEPT_ATTR)
    if kept is None:
        kept = layer.__dict__[KEPT_ATTR] = _Kept(owner=owner, offset=offset, first=first, valid=True)
    elif not kept.valid or kept.owner is not owner or (kept.offset, kept.first) != (offset, first):
        # stale: every slot is turned again, into the same memory (a beam search reorders the cache every step)
        kept.owner, kept.offset, kept.first, kept.valid = owner, offset, first, True
        for entry in kept.spaces.values():
            entry[1] = 0
    b, h, m, d = shape
    device = layer.keys.device
    space, done = kept.spaces.get(group, (None, 0))
    if space is not None and (space.shape[:2] != (b, h) or space.shape[3] != d or space.dtype != dtype):
        space, done = None, 0
    done = min(done, m)
    if space is None or space.shape[2] < m:  # grown by a quarter, so the next steps append in place
        grown = torch.empty(b, h, m + m // 4 + 1, d, dtype=dtype, device=device)
        if done:
            grown[:, :, :done] = space[:, :, :done]
        space = grown
    kept.spaces[group] = [space, m]
    return space[:, :, :m], done


def seal(layer) -> None:
    """After a call brought the copies up to the layer's keys: remember which key tensor they match."""
    kept = layer.__dict__.get(KEPT_ATTR)
    if kept is not None:
        kept.source, kept.version, kept.valid = weakref.ref(layer.keys), layer.keys._version, False


def drop(layer) -> None:
    """Forget the layer's kept keys (a call that did not bring them up to date)."""
    if layer is not None:
        layer.__dict__.pop(KEPT_ATTR, None)


def check(module: nn.Module, _args) -> None:
    """Forward pre-hook on an attention module, before its cache update: the kept copy is valid for this call only
    if the layer still holds the key tensor it was made from, unchanged (else every slot is turned again)."""
    plan = module.__dict__.get(PLAN_ATTR)
    layer = slots.layer_of(plan.recorder, module) if plan is not None else None
    kept = layer.__dict__.get(KEPT_ATTR) if layer is not None else None
    if kept is None:
        return
    keys = getattr(layer, "keys", None)
    kept.valid = (
        kept.source is not None and kept.source() is keys and keys is not None and keys._version == kept.version
    )


def install(modules) -> None:
    """``check`` on every module (once)."""
    for module in modules:
        if KEPT_HOOK not in module.__dict__:
            module.__dict__[KEPT_HOOK] = module.register_forward_pre_hook(check)


def remove(modules) -> None:
    for module in modules:
        handle = module.__dict__.pop(KEPT_HOOK, None)
        if handle is not None:
            handle.remove()
