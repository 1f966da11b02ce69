"""The attention methods on M-RoPE models: exact on text positions, image and video tokens refused.

M-RoPE (multimodal RoPE, Qwen2-VL, Wang et al. 2024; Qwen2.5-VL, Qwen3-VL and Qwen3.5 interleave its sections,
GLM-4V, Ernie 4.5 VL; HunYuan-VL's XD-RoPE has 4 axes) gives each token one position per axis (time, height,
width) and turns each section of the frequencies (``rope_parameters.mrope_section``) by its axis's position. A
token whose axes all equal ``p`` is turned by ``p theta_i`` on every frequency: plain 1-D RoPE at ``p``, which
``hf.layout.probe`` matches like any other layer. Text tokens are such tokens: at their index in a text-only
input, after an image at their index shifted by the model's ``rope_deltas`` (the image takes fewer positions
than tokens).

The attention methods run on those 1-D positions, read where the rotation reads them: ``Guard.rotary``, a
forward pre-hook on the text rotary module, keeps axis 0 of the positions it is called with, and the attention
function uses them (``positions``) instead of the ``position_ids`` it receives, which are not the rotation's:
None (Qwen2-VL's and Qwen2.5-VL's forward without ``generate``, HunYuan-VL, GLM-4V), the text-only row of
``generate``'s 4-row ids (sequence indices: not shifted after an image), or the three axes (Ernie 4.5 VL,
GLM-4V-MoE), depending on the family and the transformers version.

Image and video tokens have distinct axes. The methods' position rules are one-dimensional and assume
positions that grow along the sequence (a key no later than its query, distances counted back from the
diagonal); inside an image no axis does (the width restarts at every row, the height at every frame). So a
forward whose rotary positions differ between axes is refused before the layers run (one host sync a forward,
folded with the check for positions below 0, which the methods would take for padding). A KV cache must have
been filled by forwards this check saw: ``Guard.decoded`` records on the cache, after each forward, its length
and the Guard, and ``Guard.decoder`` refuses a cache recorded by no Guard or another one, or longer than recorded
(filled before the patch: an image prompt run unpatched, say, then decoded at the shifted ``rope_deltas``).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from ..errors import UnsupportedModelError
from . import layout as rope_layout
from .names import GUARD_ATTR, LENGTH_ATTR
from .reading import family, nested_layer_types, rope_dict

AXES = {3: "temporal, height and width", 4: "four XD-RoPE"}


def sections(config) -> list[int] | None:
    """The ``mrope_section`` of ``config`` (any of its layer types' rope dicts), None for a 1-D RoPE model."""
    for layer_type in nested_layer_types(config) or (None,):
        found = (rope_dict(config, layer_type) or {}).get("mrope_section")
        if found is not None:
            return list(found)
    return None


def axes(position_ids: torch.Tensor, config) -> torch.Tensor:
    """The per-axis positions ``[axes, b | 1, n]`` of the ``[rows, b | 1, n]`` position ids an M-RoPE decoder
    receives: ``generate`` puts a text-only row before the axes (one row more than ``mrope_section`` has
    sections), which the decoder strips before its rotary."""
    found = sections(config)
    return position_ids[1:] if found is not None and position_ids.shape[0] == len(found) + 1 else position_ids


class Guard:
    """The hooks and the positions of one patched M-RoPE model (see the module docstring)."""

    def __init__(self, name: str, scaling):
        self.family = name  # as ``patch`` names the model in its refusals: the top config's model_type
        method = scaling.method
        self.label = method.name if method.attention else f"log-n (with {method.name})"
        self.rule = "position rule" if method.attention else "scale"
        self.positions: dict[int, torch.Tensor] = {}  # per thread: axis 0 of the last rotary call, [b | 1, n]
        self.handles: list = []  # of its hooks

    def _refuse(self, why: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{self.label} on {self.family}: {why}")

    def rotary(self, module: nn.Module, args, kwargs) -> None:
        """Forward pre-hook of the text rotary module ``(x, position_ids[, layer_type])``: refuse tokens whose
        axes differ or whose position is below 0, keep axis 0 for the attention function."""
        given = args[1] if len(args) > 1 else kwargs.get("position_ids")
        if given is None:
            return
        axes = given if given.dim() == 3 else given[None]  # [axes, b | 1, n]; a 2-D one is the same on every axis
        differ, negative = torch.stack([(axes != axes[:1]).any(), (axes[0] < 0).any()]).tolist()  # one host sync
        if differ:
            what = AXES.get(axes.shape[0], f"{axes.shape[0]} M-RoPE")
            raise self._refuse(
                f"image and video tokens have distinct {what} positions (M-RoPE) and {self.label}'s {self.rule} "
                "is one-dimensional; text-only inputs are supported (all axes equal: plain RoPE)"
            )
        if negative:
            raise self._refuse(
                "a token's M-RoPE position is below 0 (rope_deltas left from an earlier image prompt?), and the "
                "attention methods take positions below 0 for padding; run the prompt from its start"
            )
        self.positions[threading.get_ident()] = axes[0]

    def decoder(self, module: nn.Module, args, kwargs) -> None:
        """Forward pre-hook of the text decoder: refuse a KV cache this Guard did not see filled. Under one Guard
        every forward of the model is seen, so a cache may be shorter than recorded (cropped by assisted or
        prompt-lookup decoding), never longer; a cache recorded by an earlier patch may have been extended
        unpatched since."""
        cache = rope_layout.cache_argument(kwargs)
        past = _length(cache)
        seen, length = cache.__dict__.get(LENGTH_ATTR, (None, 0)) if past else (None, 0)
        if past and (seen is not self or past > length):
            raise self._refuse(
                f"the KV cache holds {past} tokens that this patched model did not compute (filled before the "
                "patch, or by an unpatched forward), so whether they are text (one M-RoPE position) or image "
                "tokens cannot be told; run the prompt again with the patched model"
            )

    def decoded(self, module: nn.Module, args, kwargs, output) -> None:
        """Forward hook of the text decoder: record the length of the cache the forward filled (the one it was
        given, or the one it made)."""
        cache = rope_layout.cache_argument(kwargs)
        if cache is None and callable(getattr(output, "get", None)):  # a ModelOutput
            cache = rope_layout.cache_argument(output)
        past = _length(cache)
        if past:
            cache.__dict__[LENGTH_ATTR] = (self, past)


def _length(cache) -> int:
    if cache is None or not hasattr(cache, "get_seq_length"):
        return 0
    return int(cache.get_seq_length())


def positions(module: nn.Module, given: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """The positions the attention methods use for the ``n`` query rows of ``module``: on an M-RoPE model axis 0
    of what its rotary module was last called with (its last ``n``: Qwen4-Exp's rotary also turns the cached
    keys), else ``given`` (the ``position_ids`` the layer passed)."""
    guard = module.__dict__.get(GUARD_ATTR)
    if guard is None:
        return given
    kept = guard.positions.get(threading.get_ident())
    return kept[:, -n:] if kept is not None else given


def install(model: nn.Module, config, scaling, rotary: list[nn.Module]) -> None:
    """For an M-RoPE ``config``, a ``Guard`` hooked on the ``rotary`` modules and the text decoder, kept on the
    decoder for ``attach``; nothing for a 1-D one."""
    remove(model, ())
    if sections(config) is None:
        return
    guard = Guard(family(getattr(model, "config", None) or config), scaling)
    decoder = rope_layout.decoder_of(model)
    guard.handles = [m.register_forward_pre_hook(guard.rotary, with_kwargs=True) for m in rotary]
    guard.handles.append(decoder.register_forward_pre_hook(guard.decoder, with_kwargs=True))
    guard.handles.append(decoder.register_forward_hook(guard.decoded, with_kwargs=True))
    decoder.__dict__[GUARD_ATTR] = guard


def attach(model: nn.Module, modules) -> None:
    """Point the attention ``modules`` at the model's ``Guard`` (``positions`` reads it), if it has one."""
    guard = rope_layout.decoder_of(model).__dict__.get(GUARD_ATTR)
    for module in modules if guard is not None else ():
        module.__dict__[GUARD_ATTR] = guard


def remove(model: nn.Module, modules) -> None:
    guard = rope_layout.decoder_of(model).__dict__.pop(GUARD_ATTR, None)
    for handle in guard.handles if guard is not None else ():
        handle.remove()
    for module in modules:
        module.__dict__.pop(GUARD_ATTR, None)
