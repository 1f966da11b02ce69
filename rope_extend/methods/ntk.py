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
from .engine_form import DEFAULT, Form
from .resolved import Scaling


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


def ntk_form(scaling: Scaling, dim: int, base: float, at: int) -> Form:
    """Plain RoPE at the base ``b * alpha ** (d / (d - 2))`` (bloc97 2023): every engine takes it, exactly."""
    s, alpha = scaling.factor, scaling.params.alpha
    alpha = s if alpha is None else alpha
    return Form(DEFAULT, ntk_base(float(base), alpha, dim), s, scaling.original_max_position_embeddings)


def dynamic_form(scaling: Scaling, dim: int, base: float, at: int) -> Form:
    """Dynamic NTK made static: the base the patched model uses for a sequence of the target's length (the same
    function at the same rounded length ``at``: past ``L`` the patched model computes dynamic frequencies at the
    next length of its re-rotation grid, so at ``L = 256``, ``T = 1024`` its alpha is 13.44, not the 13.0 of
    ``s T / L - (s - 1)`` at ``T`` itself), so that the served model is the patched one at the target. Below the
    target it differs (there the patched model is plain RoPE up to ``L``), so engines take it only on request."""
    s, length = scaling.factor, scaling.original_max_position_embeddings
    alpha = dynamic_alpha(s, length, at)
    return Form(
        DEFAULT,
        ntk_base(float(base), alpha, dim),
        s,
        length,
        changes=f"dynamic NTK made static at the target {scaling.target_length} (base x {alpha:g}^(d/(d-2)), the "
        f"patched model's base at the target: it computes dynamic frequencies at {at}, the target rounded up to its "
        f"re-rotation grid): below the target every position uses this base, where rope-extend's dynamic is "
        f"plain RoPE up to L={length}",
    )


NTK = Method("ntk", NTKParams, ntk, rope_type="ntk", source="bloc97 2023; YaRN paper eq. 16", engine_form=ntk_form)
DYNAMIC = Method(
    # Not transformers' `dynamic`: that one measures length against max_position_embeddings.
    "dynamic",
    DynamicParams,
    dynamic,
    rope_type="dynamic_ntk",
    dynamic=True,
    source="emozilla 2023; YaRN paper section 3.3",
    engine_form=dynamic_form,
)
