"""What a patched attention module carries, and the names rope-extend's attention is known by.

One state object per patched module: its ``AttentionPlan``, kept in the module's ``__dict__`` under
``PLAN_ATTR`` (``install`` puts it there, ``remove`` takes it away; every such name is in ``hf.names``). The rotary module the layers share keeps the
passes' work space under ``WORKSPACE_ATTR``; the decoder keeps the probe hook under ``PROBE_HOOK`` and its
``PositionKeeper`` under ``POSITIONS_HOOK``. The bottom of the package: it imports nothing else of it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...methods.attention import Rules
from .. import layout as rope_layout
from .. import slots

NAME = "rope_extend"
INNER = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


@dataclass(kw_only=True)
class AttentionPlan:
    """What one attention module does: rules (None: plain attention), log-n, and where its rotary lives.

    Mutable on purpose: ``install`` completes it (``recorder``, ``positions``) and a model planned before its weights
    were loaded gets its ``layout`` at its first forward."""

    inner: str  # the implementation the model used before (one of INNER)
    rules: Rules | None
    logn: bool
    original_max_position_embeddings: int
    layout: rope_layout.Layout | None = None  # how the layer rotates (``hf.layout``); None until the model is probed
    method: str = ""  # the method's name, for messages
    runner: Any = None  # ``forward._method_attention`` kept out of torch.compile graphs, named for the method
    recorder: slots.CacheRecorder | None = None  # the decoder's record of the running forward's cache (hf.slots)
    keep_positions: bool = False  # a method or log-n on a layer whose attention function is given no position ids
    positions: PositionKeeper | None = None  # where it reads them then (``install`` sets it)

    @property
    def active(self) -> bool:
        return self.rules is not None or self.logn


class PositionKeeper:
    """The decoder's forward pre-hook that keeps the position ids of the forward under way, per thread, for
    the methods and log-n on layers whose attention function is not given them (Llama 4's decoder layers keep
    ``position_ids`` to themselves). The ids the decoder was called with (``generate`` gives left-padded rows their true
    positions); without them, what the decoder computes itself: ``cache_position``, else the cache's length
    onwards."""

    def __init__(self):
        self.local = threading.local()

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("position_ids")
        if ids is None:
            tokens = kwargs.get("input_ids", args[0] if args else None)
            tokens = tokens if tokens is not None else kwargs.get("inputs_embeds")
            ids = kwargs.get("cache_position")
            if ids is None and tokens is not None:
                cache = rope_layout.cache_argument(kwargs)
                past = int(cache.get_seq_length()) if cache is not None else 0
                ids = torch.arange(past, past + tokens.shape[1], device=tokens.device)
        self.local.ids = ids

    def of(self, query: torch.Tensor) -> torch.Tensor | None:
        """``(B, T)`` position ids of ``query``'s rows, or None when the forward under way gave none that fit."""
        ids = getattr(self.local, "ids", None)
        b, n = query.shape[0], query.shape[2]
        if ids is None or ids.dim() > 2 or ids.shape[-1] != n or (ids.dim() == 2 and ids.shape[0] not in (1, b)):
            return None
        return ids.reshape(-1, n).expand(b, -1)  # (T,) | (1 | B, T) -> (B, T)


def attention_modules(model: nn.Module, config) -> list[nn.Module]:
    """The decoder's attention modules: modules with a ``layer_idx`` that carry ``config``."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "layer_idx", None), int)
        and getattr(m, "config", None) is config
        and type(m).__name__.endswith("Attention")
    ]
