"""Llama 3.1 frequency scaling (``llama3``).

Meta (2024), "The Llama 3 Herd of Models" and the Llama 3.1 release. Wavelengths shorter than
``L / high_freq_factor`` are kept, longer than ``L / low_freq_factor`` are divided by ``s``, and the
band between is blended with ``smooth = (L / lambda - low) / (high - low)``:
``inv_freq' = (1 - smooth) * theta / s + smooth * theta``. Attention scale 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import RopeExtendError
from ._common import Geometry, Method, check_number, rope_frequencies
from .engine_form import LLAMA3, Form
from .resolved import Scaling


@dataclass(frozen=True)
class Llama3Params:
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self):
        low = check_number("low_freq_factor", self.low_freq_factor, above=0.0)
        high = check_number("high_freq_factor", self.high_freq_factor, above=0.0)
        if high <= low:
            raise RopeExtendError(f"high_freq_factor must be greater than low_freq_factor, got {high} <= {low}")


def llama3(params: Llama3Params, geo: Geometry, factor: float, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """See the module docstring; the operations follow transformers' so the numbers match exactly."""
    theta = rope_frequencies(geo.dim, geo.base)
    if factor == 1.0:  # exactly plain RoPE; the blend below would round the last bit
        return theta, 1.0
    length = geo.original_max_position_embeddings
    low, high = params.low_freq_factor, params.high_freq_factor
    wavelen = 2 * math.pi / theta
    scaled = torch.where(wavelen > length / low, theta / factor, theta)
    smooth = (length / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < length / high) * ~(wavelen > length / low)
    return torch.where(medium, blended, scaled), 1.0


def llama3_form(scaling: Scaling, dim: int, base: float, at: int) -> Form:
    """Every engine's ``llama3``, exactly."""
    p = scaling.params
    values = {"low_freq_factor": float(p.low_freq_factor), "high_freq_factor": float(p.high_freq_factor)}
    return Form(LLAMA3, float(base), scaling.factor, scaling.original_max_position_embeddings, 1.0, values)


METHOD = Method(
    "llama3",
    Llama3Params,
    llama3,
    rope_type="llama3",
    in_transformers=True,
    source="Llama 3.1 (Meta 2024)",
    engine_form=llama3_form,
)
