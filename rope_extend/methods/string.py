"""STRING: shifted rotary positions (An et al. 2024, "Why Does the Effective Context Length of LLMs Fall
Short?"; the authors' code is HKUNLP/STRING, ``string_for_llama.py``).

Pretraining sees small relative positions far more often than large ones, so the largest ones are poorly
trained and a model's effective context is shorter than its trained length ``L``. STRING drops the relative
positions at and above ``L - S`` and moves the well-trained ones over them: for query ``i`` and key ``j``

    i - j <  S:  relative position i - j                 (kind ``near``: true positions)
    i - j >= S:  relative position i - j - S + W          (kind ``far``: query at i - S + W, key at j)

with the shifted offset ``S`` (the authors: ``0.33 x`` the test length, 0.25-0.4 suggested) and a small local
window ``W`` (default 128) that keeps the far keys apart from the nearest ones. The largest relative position
at length ``n`` is ``n - 1 - S + W``; it stays below ``L`` up to ``n = L + S - W``, so STRING also reaches a
little past the trained length. ``S`` here is fixed (default ``int(0.33 L)``, the authors' value when the test
length is ``L``); the authors' scripts recompute it per test length, which a cache cannot follow.

The authors also multiply RoPE's cos and sin by ``attention_factor = 1 + 0.1 ln 2`` (their comment: STRING
smooths the attention map, and the factor restores its sharpness, as YaRN's does), so every logit is scaled by
its square; it is this method's attention scale, and ``attention_factor=1`` turns it off.

On a model that ships a rope scaling the authors keep it: their Llama 3.1 rotary computes the llama3 frequencies
from ``rope_scaling`` (plain RoPE without one), ``L`` is ``config.max_position_embeddings`` (131072) and ``S`` is
``0.33 L`` = 43253, their 128k headline setting. ``keep_shipped=True`` does the same (the method's ``L`` is the
shipped context ``C``); by default rope-extend replaces a shipped scaling and ``L`` is the pretraining length.

One difference from the authors' prefill kernel: its neighbour pass (FlashAttention, ``window_size=[S, 0]``)
includes the key at distance exactly ``S``, which its shifted pass includes too, so that one key is counted
twice in prefill but once in their decoding. Here every pair belongs to exactly one kind, as in their decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import RopeExtendError
from ._common import MAX_ATTENTION_FACTOR, TOO_HOT, Geometry, Method, check_int, check_number, rope_frequencies
from .attention import _Windowed

DEFAULT_SHIFT_RATIO = 0.33
DEFAULT_LOCAL_WINDOW = 128
DEFAULT_ATTENTION_FACTOR = 1 + 0.1 * math.log(2)


class StringRules(_Windowed):
    """``near`` below the shifted offset ``S`` (the window of ``_Windowed``); ``far``: query ``i - S + W``,
    key ``j``."""

    def __init__(self, shifted_offset: int, local_window: int):
        super().__init__(shifted_offset)
        self.local_window = local_window

    def _far_query(self, i):
        return i - (self.window - self.local_window)

    def _far_key(self, j):
        return j

    def moves_keys(self, kind):
        return False  # only the far queries move


@dataclass(frozen=True)
class StringParams:
    """``shifted_offset`` S in ``[2, L)`` (default ``int(0.33 L)``); ``local_window`` W in ``[1, S)`` (default
    128, or ``S // 2`` when S is small); ``attention_factor`` > 0 multiplies cos and sin (default
    ``1 + 0.1 ln 2``, the authors')."""

    shifted_offset: int | None = None
    local_window: int | None = None
    attention_factor: float = DEFAULT_ATTENTION_FACTOR
    USABLE = ("L + shifted_offset - local_window", "raise shifted_offset, lower local_window, or lower the factor")

    def __post_init__(self):
        if self.shifted_offset is not None:
            check_int("shifted_offset", self.shifted_offset, minimum=2)
        if self.local_window is not None:
            check_int("local_window", self.local_window, minimum=1)
        check_number("attention_factor", self.attention_factor, above=0.0)
        if self.attention_factor > MAX_ATTENTION_FACTOR:
            raise RopeExtendError(
                f"attention_factor must be <= {MAX_ATTENTION_FACTOR:g}, got {self.attention_factor!r} ({TOO_HOT})"
            )

    def rules(self, length: int) -> StringRules:
        shift = max(2, int(DEFAULT_SHIFT_RATIO * length)) if self.shifted_offset is None else self.shifted_offset
        if shift >= length:
            raise RopeExtendError(f"shifted_offset must be < the original length L={length}, got {shift}")
        local = min(DEFAULT_LOCAL_WINDOW, shift // 2) if self.local_window is None else self.local_window
        if local >= shift:
            raise RopeExtendError(f"local_window must be < shifted_offset ({shift}), got {local}")
        return StringRules(shift, local)

    def usable_length(self, length: int) -> int:
        """``L + S - W``: the longest sequence whose relative positions all stay below ``L``."""
        rules = self.rules(length)
        return length + rules.window - rules.local_window


def _compute(params: StringParams, geo: Geometry, factor: float, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """Plain RoPE frequencies; the attention scale is the authors' ``attention_factor`` on cos and sin."""
    params.rules(geo.original_max_position_embeddings)
    return rope_frequencies(geo.dim, geo.base), float(params.attention_factor)


STRING = Method(
    "string",
    StringParams,
    _compute,
    rope_type="string",
    attention=True,
    source='An et al. 2024, "Why Does the Effective Context Length of LLMs Fall Short?" (STRING)',
)
