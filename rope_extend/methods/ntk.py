"""NTK-aware scaling, static (``ntk``) and dynamic (``dynamic``).

bloc97 (2023), "NTK-Aware Scaled RoPE"; emozilla (2023), "Dynamically Scaled RoPE"; Peng et al. 2023,
"YaRN", eq. 16 and section 3.3. Instead of squeezing positions, raise the base so the lowest frequency
is interpolated and the highest is left alone: ``b' = b * alpha ** (d / (d - 2))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import RopeExtendError
from ._common import Geometry, Method, check_number, rope_frequencies


def ntk_base(base: float, alpha: float, dim: int) -> float:
    """``b' = b * alpha ** (d / (d - 2))``."""
    if dim <= 2:
        raise RopeExtendError(f"NTK scaling needs a rotary dimension > 2 (its exponent is d/(d-2)), got {dim}")
    return base * alpha ** (dim / (dim - 2))


@dataclass(frozen=True)
class NTKParams:
    """``alpha``: the base multiplier's root; defaults to the factor ``s``."""

    alpha: float | None = None

    def __post_init__(self):
        if self.alpha is not None:
            check_number("alpha", self.alpha, minimum=1.0)


def ntk(params: NTKParams, geo: Geometry, factor: float, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """Plain RoPE with base ``b * alpha ** (d/(d-2))``, ``alpha = s`` unless given; scale 1."""
    alpha = factor if params.alpha is None else params.alpha
    return rope_frequencies(geo.dim, ntk_base(geo.base, alpha, geo.dim)), 1.0


@dataclass(frozen=True)
class DynamicParams:
    """Dynamic NTK has no parameters beyond the factor."""


def dynamic_alpha(factor: float, original_max_position_embeddings: int, seq_len: int | None) -> float:
    """``s_l = max(1, s * l / L - (s - 1))`` with ``l`` the current length (``L`` when unknown).

    Measured against the original length ``L``; transformers' ``dynamic`` measures against
    ``max_position_embeddings``, which does nothing below the extended length once that is raised.
    """
    length = original_max_position_embeddings if seq_len is None else seq_len
    return max(1.0, factor * length / original_max_position_embeddings - (factor - 1))


def dynamic(params: DynamicParams, geo: Geometry, factor: float, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """``ntk`` with ``alpha = s_l`` at the current length; scale 1."""
    alpha = dynamic_alpha(factor, geo.original_max_position_embeddings, seq_len)
    return rope_frequencies(geo.dim, ntk_base(geo.base, alpha, geo.dim)), 1.0


NTK = Method("ntk", NTKParams, ntk, rope_type="ntk", source="bloc97 2023; YaRN paper eq. 16")
DYNAMIC = Method(
    # Not transformers' `dynamic`: that one measures length against max_position_embeddings.
    "dynamic",
    DynamicParams,
    dynamic,
    rope_type="dynamic_ntk",
    dynamic=True,
    source="emozilla 2023; YaRN paper section 3.3",
)
