"""Effective context length from scores by length (RULER: Hsieh et al. 2024, section 4).

RULER's rule: a model's effective length is the longest length whose average score is at or above a threshold;
RULER's threshold is Llama-2-7B's average at 4k, 85.6%. That threshold is an absolute bar fixed by one model and
RULER's 13 tasks; a small model may never reach it, and rope-extend's average is over its 11 tasks. So the same
rule is also given relative to the model's own score at a reference length (its trained context, where it is at
its best): the longest length that keeps at least ``keep`` (a share, default 0.9) of that score.

Both are the *longest* qualifying length, as RULER's: a length below it may score lower (scores by length need
not fall monotonically); a length that was not measured is never effective. None when no length qualifies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import RopeExtendError

RULER_THRESHOLD = 85.6  # percent: Llama-2-7B's RULER average at 4k (RULER, Table 3)
KEEP = 0.9  # the share of the score at the reference length that a length must keep
# a score equal to the bar in decimals (keep x reference) may land a rounding error below it: it still counts
SLACK = 1e-9


@dataclass(frozen=True)
class EffectiveLength:
    """``length``: the longest length with a score >= ``threshold`` (percent); ``relative_length``: the longest
    with a score >= ``keep`` x ``reference_score``, the score at ``reference_length`` (None when that score is 0)."""

    threshold: float
    length: int | None
    reference_length: int
    reference_score: float
    keep: float
    relative_length: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_scores(scores: Mapping[int, float]) -> None:
    if not scores:
        raise RopeExtendError("effective length needs scores at one length at least, got none")
    for n, v in scores.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise RopeExtendError(f"effective length: a length must be a positive integer, got {n!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RopeExtendError(f"effective length: the score at {n} must be a finite number, got {v!r}")


def check_effective_options(threshold: float, reference_length: int | None, keep: float) -> None:
    """The parameters checked at once, each named with its value and what is allowed."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise RopeExtendError(f"threshold must be a finite number (a score in percent), got {threshold!r}")
    if reference_length is not None and (
        isinstance(reference_length, bool) or not isinstance(reference_length, int) or reference_length < 1
    ):
        raise RopeExtendError(f"reference_length must be a positive integer or None, got {reference_length!r}")
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < keep <= 1:
        raise RopeExtendError(f"keep must be a share in (0, 1], got {keep!r}")


def effective_length(scores: Mapping[int, float], threshold: float = RULER_THRESHOLD) -> int | None:
    """The longest length whose score (percent) is at or above ``threshold``; None if there is none."""
    _check_scores(scores)
    check_effective_options(threshold, None, KEEP)
    passing = [n for n, v in scores.items() if v >= threshold - SLACK]
    return max(passing) if passing else None


def effective_lengths(
    scores: Mapping[int, float],
    *,
    threshold: float = RULER_THRESHOLD,
    reference_length: int | None = None,
    keep: float = KEEP,
) -> EffectiveLength:
    """Both effective lengths of ``scores`` (length -> score in percent). ``reference_length``: where the model's
    own score is taken (its trained context); default the shortest length measured. It must be measured."""
    _check_scores(scores)
    check_effective_options(threshold, reference_length, keep)
    ref = min(scores) if reference_length is None else reference_length
    if ref not in scores:
        raise RopeExtendError(
            f"reference_length {ref} was not measured; measured lengths: {', '.join(map(str, sorted(scores)))}"
        )
    return EffectiveLength(
        threshold=float(threshold),
        length=effective_length(scores, threshold),
        reference_length=ref,
        reference_score=float(scores[ref]),
        keep=float(keep),
        # a model that scores nothing at its own context keeps "all" of nothing at every length: no relative length
        relative_length=effective_length(scores, keep * scores[ref]) if scores[ref] > 0 else None,
    )
