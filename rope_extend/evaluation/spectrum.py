"""The picture that explains the methods: per rotary dimension, how much each method scales its frequency.

For each method, ``ratio_i = inv_freq'_i / inv_freq_i`` (from ``rope_extend.inv_freq``) against the
dimension index ``i`` or against the original wavelength ``lambda_i = 2 pi / theta_i``. PI divides every
frequency by ``s`` (a flat line at ``1/s``); NTK leaves the fastest dimensions alone and interpolates the
slowest most; NTK-by-parts / YaRN / Llama 3 keep dimensions with ``lambda << L`` unchanged, interpolate those
with ``lambda > L`` by ``1/s``, and ramp between. Dynamic methods are drawn at the target length ``s * L``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import RopeExtendError
from ..methods import registry
from ..methods.registry import inv_freq
from ..plotting import legend_outside, styles
from .report import _pyplot, _save


def spectrum(
    methods: Sequence[str],
    *,
    factor: float,
    head_dim: int = 128,
    base: float = 10000.0,
    original_length: int = 4096,
    params: dict[str, dict[str, Any]] | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """``({method: {"ratio": [...], "attention_scale": a}}, {method: why it was skipped})``."""
    plain, _ = inv_freq("linear", head_dim, base, 1.0, original_length)
    curves, skipped = {}, {}
    for name in methods:
        method = registry.get(name)  # unknown names raise, listing the known ones
        seq_len = math.ceil(factor * original_length) if method.dynamic else None
        try:
            freqs, scale = inv_freq(
                name, head_dim, base, factor, original_length, seq_len=seq_len, **(params or {}).get(name, {})
            )
        except (RopeExtendError, TypeError) as exc:  # e.g. longrope needs its searched factors
            skipped[name] = str(exc)
            continue
        curves[name] = {"ratio": (freqs / plain).tolist(), "attention_scale": scale, "seq_len": seq_len}
    return curves, skipped


def plot_spectrum(
    curves: dict[str, dict[str, Any]],
    path: str | Path,
    *,
    factor: float,
    head_dim: int = 128,
    base: float = 10000.0,
    original_length: int = 4096,
    x: str = "wavelength",
) -> Path:
    """Frequency ratio (log y) vs dimension index or original wavelength (log x), one line per method, saved
    as a PNG (``spectrum_figure``)."""
    fig, _ = spectrum_figure(curves, factor=factor, head_dim=head_dim, base=base, original_length=original_length, x=x)
    return _save(fig, path)


def spectrum_figure(
    curves: dict[str, dict[str, Any]],
    *,
    factor: float,
    head_dim: int = 128,
    base: float = 10000.0,
    original_length: int = 4096,
    x: str = "wavelength",
):
    """``(fig, ax)`` of ``plot_spectrum``. Each method has its own colour, marker and dash
    (``rope_extend.plotting.styles``), and the markers of method ``k`` start ``k`` points in, so that curves
    that coincide (the attention-level methods all at 1; NTK-by-parts under YaRN, whose frequencies agree and
    whose attention scales differ) still show each method's marks side by side."""
    if x not in ("wavelength", "dim"):
        raise RopeExtendError(f"x must be 'wavelength' or 'dim', got {x!r}")
    if not curves:
        raise RopeExtendError("no method could be drawn (see the skipped methods)")
    plt = _pyplot()
    half = len(next(iter(curves.values()))["ratio"])
    dims = list(range(half))
    waves = [2 * math.pi * base ** (2 * i / (2 * half)) for i in dims]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    look = styles(list(curves))
    xs = waves if x == "wavelength" else dims
    every = max(len(curves) + 1, len(xs) // 8)
    for k, (name, c) in enumerate(curves.items()):
        notes = [f"at length {c['seq_len']}"] if c.get("seq_len") else []
        notes += [f"attn scale {c['attention_scale']:.3f}"] if abs(c["attention_scale"] - 1) > 1e-9 else []
        label = f"{name} ({', '.join(notes)})" if notes else name
        ax.plot(
            xs,
            c["ratio"],
            **look[name],
            markevery=(k % every, every),
            markersize=5,
            linewidth=1.6,
            alpha=0.9,
            label=label,
        )
    if x == "wavelength":
        ax.set_xscale("log")
        ax.axvline(original_length, color="grey", linewidth=0.8)
        ax.text(original_length, 1.0, f"  L = {original_length}", color="grey", fontsize=8, va="bottom")
        ax.set_xlabel("original wavelength 2π/θ_i (tokens)")
    else:
        ax.set_xlabel(f"rotary dimension index i (0 = fastest; d = {2 * half})")
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter

    plain_numbers = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain_numbers)
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
    ax.axhline(1 / factor, color="grey", linewidth=0.6, linestyle=":")
    ax.set_ylabel("frequency ratio θ'_i / θ_i (log)")
    ax.set_title(
        f"How each method scales each rotary frequency (s = {factor:g}, head_dim {head_dim}, base {base:g})",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3, which="both")
    legend_outside(ax)
    return fig, ax
