"""NTK-by-parts, YaRN and dynamic YaRN.

Peng, Quesnelle, Fan, Shippole 2023, "YaRN: Efficient Context Window Extension of Large Language
Models", sections 3.2-3.4. Frequencies that turn many times inside the original context (``r_i = L /
lambda_i > beta_fast``) are kept; those that turn less than ``beta_slow`` times are interpolated as in
PI; a linear ramp over the dimension index blends the band between:

    low  = floor(d ln(L / (beta_fast 2 pi)) / (2 ln b)),  high = ceil(d ln(L / (beta_slow 2 pi)) / (2 ln b))
    ramp_i = clamp((i - low) / (high - low), 0, 1)
    inv_freq'_i = (theta_i / s) ramp_i + theta_i (1 - ramp_i)

YaRN adds the attention temperature ``0.1 ln(s) + 1`` on cos and sin (so logits grow by its square).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import RopeExtendError
from . import engine_form
from ._common import Geometry, Method, check_number, rope_frequencies
from .engine_form import Form
from .resolved import Scaling


def correction_range(
    dim: int,
    base: float,
    original_max_position_embeddings: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool = True,
) -> tuple[float, float]:
    """The ramp's ends ``(low, high)`` in dimension-index units, clamped to ``[0, d - 1]``."""

    def index_for(rotations: float) -> float:
        return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = index_for(beta_fast), index_for(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def ramp(low: float, high: float, size: int) -> torch.Tensor:
    """``clamp((i - low) / (high - low), 0, 1)`` for ``i = 0 .. size-1``; a zero-width ramp is widened."""
    if low == high:
        high += 0.001  # as in the reference code: avoids dividing by zero
    return torch.clamp((torch.arange(size, dtype=torch.float32) - low) / (high - low), 0, 1)


def by_parts_frequencies(
    geo: Geometry, factor: float, beta_fast: float, beta_slow: float, truncate: bool
) -> torch.Tensor:
    """NTK-by-parts inverse frequencies (operations ordered as in transformers' yarn, for equal bits)."""
    if factor == 1.0:  # exactly plain RoPE; the blend below would round the last bit
        return rope_frequencies(geo.dim, geo.base)
    powers = geo.base ** (torch.arange(0, geo.dim, 2).to(torch.float32) / geo.dim)
    extrapolation = 1.0 / powers  # theta_i, unchanged
    interpolation = 1.0 / (factor * powers)  # theta_i / s
    low, high = correction_range(
        geo.dim, geo.base, geo.original_max_position_embeddings, beta_fast, beta_slow, truncate
    )
    keep = 1 - ramp(low, high, geo.dim // 2)
    return interpolation * (1 - keep) + extrapolation * keep


def mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's temperature ``0.1 m ln(s) + 1``, 1 when ``s <= 1``."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


@dataclass(frozen=True)
class NTKByPartsParams:
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def __post_init__(self):
        fast = check_number("beta_fast", self.beta_fast, above=0.0)
        slow = check_number("beta_slow", self.beta_slow, above=0.0)
        if fast <= slow:
            raise RopeExtendError(f"beta_fast must be greater than beta_slow, got {fast} <= {slow}")
        if not isinstance(self.truncate, bool):
            raise RopeExtendError(f"truncate must be true or false, got {self.truncate!r}")


@dataclass(frozen=True)
class YarnParams(NTKByPartsParams):
    """``attention_factor`` overrides the temperature; ``mscale``/``mscale_all_dim`` give DeepSeek's form
    ``mscale(s, mscale) / mscale(s, mscale_all_dim)`` when both are set."""

    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self):
        super().__post_init__()
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), above=0.0)


@dataclass(frozen=True)
class DynamicYarnParams(YarnParams):
    """``finetuned``: the model was fine-tuned with YaRN at ``factor``; keep ``s`` up to ``s L``."""

    finetuned: bool = False

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.finetuned, bool):
            raise RopeExtendError(f"finetuned must be true or false, got {self.finetuned!r}")


def yarn_attention_scale(params: YarnParams, factor: float) -> float:
    if params.attention_factor is not None:
        return float(params.attention_factor)
    if params.mscale and params.mscale_all_dim:
        return float(mscale(factor, params.mscale) / mscale(factor, params.mscale_all_dim))
    return mscale(factor)


def ntk_by_parts(params: NTKByPartsParams, geo: Geometry, factor: float, seq_len: int | None):
    """The ramp of section 3.2; attention scale 1."""
    return by_parts_frequencies(geo, factor, params.beta_fast, params.beta_slow, params.truncate), 1.0


def yarn(params: YarnParams, geo: Geometry, factor: float, seq_len: int | None):
    """NTK-by-parts frequencies with the attention temperature of section 3.4."""
    inv_freq = by_parts_frequencies(geo, factor, params.beta_fast, params.beta_slow, params.truncate)
    return inv_freq, yarn_attention_scale(params, factor)


def dynamic_yarn_factor(
    factor: float, original_max_position_embeddings: int, seq_len: int | None, finetuned: bool
) -> float:
    """``s_l = max(1, l / L)``; a model fine-tuned at ``s`` keeps ``s`` up to ``s L``: ``max(s, l / L)``."""
    length = original_max_position_embeddings if seq_len is None else seq_len
    return max(factor if finetuned else 1.0, length / original_max_position_embeddings)


def dynamic_yarn(params: DynamicYarnParams, geo: Geometry, factor: float, seq_len: int | None):
    """``yarn`` at the factor ``s_l`` of the current length (section 3.3 and the reference code)."""
    s = dynamic_yarn_factor(factor, geo.original_max_position_embeddings, seq_len, params.finetuned)
    return yarn(params, geo, s, seq_len)


def yarn_form(scaling: Scaling, dim: int, base: float, at: int) -> Form:
    """Every engine's YaRN: ``ntk_by_parts`` is YaRN with the attention factor 1 (section 3.2), exactly.
    ``dynamic_yarn`` changes with the length: YaRN at ``s`` is the standard static form every engine and a model
    fine-tuned with YaRN at ``s`` share, which is ``dynamic_yarn``'s ``l / L`` at ``l = T``; below the target it
    differs (unless ``finetuned``), and the patched model rounds ``l`` up to its grid (``at``) at the target too
    (YaRN at ``1052 / 256 = 4.11`` at ``L = 256``, ``T = 1024``), so engines take it only on request."""
    p, s, length = scaling.params, scaling.factor, scaling.original_max_position_embeddings
    scale = yarn_attention_scale(p, s) if isinstance(p, YarnParams) else 1.0
    values: dict[str, Any] = {
        "beta_fast": float(p.beta_fast),
        "beta_slow": float(p.beta_slow),
        "truncate": bool(p.truncate),
    }
    changes = ""
    if isinstance(p, DynamicYarnParams) and not p.finetuned:
        changes = (
            f"dynamic YaRN made static at factor {s:g}: below the target every position uses YaRN at "
            f"{s:g}, where rope-extend's dynamic_yarn is plain RoPE up to L={length} "
            "(the same as finetuned=true from L on); at the target itself the patched model, which rounds "
            f"the length up to its re-rotation grid, runs YaRN at {at / length:.4g}"
        )
    return Form(engine_form.YARN, float(base), s, length, float(scale), values, changes)


NTK_BY_PARTS = Method(
    "ntk_by_parts",
    NTKByPartsParams,
    ntk_by_parts,
    rope_type="ntk_by_parts",
    source="Peng et al. 2023, YaRN section 3.2",
    engine_form=yarn_form,
)
YARN = Method(
    "yarn",
    YarnParams,
    yarn,
    rope_type="yarn",
    in_transformers=True,
    source="Peng et al. 2023, YaRN section 3.4",
    engine_form=yarn_form,
)
DYNAMIC_YARN = Method(
    "dynamic_yarn",
    DynamicYarnParams,
    dynamic_yarn,
    rope_type="dynamic_yarn",
    dynamic=True,
    source="Peng et al. 2023, YaRN section 3.3",
    engine_form=yarn_form,
)
