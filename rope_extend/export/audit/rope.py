"""What one layer's rotary embedding is: its inverse frequencies and the scale on cos and sin, and how two differ.

Every engine model in this package (transformers, llama.cpp, vLLM, SGLang) reduces a checkpoint to one ``Rope`` per
layer; ``differences`` says, per layer, what one engine computes that the reference does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FREQ_RTOL = 1e-4  # float32 storage of frequencies and factors (GGUF keys and tensors) is good to ~1e-7
SCALE_RTOL = 1e-4


@dataclass(frozen=True)
class Rope:
    """One layer's rotary embedding: ``freqs`` the inverse frequencies of the rotated pairs (float64, ``d/2``),
    ``scale`` the factor on cos and sin (transformers' ``attention_scaling``), ``what`` the settings that gave
    them, in the engine's own words."""

    freqs: np.ndarray
    scale: float
    what: str


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
    ratio = got.freqs / want.freqs
    bad = np.flatnonzero(np.abs(ratio - 1.0) > FREQ_RTOL)
    if bad.size:
        worst = bad[np.argmax(np.abs(ratio[bad] - 1.0))]
        out.append(
            f"{bad.size} of {ratio.size} frequencies differ (pairs {bad[0]}..{bad[-1]}; worst pair {worst}: "
            f"{got.freqs[worst]:.6g} vs {want.freqs[worst]:.6g}, x{ratio[worst]:.4g})"
        )
    if abs(got.scale / want.scale - 1.0) > SCALE_RTOL:
        out.append(f"cos/sin scale {got.scale:.6g} vs {want.scale:.6g}")
    return out
