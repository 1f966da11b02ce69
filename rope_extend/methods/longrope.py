"""LongRoPE (``longrope``): searched per-dimension rescale factors.

Ding et al. 2024, "LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens"; Phi-3.
``inv_freq'_i = theta_i / f_i`` with ``f = short_factor`` while the length ``l <= L`` and
``long_factor`` beyond; attention scale ``sqrt(1 + ln(s) / ln(L))`` (1 when ``s <= 1``) unless given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import RopeExtendError
from ._common import Geometry, Method, check_number


def _factors(name: str, value) -> tuple[float, ...]:
    if value is None:
        raise RopeExtendError(
            f"longrope needs {name}: a list of d/2 rescale factors (one per rotary frequency), e.g. from "
            "a LongRoPE search or a Phi-3 config"
        )
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise RopeExtendError(f"{name} must be a list of numbers, got {value!r}")
    out = tuple(value)
    for i, f in enumerate(out):
        check_number(f"{name}[{i}]", f, above=0.0)
    return tuple(float(f) for f in out)


@dataclass(frozen=True)
class LongRopeParams:
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "short_factor", _factors("short_factor", self.short_factor))
        object.__setattr__(self, "long_factor", _factors("long_factor", self.long_factor))
        if len(self.short_factor) != len(self.long_factor):
            raise RopeExtendError(
                f"short_factor and long_factor must have the same length, got "
                f"{len(self.short_factor)} and {len(self.long_factor)}"
            )
        if self.attention_factor is not None:
            check_number("attention_factor", self.attention_factor, above=0.0)


def longrope_attention_scale(factor: float, original_max_position_embeddings: int) -> float:
    """``sqrt(1 + ln(s) / ln(L))``, 1 when ``s <= 1``."""
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original_max_position_embeddings))


def longrope(params: LongRopeParams, geo: Geometry, factor: float, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """See the module docstring; the operations follow transformers' so the numbers match exactly."""
    long = seq_len is not None and seq_len > geo.original_max_position_embeddings
    factors = (params.long_factor if long else params.short_factor) or ()  # both set: __post_init__ checked them
    if len(factors) != geo.dim // 2:
        raise RopeExtendError(
            f"longrope {'long' if long else 'short'}_factor has {len(factors)} entries; the rotary dimension "
            f"{geo.dim} needs d/2 = {geo.dim // 2}"
        )
    ext = torch.tensor(factors, dtype=torch.float32)
    shape = torch.arange(0, geo.dim, 2, dtype=torch.int64).float() / geo.dim
    inv_freq = 1.0 / (ext * geo.base**shape)
    scale = params.attention_factor
    if scale is None:
        scale = longrope_attention_scale(factor, geo.original_max_position_embeddings)
    return inv_freq, float(scale)


METHOD = Method(
    "longrope",
    LongRopeParams,
    longrope,
    rope_type="longrope",
    dynamic=True,
    in_transformers=True,
    source="Ding et al. 2024, LongRoPE; Phi-3",
)
