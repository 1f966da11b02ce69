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
from .engine_form import LONGROPE, Form
from .resolved import Scaling


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
        short, long = _factors("short_factor", self.short_factor), _factors("long_factor", self.long_factor)
        object.__setattr__(self, "short_factor", short)
        object.__setattr__(self, "long_factor", long)
        if len(short) != len(long):
            raise RopeExtendError(
                f"short_factor and long_factor must have the same length, got {len(short)} and {len(long)}"
            )
        if self.attention_factor is not None:
            check_number("attention_factor", self.attention_factor, above=0.0)


def longrope_attention_scale(factor: float, original_max_position_embeddings: int) -> float:
    """``sqrt(1 + ln(s) / ln(L))``, 1 when ``s <= 1``."""
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original_max_position_embeddings))


def critical_dimension(dim: int, base: float, original_max_position_embeddings: int) -> int:
    """The first rotary dimension whose period the pretraining length ``L`` did not cover (an even index in
    ``0 .. dim``; its frequency pair is half of it).

    Dimension ``i`` (even) turns at ``theta_i = base^(-i/d)``, a period of ``2 pi base^(i/d)`` tokens, which
    reaches ``L`` once ``i >= d log_base(L / 2 pi)``:
    ``d_tcd = 2 ceil((d / 2) log_base(L / (2 pi)))``, clipped to ``[0, d]``.
    Liu et al. 2023, "Scaling Laws of RoPE-based Extrapolation" (the critical dimension for extrapolation; 92 of
    128 for LLaMA2's base 10000 and L 4096), taken up by Shang et al. 2025, "LongRoPE2" (arXiv 2502.20082),
    section 3, as the theoretical critical dimension that bounds its search. For Llama-3-8B (base 500000, head
    dimension 128, L 8192) the formula gives 70; for SmolLM2-135M (100000, 64, 8192) 40.
    """
    if not (isinstance(dim, int) and not isinstance(dim, bool) and dim >= 2 and dim % 2 == 0):
        raise RopeExtendError(f"the rotary dimension must be an even integer >= 2, got {dim!r}")
    check_number("base", base, above=1.0)
    L = original_max_position_embeddings
    if not (isinstance(L, int) and not isinstance(L, bool) and L >= 1):
        raise RopeExtendError(
            f"original_max_position_embeddings must be a positive integer, got {original_max_position_embeddings!r}"
        )
    ratio = L / (2 * math.pi)
    if ratio <= 1.0:  # even the fastest dimension's period (2 pi tokens) is longer than L
        return 0
    pairs = math.ceil(round(dim / 2 * math.log(ratio) / math.log(base), 9))  # round: 35.0000000001 stays 35
    return min(dim, 2 * pairs)


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


def longrope_form(scaling: Scaling, dim: int, base: float, at: int) -> Form:
    """Every engine's ``longrope`` (short and long factors switched at ``L``), with the attention scale at the
    target."""
    p = scaling.params
    scale = scaling.compute(dim, base, scaling.target_length)[1]
    if p.short_factor is None or p.long_factor is None:  # LongRopeParams refuses either missing when built
        raise ValueError("longrope parameters without short_factor or long_factor")
    values = {"short_factor": list(p.short_factor), "long_factor": list(p.long_factor)}
    return Form(LONGROPE, float(base), scaling.factor, scaling.original_max_position_embeddings, scale, values)


METHOD = Method(
    "longrope",
    LongRopeParams,
    longrope,
    rope_type="longrope",
    dynamic=True,
    in_transformers=True,
    source="Ding et al. 2024, LongRoPE; Phi-3",
    engine_form=longrope_form,
)
