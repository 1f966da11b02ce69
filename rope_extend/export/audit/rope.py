"""What the audit compares: every engine model (llama.cpp, vLLM, SGLang) reduces a checkpoint to one ``Rope`` per
layer; ``differences`` says, per layer, what one engine computes that the reference does not.

A comparison asks whether two numbers are close, never whether they are not far apart: a NaN is close to nothing
(``abs(nan - x) > tol`` is false, which once let a NaN factor pass as "equal"). A ``Rope`` holds only finite
numbers besides: the values a file gives are checked before they are computed with, and whatever still comes out
non-finite is refused where the ``Rope`` is made.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import RopeExtendError

FREQ_RTOL = 1e-4  # float32 storage of frequencies and factors (GGUF keys and tensors) is good to ~1e-7
SCALE_RTOL = 1e-4
FACTOR_RTOL = 1e-6  # the factors two sides name, for the likely cause of a difference
MAX_LAYERS = 1 << 16  # the deepest models have some hundreds of layers; the report holds one entry per layer
MAX_ROTARY_DIM = 1 << 16  # head dimensions are at most some hundreds; the audit computes d/2 frequencies per type


@dataclass(frozen=True)
class Rope:
    """One layer's rotary embedding: ``freqs`` the inverse frequencies of the rotated pairs (float64, ``d/2``),
    ``scale`` the factor on cos and sin (transformers' ``attention_scaling``), ``what`` the settings that gave
    them, in the engine's own words; ``original`` and ``factor`` the original length and the factor those
    settings name (None where the type has none), which the likely cause of a difference compares."""

    freqs: np.ndarray
    scale: float
    what: str
    original: int | None = None
    factor: float | None = None

    def __post_init__(self):
        freqs = np.asarray(self.freqs, dtype=np.float64)
        bad = np.flatnonzero(~(np.isfinite(freqs) & (freqs >= 0)))
        if bad.size:
            raise RopeExtendError(
                f"{self.what}: gives frequency {freqs[bad[0]]} for pair {bad[0]} ({bad.size} of {freqs.size} not a "
                "finite number >= 0): not a rope the audit can compare"
            )
        if not (np.isfinite(self.scale) and self.scale > 0):
            raise RopeExtendError(
                f"{self.what}: gives cos/sin scale {self.scale}, not a finite number > 0: not a rope the audit can "
                "compare"
            )
        object.__setattr__(self, "freqs", freqs)


def close(got, want, rtol: float):
    """``|got - want| <= rtol |want|``, elementwise: relative closeness that is false for a NaN or an infinity on
    either side (and true for two zeros: the frequencies proportional RoPE never rotates)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.abs(np.asarray(got, dtype=np.float64) - want) <= rtol * np.abs(want)


def differences(got: Rope, want: Rope) -> list[str]:
    """What ``got`` (an engine) does differently from ``want`` (the reference); empty when equal within
    ``FREQ_RTOL`` / ``SCALE_RTOL``."""
    out = []
    if got.freqs.shape != want.freqs.shape:
        return [
            (
                f"rotates {2 * got.freqs.size} dimensions ({got.freqs.size} frequencies) where the reference rotates "
                f"{2 * want.freqs.size} ({want.freqs.size})"
            )
        ]
    bad = np.flatnonzero(~close(got.freqs, want.freqs, FREQ_RTOL))
    if bad.size:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = got.freqs / want.freqs
            relative = np.abs(got.freqs - want.freqs) / np.abs(want.freqs)
        worst = bad[np.argmax(np.nan_to_num(relative[bad], nan=np.inf))]
        out.append(
            f"{bad.size} of {got.freqs.size} frequencies differ (pairs {bad[0]}..{bad[-1]}; worst pair {worst}: "
            f"{got.freqs[worst]:.6g} vs {want.freqs[worst]:.6g}, x{ratio[worst]:.4g})"
        )
    if not close(got.scale, want.scale, SCALE_RTOL):
        out.append(f"cos/sin scale {got.scale:.6g} vs {want.scale:.6g}")
    return out
