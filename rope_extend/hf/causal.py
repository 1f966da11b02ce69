"""Is a layer's attention plain causal attention? The attention methods' position rules assume it.

Each method gives the pair (query ``i``, key ``j <= i``) a relative position ``rel(i, j)`` (docs/methods.md); the
method attention computes exactly those pairs, under the model's mask. A layer that attends a key after its query
(PaliGemma's bidirectional prefix, an encoder, Gemma 3's bidirectional image blocks, a custom 4D mask), or that adds
a bias of its own to the scores (Doge's dynamic mask on transformers 5.17), is something else: computing its causal
pairs only would change the model without saying so. Such a layer is refused: at ``patch`` when the probe's
token-ids-only forward shows it (``problem`` on the module and the mask it was given), and at the forward for a
mask that only some inputs bring (``check``).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

BLOCK = 1024  # query rows per pass when a FlexAttention mask is evaluated


def flag(module: nn.Module, is_causal) -> str | None:
    """Why the layer is not causal by its flags (the module's ``is_causal``, or one passed to the call)."""
    if getattr(module, "is_causal", True) is False or is_causal is False:
        return "attends bidirectionally (is_causal=False)"
    return None


def dense(mask: torch.Tensor, n: int, m: int) -> str | None:
    """Why a 4D mask ``[b, 1|h, n, m]`` (booleans, True: attend; or additive floats) is not a causal one: query row
    ``r`` sits at key slot ``m - n + r``, and no row may see a later slot. A float mask must hold 0 and large
    negative numbers only (transformers writes the dtype's minimum; -inf too)."""
    mask = mask[..., -n:, :m] if mask.shape[-2] >= n else mask[..., :m]
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        low = torch.finfo(mask.dtype).min / 2
        allowed = mask > low
        if bool((allowed & (mask != 0)).any()):  # one host sync
            return "adds a bias of its own to the attention scores (its mask holds values other than 0 and -inf)"
    rows = torch.arange(mask.shape[-2], device=mask.device)[:, None] + (m - mask.shape[-2])
    later = torch.arange(m, device=mask.device)[None, :] > rows
    if bool((allowed & later).any()):
        return "lets queries attend keys after them (a bidirectional or prefix mask)"
    return None


def flex(block_mask, n: int, m: int) -> str | None:
    """``dense``'s check for a FlexAttention ``BlockMask``, by evaluating its ``mask_mod`` on the pairs after each
    query, ``BLOCK`` rows at a time: transformers' mask functions are index-based and broadcast, and take the query
    row (``0 .. n-1``; the mask adds the cache offset itself) and the key slot, as ``attention.Mask.block`` does."""
    batch = torch.arange(block_mask.kv_indices.shape[0], device=block_mask.kv_indices.device)[:, None, None, None]
    head = torch.zeros((), dtype=torch.long, device=batch.device)
    cols = torch.arange(m, device=batch.device)[None, None, None, :]
    for start in range(0, n, BLOCK):
        r = torch.arange(start, min(start + BLOCK, n), device=batch.device)[None, None, :, None]
        if bool((block_mask.mask_mod(batch, head, r, cols) & (cols > r + (m - n))).any()):
            return "lets queries attend keys after them (a bidirectional or prefix mask)"
    return None


_last: tuple | None = None  # (weak reference to the last mask checked, n, m): the layers of a forward share it


def check(module: nn.Module, attention_mask, n: int, m: int, is_causal=None) -> str | None:
    """Why this call of a layer is not causal attention over ``n`` queries and ``m`` keys, or None. A mask is checked
    once per forward: the layers that share it are not checked again. A FlashAttention padding mask ``[b, m]`` says
    nothing about causality (its kernel takes that from the module's flag)."""
    global _last
    why = flag(module, is_causal)
    if why is not None or attention_mask is None:
        return why
    if _last is not None and _last[0]() is attention_mask and _last[1:] == (n, m):
        return None
    if isinstance(attention_mask, torch.Tensor):
        if attention_mask.dim() != 4:
            return None
        why = dense(attention_mask, n, m)
    elif hasattr(attention_mask, "mask_mod"):
        why = flex(attention_mask, n, m)
    if why is None:
        try:
            _last = (weakref.ref(attention_mask), n, m)
        except TypeError:  # not weakly referenceable: checked at every layer
            _last = None
    return why
