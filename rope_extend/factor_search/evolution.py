"""The LongRoPE search space and its evolution operators, on plain lists of numbers.

Ding et al. 2024, "LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens", section 3.2. A candidate
is one rescale factor per rotary frequency pair, ``lambda_0 .. lambda_{d/2-1}`` from the highest frequency to
the lowest, applied as ``inv_freq'_i = theta_i / lambda_i``. The paper's constraints:

- non-decreasing, ``lambda_i <= lambda_{i+1}``: low frequencies are interpolated at least as much as high ones;
- bounded, ``1 <= lambda_i <= 1.25 s`` for an extension ratio ``s`` (the paper's range), on a grid of 0.01.

LongRoPE2 (Shang et al. 2025, "LongRoPE2: Near-Lossless LLM Context Window Scaling", section 3.2, Algorithms 1
and 2) splits the factors at the critical dimension (``methods.longrope.critical_dimension``; here its
frequency pair ``c``, ``Space.for_critical``): only the pairs from ``c`` on are searched, in
``s <= lambda_i <= 2 s`` (the paper's search space; at least position interpolation's, whose bound the RoPE OOD
theory sets), non-decreasing; the pairs below ``c`` are not searched but follow NTK scaling from the critical
pair's factor, ``lambda_i = lambda_c^(i / c)`` (the base that turns pair ``c`` by ``1 / lambda_c``, applied below
it). The authors' search code does the same (J-shang/LongRoPE, branch dev/nishang/omni,
evolution/algorithms/dim_mono.py: mutation and crossover touch the pairs from the critical one on, then set the
lower ones from it).

``repair`` maps any list into that space (clip, then running maximum, then round up to the grid, so the
order survives rounding; in LongRoPE2's space, then the pairs below ``c`` set from pair ``c``); mutation and
crossover end with it, so every candidate they make is valid.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import RopeExtendError

STEP = 0.01  # the paper's grid


@dataclass(frozen=True)
class Space:
    """``size`` factors in ``[low, high]``, non-decreasing, on a grid of ``STEP``; with ``critical`` (a pair
    index) and ``floor``, the pairs from ``critical`` on in ``[floor, high]`` and the ones below it tied to the
    critical pair by NTK scaling (``tied``); a ``critical`` past the last pair leaves every pair in
    ``[low, floor]``, free."""

    size: int
    low: float
    high: float
    critical: int | None = None
    floor: float | None = None

    def __post_init__(self):
        if not isinstance(self.size, int) or self.size < 1:
            raise RopeExtendError(f"the search space needs at least one factor, got size={self.size!r}")
        if not (1.0 <= self.low < self.high):
            raise RopeExtendError(f"factor bounds must satisfy 1 <= low < high, got low={self.low}, high={self.high}")
        if (self.critical is None) != (self.floor is None):
            raise RopeExtendError("a split search space needs both critical and floor")
        if self.floor is not None and not (self.low <= self.floor <= self.high):
            raise RopeExtendError(f"floor must lie in [low, high], got {self.floor}")

    def bounds(self, i: int) -> tuple[float, float]:
        """``(lowest, highest)`` factor of pair ``i`` (below ``tied``, the factor follows pair ``tied``'s)."""
        if self.critical is None or self.floor is None:
            return self.low, self.high
        if self.critical >= self.size:
            return self.low, self.floor
        return (self.floor, self.high) if i >= self.critical else (self.low, self.high)

    @property
    def tied(self) -> int:
        """The first searched pair: the pairs below it are set from it, ``lambda_i = lambda_c^(i / c)`` (0: none)."""
        if self.critical is None or self.critical >= self.size:
            return 0
        return self.critical

    @classmethod
    def for_factor(cls, size: int, factor: float, upper: float = 1.25) -> Space:
        """The paper's space for extension ratio ``factor``: ``[1, upper * factor]``."""
        if not (isinstance(factor, (int, float)) and factor > 1.0 and math.isfinite(factor)):
            raise RopeExtendError(f"the search needs an extension factor > 1, got {factor!r}")
        return cls(size, 1.0, round(upper * float(factor), 2))

    @classmethod
    def for_critical(cls, size: int, factor: float, critical: int, upper: float = 2.0) -> Space:
        """LongRoPE2's space: ``[s, upper * s]`` from the critical pair ``critical`` on (the paper's ``[s, 2 s]``),
        NTK scaling from it below it."""
        space = cls.for_factor(size, factor, upper)
        if not isinstance(critical, int) or isinstance(critical, bool) or critical < 0:
            raise RopeExtendError(f"the critical pair index must be an integer >= 0, got {critical!r}")
        floor = math.ceil(round(float(factor) / STEP, 6)) * STEP  # on the grid, so repaired factors reach it
        return cls(size, space.low, space.high, min(critical, size), round(floor, 2))


def repair(space: Space, values: Sequence[float]) -> list[float]:
    """Clip to the bounds, make non-decreasing (running maximum) and round up to the grid."""
    if len(values) != space.size:
        raise RopeExtendError(f"a candidate needs {space.size} factors, got {len(values)}")
    c = space.tied
    out, top = [], space.low
    for i in range(c, space.size):  # the searched pairs; the ones below c do not push them up
        low, high = space.bounds(i)
        v = min(max(float(values[i]), low), high)
        top = max(top, v)  # the bounds never fall with i, so the running maximum stays within them
        out.append(round(min(high, math.ceil(round(top / STEP, 6)) * STEP), 2))
    return _ntk_below(out[0], c) + out if c else out


def _ntk_below(factor: float, c: int) -> list[float]:
    """LongRoPE2's factors below the critical pair ``c`` whose factor is ``factor``: ``factor^(i / c)``, the NTK
    scaling whose base turns pair ``c`` by ``1 / factor`` (rounded to 1e-6, so a saved state reads back equal)."""
    return [round(factor ** (i / c), 6) for i in range(c)]


def valid(space: Space, values: Sequence[float]) -> bool:
    c = space.tied
    return (
        len(values) == space.size
        and all(space.bounds(i)[0] - 1e-9 <= v <= space.bounds(i)[1] + 1e-9 for i, v in enumerate(values))
        and all(a <= b + 1e-12 for a, b in itertools.pairwise(values))
        and (not c or all(abs(a - b) <= 1e-6 for a, b in zip(values[:c], _ntk_below(values[c], c), strict=True)))
    )


def mutate(space: Space, parent: Sequence[float], rng: random.Random, *, rate: float = 0.3, scale: float = 0.1):
    """Move each searched factor (from ``space.tied`` on) with probability ``rate`` by a Gaussian step of
    ``scale * (high - low)``; at least one moves."""
    child = list(parent)
    c = space.tied
    picks = [i for i in range(c, space.size) if rng.random() < rate] or [rng.randrange(c, space.size)]
    for i in picks:
        child[i] += rng.gauss(0.0, scale * (space.high - space.low))
    return repair(space, child)


def crossover(space: Space, a: Sequence[float], b: Sequence[float], rng: random.Random) -> list[float]:
    """One-point crossover: ``a`` up to a random cut, ``b`` after it (then repaired to stay non-decreasing)."""
    cut = rng.randrange(1, space.size) if space.size > 1 else 0
    return repair(space, list(a[:cut]) + list(b[cut:]))


def offspring(
    space: Space, parents: Sequence[Sequence[float]], count: int, rng: random.Random, seen: set[tuple[float, ...]]
) -> list[list[float]]:
    """``count`` new candidates, none in ``seen``: half by crossover of two parents then mutation, half by
    mutation alone (the paper mixes both). Candidates are added to ``seen``."""
    out: list[list[float]] = []
    tries = 0
    while len(out) < count and tries < 100 * count:
        tries += 1
        if len(parents) > 1 and len(out) % 2 == 0:
            a, b = rng.sample(range(len(parents)), 2)
            child = mutate(space, crossover(space, parents[a], parents[b], rng), rng, rate=0.1)
        else:
            child = mutate(space, parents[rng.randrange(len(parents))], rng)
        key = tuple(child)
        if key not in seen:
            seen.add(key)
            out.append(child)
    return out
