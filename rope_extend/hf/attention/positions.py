"""Where the query rows of one attention call are: position ids from the layer, the decoder, or the key slots;
and log-n's query scale, which reads them.

A layer's attention function is usually given ``position_ids``; some (Llama 4's, Persimmon's, Chameleon's) keep
them to themselves, and the decoder's forward pre-hook ``state.PositionKeeper`` records the forward's ids for
them (``keep_positions`` registers it).
Without either, the rows are the last ``n`` key slots (of a static layer: of its filled slots, ``hf.slots``).
"""

from __future__ import annotations

import torch
from torch import nn

from ...methods.attention import logn_scale
from .. import slots
from ..names import POSITIONS_HOOK
from .state import AttentionPlan, PositionKeeper


def keep_positions(decoder: nn.Module, planned) -> None:
    """Give the plans that need it (``keep_positions``) the decoder's ``PositionKeeper``, registered once."""
    wanting = [plan for _, plan in planned if plan.keep_positions]
    if not wanting:
        return
    if POSITIONS_HOOK not in decoder.__dict__:
        keeper = PositionKeeper()
        decoder.__dict__[POSITIONS_HOOK] = (keeper, decoder.register_forward_pre_hook(keeper, with_kwargs=True))
    for plan in wanting:
        plan.positions = decoder.__dict__[POSITIONS_HOOK][0]


def _query_slots(plan: AttentionPlan | None, module, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The key slots of the query rows ``(T,)``: the last ``n`` of the keys, or of a static layer's filled slots
    (a tensor offset: no host sync, so that torch.compile keeps it in the graph)."""
    n, m = query.shape[2], key.shape[2]
    end = slots.filled(plan.recorder if plan is not None else None, module, key)
    return torch.arange(n, device=query.device) + ((m if end is None else end) - n)


def _query_positions(position_ids, module, query, key, plan: AttentionPlan | None = None) -> torch.Tensor:
    """``(B, T)`` positions of the query rows: the layer's ``position_ids``, else the decoder's (``PositionKeeper``),
    else the query rows' key slots (``_query_slots``: the last ``n`` keys, or a static layer's filled slots)."""
    if position_ids is not None:
        return position_ids.expand(query.shape[0], -1)  # (1 | B, T) -> (B, T)
    kept = plan.positions.of(query) if plan is not None and plan.positions is not None else None
    if kept is not None:
        return kept
    return _query_slots(plan, module, query, key)[None].expand(query.shape[0], -1)  # (T,) -> (B, T)


def _logn(query: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """``query`` ``(B, H, T, D)`` times log-n's scale ``max(1, ln(p + 1) / ln L)`` at each row's position ``p``
    (``methods.attention.logn_scale``; Qwen-1's ``use_logn_attn``), in float32, cast back."""
    scale = logn_scale(positions, plan.original_max_position_embeddings)  # (B, T)
    return (query.float() * scale[:, None, :, None]).to(query.dtype)  # scale as (B, 1, T, 1)
