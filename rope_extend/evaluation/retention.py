"""Short-context retention: what a patched or fine-tuned model keeps of the original's quality inside the
original's context (LongRoPE2, Shang et al. 2025, reports it as the ratio of scores and sets the bar at 98.5%).

The two models answer the *same* examples (the same prompts, documents and seeds), so the comparison is paired:

- scores (RULER samples, passkey trials; higher is better): ``mean(patched) / mean(original)``;
- perplexity (lower is better): ``perplexity(original) / perplexity(patched)``, each the token-weighted
  ``exp(sum nll / sum tokens)`` over the documents, so that 1 means kept and below 1 means lost, as for scores.

The interval is a paired percentile bootstrap: the examples are resampled with replacement (the same draw for
both models, which keeps their correlation), the ratio recomputed each time, and the ``(1 - confidence) / 2``
and ``(1 + confidence) / 2`` quantiles taken. A Wilson interval fits one proportion, not a ratio of two paired
means, so it is not used here. A resample where the original scores 0 and the patched 0 too carries no ratio and
is dropped; one where only the original scores 0 gives an infinite ratio (an open upper end). The draw comes
from ``seed`` only: the same inputs give the same interval.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypedDict

import numpy as np

from ..errors import RopeExtendError

METHOD = "paired percentile bootstrap"


@dataclass(frozen=True)
class Retention:
    """``ratio`` (1 = everything kept) with its ``confidence`` interval ``[low, high]`` over ``examples``
    paired examples; ``original`` and ``patched``: the two means (scores) or perplexities."""

    ratio: float
    low: float
    high: float
    confidence: float
    examples: int
    original: float
    patched: float
    kind: str  # "score" or "perplexity"
    method: str = METHOD
    resamples: int = 2000
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check(confidence: float, resamples: int, seed: int) -> None:
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
        raise RopeExtendError(f"confidence must be a share in (0, 1), got {confidence!r}")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 100:
        raise RopeExtendError(f"resamples must be an integer >= 100, got {resamples!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise RopeExtendError(f"seed must be an integer, got {seed!r}")


def _array(values: Iterable[float], name: str) -> np.ndarray:
    a = np.asarray(list(values), dtype=np.float64)
    if a.ndim != 1 or not np.all(np.isfinite(a)):
        raise RopeExtendError(f"{name} must be finite numbers, one per example")
    return a


def _interval(draws: np.ndarray, confidence: float) -> tuple[float, float]:
    """The ``confidence`` percentile interval of the bootstrap ratios ``draws`` (nan draws dropped)."""
    draws = draws[~np.isnan(draws)]
    if draws.size == 0:  # every resample had no ratio (cannot happen when the full sample has one)
        raise RopeExtendError("retention: no bootstrap resample gave a ratio")
    tail = (1 - confidence) / 2
    # no interpolation between draws: an infinite draw (original 0 in that resample) then stays an open upper end
    # instead of making the quantile inf - inf
    low, high = np.quantile(draws, [tail, 1 - tail], method="inverted_cdf")
    return float(low), float(high)


def _pair(original, patched, what: str) -> int:
    if len(original) != len(patched):
        raise RopeExtendError(
            f"retention pairs the examples: the original has {len(original)} {what}, the patched {len(patched)}"
        )
    if len(original) == 0:
        raise RopeExtendError(f"retention needs one example at least, got no {what}")
    return len(original)


class BootstrapSettings(TypedDict):
    """The interval's settings, passed on as keywords: the same for every measurement of one comparison."""

    confidence: float
    resamples: int
    seed: int


def retention(
    original: Sequence[float],
    patched: Sequence[float],
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> Retention:
    """``mean(patched) / mean(original)`` of per-example scores (higher is better), paired by position, with a
    paired bootstrap interval (see the module docstring)."""
    _check(confidence, resamples, seed)
    n = _pair(original, patched, "scores")
    o, p = _array(original, "original"), _array(patched, "patched")
    if o.mean() == 0:
        raise RopeExtendError("retention is undefined: the original scores 0 on every example")
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    om, pm = o[idx].mean(axis=1), p[idx].mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        draws = pm / om  # 0/0 -> nan (dropped), x/0 -> inf
    low, high = _interval(draws, confidence)
    return Retention(
        ratio=float(p.mean() / o.mean()),
        low=low,
        high=high,
        confidence=float(confidence),
        examples=n,
        original=float(o.mean()),
        patched=float(p.mean()),
        kind="score",
        resamples=resamples,
        seed=seed,
    )


def perplexity_retention(
    original: Sequence[tuple[float, int]],
    patched: Sequence[tuple[float, int]],
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> Retention:
    """``perplexity(original) / perplexity(patched)`` over documents given as ``(nll sum, tokens)``, paired by
    position (each perplexity token-weighted), with a paired bootstrap interval."""
    _check(confidence, resamples, seed)
    n = _pair(original, patched, "documents")
    arrays = []
    for name, docs in (("original", original), ("patched", patched)):
        nll = _array((d[0] for d in docs), f"{name} nll")
        tokens = _array((d[1] for d in docs), f"{name} tokens")
        if np.any(tokens < 1):
            raise RopeExtendError(f"{name}: every document needs one scored token at least")
        arrays.append((nll, tokens))
    (on, ot), (pn, pt) = arrays
    if not np.array_equal(ot, pt):
        raise RopeExtendError("perplexity retention pairs the documents: their scored token counts differ")
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    tok = ot[idx].sum(axis=1)
    # ppl_o / ppl_p = exp((nll_o - nll_p) / tokens)
    draws = np.exp((on[idx].sum(axis=1) - pn[idx].sum(axis=1)) / tok)
    ppl_o, ppl_p = math.exp(on.sum() / ot.sum()), math.exp(pn.sum() / pt.sum())
    low, high = _interval(draws, confidence)
    return Retention(
        ratio=float(ppl_o / ppl_p),
        low=low,
        high=high,
        confidence=float(confidence),
        examples=n,
        original=ppl_o,
        patched=ppl_p,
        kind="perplexity",
        resamples=resamples,
        seed=seed,
    )


# ------------------------------------------------------------------------------------------ from records
# how the harnesses' records name one example, so that the two models' records pair up
_KEYS = {
    "ruler": ("ruler_task", "length", "sample"),
    "passkey": ("length", "depth_grid", "trial"),
    "perplexity": ("length", "doc", "text"),
}


def _by_key(records: Iterable[dict], task: str, within: int, who: str) -> dict[tuple, dict]:
    out: dict[tuple, dict] = {}
    for r in records:
        if r.get("task") != task or r["length"] > within:
            continue
        key = tuple(r.get(k) for k in _KEYS[task])
        if key in out:
            raise RopeExtendError(
                f"the {who} records hold {task} example {dict(zip(_KEYS[task], key, strict=True))} twice: "
                "give the records of one run"
            )
        out[key] = r
    return out


def retention_from_records(
    original: Iterable[dict],
    patched: Iterable[dict],
    *,
    within: int,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> dict[str, Retention]:
    """Retention per measurement from two runs' records (one run each: the original model's and the patched or
    fine-tuned one's), at lengths up to ``within`` (the original's context): ``ruler`` (every RULER sample
    pooled; with the same samples per task, the mean over tasks), ``ruler:<task>`` per task, ``passkey``
    (trials) and ``perplexity`` (documents). A measurement present in only one run, or whose examples differ
    between the runs, is an error: retention compares the same examples."""
    if isinstance(within, bool) or not isinstance(within, int) or within < 1:
        raise RopeExtendError(f"within must be a positive integer (the original context length), got {within!r}")
    original, patched = list(original), list(patched)
    out: dict[str, Retention] = {}
    kw = BootstrapSettings(confidence=confidence, resamples=resamples, seed=seed)
    for task in _KEYS:
        a, b = _by_key(original, task, within, "original"), _by_key(patched, task, within, "patched")
        if not a and not b:
            continue
        if a.keys() != b.keys():
            raise RopeExtendError(
                f"retention compares the same {task} examples: {len(a.keys() - b.keys())} of the original's are not "
                f"in the patched run and {len(b.keys() - a.keys())} of the patched's not in the original (up to "
                f"length {within})"
            )
        keys = sorted(a, key=repr)
        if task == "perplexity":
            out[task] = perplexity_retention(
                [(a[k]["nll"], a[k]["tokens"]) for k in keys], [(b[k]["nll"], b[k]["tokens"]) for k in keys], **kw
            )
        elif task == "passkey":
            out[task] = retention([float(a[k]["correct"]) for k in keys], [float(b[k]["correct"]) for k in keys], **kw)
        else:
            out[task] = retention([float(a[k]["score"]) for k in keys], [float(b[k]["score"]) for k in keys], **kw)
            for name in sorted({k[0] for k in keys}):
                mine = [k for k in keys if k[0] == name]
                scores_a = [float(a[k]["score"]) for k in mine]
                if sum(scores_a) > 0:  # a task the original never solves has no retention of its own
                    out[f"ruler:{name}"] = retention(scores_a, [float(b[k]["score"]) for k in mine], **kw)
    return out
