"""Position interpolation (PI, ``linear``).

Chen et al. 2023, "Extending Context Window of Large Language Models via Positional Interpolation";
kaiokendev (2023). Dividing every frequency by ``s`` is the same as dividing positions by ``s``:
``inv_freq'_i = theta_i / s``, attention scale 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import Geometry, Method, rope_frequencies
from .engine_form import LINEAR, Form
from .resolved import Scaling


@dataclass(frozen=True)
class LinearParams:
    """PI has no parameters beyond the factor."""


def linear(params: LinearParams, geo: Geometry, factor: float, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """``inv_freq' = theta / s``."""
    return rope_frequencies(geo.dim, geo.base) / factor, 1.0


def linear_form(scaling: Scaling, dim: int, base: float, at: int) -> Form:
    """Every engine's ``linear``, exactly."""
    return Form(LINEAR, float(base), scaling.factor, scaling.original_max_position_embeddings)


METHOD = Method(
    "linear",
    LinearParams,
    linear,
    rope_type="linear",
    in_transformers=True,
    source="Chen et al. 2023, Positional Interpolation",
    engine_form=linear_form,
)
