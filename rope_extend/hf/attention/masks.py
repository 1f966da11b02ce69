"""The mask a method layer honours, whatever implementation built it, as booleans (True: attend).

transformers builds a different mask per implementation: SDPA and eager a 4D mask (boolean or additive),
FlashAttention a ``[B, S]`` padding mask (the sliding window applied by its kernel), FlexAttention a
``BlockMask``. A method's passes read any of them as the boolean block of the query rows and key slots they
cover (``Mask.block``), so the passes are written once.
"""

from __future__ import annotations

import torch

from ...errors import UnsupportedModelError
from .state import NAME


def _additive(mask: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """A boolean mask (True: attend) as eager attention's additive one."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def _allowed(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A mask as booleans (True: attend)."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


class Mask:
    """The mask a method layer honours, as booleans (True: attend) over query rows ``0 .. n-1`` and key slots
    ``0 .. m-1``, whatever implementation built it:

    - ``dense``: the SDPA / eager 4D mask ``(B | 1, 1 | H, T, S)``, sliced;
    - ``padding``: FlashAttention's padding mask ``(B, S)`` (None without padding), with the layer's
      ``sliding_window``, which FlashAttention's kernel applies itself;
    - ``flex``: FlexAttention's ``BlockMask``, whose ``mask_mod`` is evaluated on the indices of each block
      (transformers' mask functions are index-based and broadcast).

    ``block`` gives ``(B, 1 | H, rows, cols)``, or None when it allows every pair. ``index`` (a ``LongTensor`` of
    batch rows, or None: all) narrows it to some rows of the batch (``rows``)."""

    def __init__(self, kind: str, data, n: int, m: int, device, *, window: int | None = None, index=None):
        self.kind, self.data, self.n, self.m, self.device = kind, data, n, m, device
        self.window, self.index = window, index

    @classmethod
    def of(cls, attention_mask, query: torch.Tensor, key: torch.Tensor, inner: str, window=None) -> Mask | None:
        """The mask of one call.

        Args:
            attention_mask: what transformers passed to the attention function for ``inner``.
            query: ``(B, H, T, D)``.
            key: ``(B, H_kv, S, D)``, already cut at the newest key (``hf.slots``).
            inner: the implementation that built the mask (one of ``state.INNER``).
            window: the layer's ``sliding_window`` (FlashAttention's kernel applies it, not its mask).

        Returns:
            The mask, or None when it allows every pair (no padding, no window).
        """
        n, m, device = query.shape[2], key.shape[2], query.device
        if inner == "flex_attention":
            return cls("flex", attention_mask, n, m, device) if attention_mask is not None else None
        if inner.startswith("flash"):
            if attention_mask is None and not window:
                return None
            if attention_mask is not None and attention_mask.shape[-1] != m:
                raise UnsupportedModelError(
                    f"{NAME} attention got a FlashAttention padding mask of {attention_mask.shape[-1]} keys for "
                    f"{m} keys, so it cannot tell which keys it masks; use a DynamicCache"
                )
            pad = None if attention_mask is None else attention_mask.bool()
            return cls("padding", pad, n, m, device, window=window)
        return cls("dense", _allowed(attention_mask), n, m, device) if attention_mask is not None else None

    def rows(self, index: torch.Tensor | None) -> Mask:
        """The mask of the batch rows ``index`` (None: all)."""
        if index is None:
            return self
        return Mask(self.kind, self.data, self.n, self.m, self.device, window=self.window, index=index)

    def _take(self, t: torch.Tensor) -> torch.Tensor:
        # (B, ...) -> (B', ...): the rows of ``index``; a tensor of one row serves every batch row as it is
        return t if self.index is None or t.shape[0] == 1 else t.index_select(0, self.index)

    def block(self, rows: slice, cols: slice) -> torch.Tensor | None:
        """``(B, 1 | H, rows, cols)`` booleans for query rows ``rows`` and key slots ``cols``; None: all allowed."""
        if self.kind == "dense":
            return self._take(self.data)[:, :, rows, cols]
        r = torch.arange(rows.start, rows.stop, device=self.device)[None, None, :, None]  # (1, 1, rows, 1)
        c = torch.arange(cols.start, cols.stop, device=self.device)[None, None, None, :]  # (1, 1, 1, cols)
        if self.kind == "flex":
            batch = self.index
            if batch is None:
                batch = torch.arange(self.data.kv_indices.shape[0], device=self.device)
            head = torch.zeros((), dtype=torch.long, device=self.device)
            allow = self.data.mask_mod(batch[:, None, None, None], head, r, c)  # batch as (B, 1, 1, 1)
            allow = allow.expand(batch.shape[0], 1, r.shape[2], c.shape[3])  # (B, 1, rows, cols)
        else:
            allow = None
            if self.data is not None:
                pad = self._take(self.data)[:, None, None, cols]  # (B, S) -> (B, 1, 1, cols)
                allow = pad.expand(pad.shape[0], 1, r.shape[2], pad.shape[-1])  # (B, 1, rows, cols)
            if self.window:  # row r is at slot m - n + r; FlashAttention keeps keys less than the window behind
                inside = (self.m - self.n + r) - c < self.window  # (1, 1, rows, cols)
                allow = inside if allow is None else allow & inside
        return None if bool(allow.all()) else allow
