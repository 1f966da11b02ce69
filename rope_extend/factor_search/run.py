"""``search``: an evolutionary search for LongRoPE rescale factors, with perplexity as fitness.

Ding et al. 2024, "LongRoPE", section 3.2 (the authors did not release their search). For a model trained at
``L`` and an extension ratio ``s``:

- candidates: one factor per rotary frequency pair (``evolution.Space``: non-decreasing, ``1 <= lambda <= 1.25 s``),
  applied with ``patch(model, "longrope", factor=s, short_factor=[1, ...], long_factor=lambda)``; inside ``L`` the
  model is unchanged, past it every frequency is divided by its factor, with LongRoPE's attention scale
  ``sqrt(1 + ln s / ln L)``;
- first population: PI (``lambda_i = s``), NTK-aware and YaRN factors, taken from the methods ``patch`` applies
  (``lambda_i = theta_i / theta'_i``), then mutations of them;
- each generation keeps the best half (elitism) and fills the rest by crossover and mutation;
- fitness (``fitness="text"``): token-weighted perplexity of the first ``target_length = s L`` tokens of each text
  (texts shorter than that are left out), computed with the perplexity harness' memory-safe ``window_nll``;
  ``fitness="needle"``: LongRoPE2's needle-driven perplexity, over the answer tokens of passkey and RULER
  key-value needles placed at several depths of ``s L``-token documents built from the texts (``needles``);
- bounds (``space="longrope"``): the paper's ``[1, 1.25 s]``; ``space="longrope2"``: split at LongRoPE2's
  critical dimension (``methods.longrope.critical_dimension``, from the base, the head dimension and ``L``):
  the pairs from it on searched in ``[s, 2 s]``, the ones below it set by NTK scaling from the critical pair's
  factor (``evolution.Space.for_critical``, as the authors' code does).

The state (population, fitnesses, history, random generator, and the generation's candidates not yet evaluated)
is written atomically after each fitness evaluation, so ``resume=True`` continues an interrupted search from its
last finished evaluation and, under an evaluation budget, ends exactly where an uninterrupted one would; a larger
budget on resume continues the same sequence. A time budget stops after the evaluation that crosses it and is not
reproducible.
The fitness and the bounds are part of the saved settings: a resume with another one is refused.
Not implemented: the paper's "start tokens" (the first positions kept unscaled need position-dependent
frequencies, which ``patch`` does not apply), and LongRoPE2's search of the critical dimension itself (its
Algorithm 1 draws candidates between the pair with ten theoretical periods in ``L`` and the computed one; the
authors' scripts pass one by hand); here the split is at the computed one, or at the pair ``critical_pair``
names (``--critical-pair``, the authors' ``--critical-dim``, which counts pairs too).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import RopeExtendError, shown
from ..evaluation.perplexity import window_nll
from ..evaluation.runner import check_reachable
from ..hf import head as hf_head
from ..hf.reading import original_length, rotary_geometry, scaled_layer_types, text_config
from ..hf.window import sliding_window_widened
from ..io import claim_output_dir, write_json
from ..methods import registry
from ..methods._common import rope_frequencies
from ..methods.longrope import critical_dimension
from ..patching import patch, patched, unpatch
from ..progress import bar as progress_bar
from . import evolution
from .choices import FITNESSES, SPACES
from .needles import check_fitness, documents
from .report import write_report
from .state import read_state

STATE = "search_state.json"
RESULT = "longrope.json"
SEED_METHODS = ("linear", "ntk", "yarn")


@dataclass
class SearchResult:
    """The best factors found, as a ``longrope`` scaling, with the search's record."""

    factor: float
    original_length: int
    long_factor: list[float]
    fitness: float
    seeds: dict[str, float]  # fitness of the PI / NTK / YaRN seeds
    history: list[list[float]] = field(default_factory=list)  # [evaluation, fitness, best so far]
    evaluations: int = 0
    objective: str = "text"  # the fitness kind: text or needle
    critical: int | None = None  # LongRoPE2's critical dimension (a rotary dimension index) of the model

    @property
    def short_factor(self) -> list[float]:
        return [1.0] * len(self.long_factor)

    def patch_kwargs(self) -> dict[str, Any]:
        """``patch(model, "longrope", **result.patch_kwargs())`` applies it."""
        return {"factor": self.factor, "short_factor": self.short_factor, "long_factor": self.long_factor}

    def rope_parameters(self) -> dict[str, Any]:
        return {
            "rope_type": "longrope",
            "factor": self.factor,
            "original_max_position_embeddings": self.original_length,
            "short_factor": self.short_factor,
            "long_factor": self.long_factor,
        }


def seed_factors(method: str, dim: int, base: float, factor: float, original_length: int) -> list[float]:
    """``lambda_i = theta_i / theta'_i`` for a frequency method as ``patch`` applies it (its full-length branch)."""
    scaled, _ = registry.inv_freq(method, dim, base, factor, original_length)
    return [float(x) for x in (rope_frequencies(dim, base) / scaled.double())]


def geometry(model) -> tuple[int, float, int]:
    """``(rotary dimension, base, L)`` of ``model``'s scaled layers."""
    config = text_config(model.config)
    layer_type = next((t for t in scaled_layer_types(config) if t is not None), None)
    dim, base = rotary_geometry(config, layer_type)
    return dim, base, original_length(config)


def _settings(
    model, docs, *, factor, dim, base, length, population, seed, fitness, space, critical_pair
) -> dict[str, Any]:
    """What a resumed search must share with the saved one: the model, the scaling and geometry, a digest of the
    documents (token ids; with the needle fitness, each one's first scored index too), the fitness and bounds
    (the critical pair given, or None), and the search's own settings."""
    ids = [d for d, _ in docs] if fitness == "text" else docs  # the text digest is the one states always had
    digest = hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    return {"model": str(name), "factor": factor, "dim": dim, "base": base, "target_length": length,
            "texts": digest, "population": population, "seed": seed, "fitness": fitness, "space": space,
            "critical_pair": critical_pair}  # fmt: skip


class _Run:
    """One search: the state that is saved after each evaluation (pool of ``[factors, fitness]``, history,
    the seeds' fitness, the random generator, the generation's pending candidates) and the steps that change it."""

    def __init__(
        self,
        model,
        head,
        ids,
        space: evolution.Space,
        *,
        factor: float,
        population: int,
        rng: random.Random,
        max_evaluations: int | None,
    ):
        self.model, self.head, self.ids, self.space = model, head, ids, space
        self.factor, self.population, self.rng, self.max_evaluations = factor, population, rng, max_evaluations
        self.pool: list[list] = []
        self.history: list[list[float]] = []  # [evaluation, fitness, best so far]
        self.seeds: dict[str, float] = {}
        self.seed_candidates: dict[str, list[float]] = {}  # each seed method's factors, as evaluated
        self.pending: list[list[float]] = []  # this generation's candidates not yet evaluated, in order
        self.seen: set[tuple[float, ...]] = set()
        self.bar: Any = None  # progress.bar's tqdm bar once search() starts it (tqdm has no type information)
        self.save = lambda: None  # persists the state; called after each evaluation
        self.deadline: float | None = None  # time.monotonic() past which no evaluation starts

    def spent(self) -> bool:
        """The evaluation budget is used up."""
        return self.max_evaluations is not None and len(self.history) >= self.max_evaluations

    def out_of_time(self) -> bool:
        """The time budget is used up; it applies once the seeds are evaluated (a result needs them)."""
        return bool(self.seeds) and self.deadline is not None and time.monotonic() >= self.deadline

    def state(self, settings: dict[str, Any]) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        rng = [version, list(internal), gauss]
        return {"settings": settings, "rng": rng, "pool": self.pool, "history": self.history, "seeds": self.seeds,
                "seed_candidates": self.seed_candidates, "pending": self.pending}  # fmt: skip

    def restore(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.pool, self.history, self.seeds = state["pool"], state["history"], state["seeds"]
        # states written before per-evaluation saving have neither key: they were saved at generation ends
        self.seed_candidates = state.get("seed_candidates", {})
        self.pending = state.get("pending", [])
        self.seen = {tuple(c) for c, _ in self.pool} | {tuple(c) for c in self.pending}

    def fitness(self, candidate: list[float]) -> float:
        """Token-weighted perplexity of the documents' scored tokens (all but the first of a text, a needle's
        answer) with ``candidate`` as LongRoPE's long factors."""
        patch(self.model, "longrope", factor=self.factor, short_factor=[1.0] * self.space.size, long_factor=candidate)
        total, count = 0.0, 0  # a sum of NLLs, a number of tokens
        for x, start in self.ids:
            nll, n = window_nll(self.head, x, start)
            total, count = total + nll, count + n
        return math.exp(total / count)

    def drain(self) -> None:
        """Evaluate the pending candidates in order, saving the state after each, until none is left, the budget
        is spent or the time is up (what is left stays pending, for a resume)."""
        while self.pending and not (self.spent() or self.out_of_time()):
            candidate = self.pending[0]
            fit = self.fitness(candidate)
            self.pool.append([candidate, fit])
            self.pending.pop(0)
            best = min(f for _, f in self.pool)
            self.history.append([len(self.history) + 1, fit, best])
            if not self.seeds and self.seed_candidates:
                fitness = {tuple(c): f for c, f in self.pool}
                if all(tuple(c) in fitness for c in self.seed_candidates.values()):
                    self.seeds = {name: fitness[tuple(c)] for name, c in self.seed_candidates.items()}
            self.save()
            if self.bar is not None:
                self.bar.set_postfix(best=f"{best:.4f}", refresh=False)  # one line per evaluation in a log
                self.bar.update(1)

    def first_generation(self, seeds: dict[str, list[float]]) -> None:
        """The seed methods' factors (each once: two seeds that repair to the same factors share them), then
        mutations of them up to the population; each seed's fitness is recorded by name once evaluated."""
        first = []
        for name, factors in seeds.items():
            candidate = evolution.repair(self.space, factors)
            self.seed_candidates[name] = candidate
            if tuple(candidate) not in self.seen:
                self.seen.add(tuple(candidate))
                first.append(candidate)
        first += evolution.offspring(self.space, list(first), self.population - len(first), self.rng, self.seen)
        self.pending = [list(c) for c in first]
        self.save()

    def next_generation(self) -> None:
        """Keep the best half (elitism); crossover and mutation of it fill the rest."""
        self.pool.sort(key=lambda cf: cf[1])
        parents = [c for c, _ in self.pool[: max(2, self.population // 2)]]
        batch = evolution.offspring(self.space, parents, self.population - len(parents), self.rng, self.seen)
        self.pending = [list(c) for c in batch]
        self.save()

    def best(self) -> tuple[list[float], float]:
        candidate, fit = min(self.pool, key=lambda cf: cf[1])
        return list(candidate), float(fit)


def _check_budget(max_evaluations, max_seconds, population) -> None:
    if max_evaluations is None and max_seconds is None:
        raise RopeExtendError("the search needs a budget: max_evaluations, max_seconds or both")
    if max_evaluations is not None and (not isinstance(max_evaluations, int) or max_evaluations < len(SEED_METHODS)):
        raise RopeExtendError(
            f"max_evaluations must be an integer >= {len(SEED_METHODS)} (the {', '.join(SEED_METHODS)} seeds are "
            f"evaluated first), got {max_evaluations!r}"
        )
    if max_seconds is not None and not (isinstance(max_seconds, (int, float)) and max_seconds > 0):
        raise RopeExtendError(f"max_seconds must be a positive number, got {max_seconds!r}")
    if not isinstance(population, int) or population < 4:
        raise RopeExtendError(f"population must be an integer >= 4, got {population!r}")


def claim(out: str | Path, *, resume: bool, overwrite: bool, check_only: bool = False) -> None:
    """Claim ``out`` for a search (``io.claim_output_dir``); ``check_only``: refuse what the claim would, before
    the model is loaded, changing nothing."""
    owned = {STATE, RESULT, "report.md", "search.png"}
    claim_output_dir(
        out, kind="search", owned=owned.__contains__, resume=resume, overwrite=overwrite, check_only=check_only
    )


def _open_state(out, settings: dict, run: _Run, *, resume: bool, overwrite: bool) -> Path | None:
    """Claim ``out`` for the search and, with ``resume``, restore ``run`` from the state saved there (refused if
    it was run with other settings). Returns where the state is saved, or None without ``out``."""
    state_path = None
    if out is not None:
        claim(out, resume=resume, overwrite=overwrite)
        state_path = Path(out) / STATE
    if resume:
        if state_path is None or not os.path.lexists(state_path):
            raise RopeExtendError(f"resume: no search state in {out!r} ({STATE} not found)")
        state = read_state(state_path, run.space.size)
        if state["settings"] != settings:
            saved = state["settings"].get("fitness")
            if saved != settings["fitness"] and saved in FITNESSES:  # the likeliest mismatch: named on its own
                raise RopeExtendError(
                    f"resume: the search in {out} was run with fitness {saved!r}, not {settings['fitness']!r}: "
                    f"resume it with --fitness {saved}, or search with this fitness into a new --out"
                )
            diff = [
                f"{k}: {shown(state['settings'].get(k), 80)} there, {settings[k]!r} now"
                for k in sorted(settings)
                if state["settings"].get(k) != settings[k]
            ]
            raise RopeExtendError(
                f"resume: the search in {out} was run with other settings ({'; '.join(diff)}); run it with the "
                "same ones, or search into a new --out"
            )
        run.restore(state)
    return state_path


def search(
    model,
    tokenizer,
    factor: float,
    texts,
    *,
    max_evaluations: int | None = 64,
    max_seconds: float | None = None,
    population: int = 16,
    seed: int = 0,
    upper: float | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    fitness: str = "text",
    space: str = "longrope",
    critical_pair: int | None = None,
) -> SearchResult:
    """Search LongRoPE factors for ``model`` at ``factor`` x its trained length on ``texts`` (see the module
    docstring). ``max_evaluations`` / ``max_seconds``: the budget (at least one). ``out``: a folder for the state
    (``search_state.json``), the result (``longrope.json``) and the report (``report.md``, ``search.png``);
    ``resume`` continues the state found there, ``overwrite`` replaces an earlier search there (a folder
    rope-extend did not make is never touched). ``fitness``: ``text``, ``needle`` or ``needle-multiquery``; ``space``: ``longrope`` or
    ``longrope2`` (the bounds; see the module docstring); ``critical_pair``: with ``longrope2``, the frequency pair
    the split is at instead of the computed critical dimension's (as the authors' ``--critical-dim``). ``upper``:
    the largest factor as a multiple of ``factor``
    (default 1.25 for ``longrope``, LongRoPE's; 2 for ``longrope2``, LongRoPE2's).
    The model is left as it was (unpatched)."""
    _check_search(model, max_evaluations, max_seconds, population, fitness, space, critical_pair=critical_pair)
    dim, base, L = geometry(model)
    critical = critical_dimension(dim, base, L)
    split = check_critical_pair(critical_pair, space, dim)
    if space == "longrope2":
        pair = critical // 2 if split is None else split
        bounds = evolution.Space.for_critical(dim // 2, factor, pair, 2.0 if upper is None else upper)
    else:
        bounds = evolution.Space.for_factor(dim // 2, factor, 1.25 if upper is None else upper)
    length = round(float(factor) * L)
    docs = documents(tokenizer, texts, length, fitness=fitness, seed=seed)
    check_reachable(model, length, cache=False)
    settings = _settings(
        model, docs, factor=float(factor), dim=dim, base=base, length=length, population=population, seed=seed,
        fitness=fitness, space=space, critical_pair=split,
    )  # fmt: skip
    head = hf_head.lm_head(model, decoder=True)
    device = next(model.parameters()).device
    ids = [(torch.tensor(d, device=device), start) for d, start in docs]
    run = _Run(
        model,
        head,
        ids,
        bounds,
        factor=float(factor),
        population=population,
        rng=random.Random(seed),
        max_evaluations=max_evaluations,
    )
    state_path = _open_state(out, settings, run, resume=resume, overwrite=overwrite)
    _prepare(run, settings, state_path, max_seconds=max_seconds, progress=progress)
    _evolve(model, run, length, lambda: _seeds(dim, base, float(factor), L))
    best, fit = run.best()
    result = SearchResult(
        float(factor),
        L,
        best,
        fit,
        dict(run.seeds),
        run.history,
        len(run.history),
        objective=fitness,
        critical=critical,
    )
    if out is not None:
        _write_outputs(result, run, out, settings, _seeds(dim, base, float(factor), L))
    return result


def check_critical_pair(critical_pair, space: str, dim: int | None = None) -> int | None:
    """``critical_pair`` checked: None, or with the ``longrope2`` space a frequency pair ``0 <= p < dim / 2``."""
    if critical_pair is None:
        return None
    if space != "longrope2":
        raise RopeExtendError(f"critical_pair sets where the longrope2 space splits; the {space} space has no split")
    top = "" if dim is None else f" and < {dim // 2} (the model's frequency pairs)"
    if (
        not isinstance(critical_pair, int)
        or isinstance(critical_pair, bool)
        or critical_pair < 0
        or (dim is not None and critical_pair >= dim // 2)
    ):
        raise RopeExtendError(f"critical_pair must be an integer >= 0{top}, got {critical_pair!r}")
    return critical_pair


def _check_search(model, max_evaluations, max_seconds, population, fitness: str, space: str, *, critical_pair) -> None:
    """Everything ``search`` refuses before it reads the model's geometry or the texts."""
    _check_budget(max_evaluations, max_seconds, population)
    check_fitness(fitness)
    if space not in SPACES:
        raise RopeExtendError(f"space must be one of {', '.join(SPACES)}, got {space!r}")
    check_critical_pair(critical_pair, space)
    if patched(model) is not None:
        raise RopeExtendError("the model is already patched: unpatch it first; the search patches it itself")


def _seeds(dim: int, base: float, factor: float, L: int) -> dict[str, list[float]]:
    """The factors of each seed method (``SEED_METHODS``): generation 0's parents and the report's curves."""
    return {name: seed_factors(name, dim, base, factor, L) for name in SEED_METHODS}


def _prepare(run: _Run, settings: dict, state_path: Path | None, *, max_seconds, progress: bool) -> None:
    """Give ``run`` its saving (the state after each evaluation, where there is an ``out``), its deadline and its
    progress bar (started at the evaluations a resumed state holds)."""

    def save() -> None:
        if state_path is not None:
            write_json(state_path, run.state(settings))

    run.save = save
    run.deadline = None if max_seconds is None else time.monotonic() + max_seconds
    run.bar = progress_bar(
        total=run.max_evaluations,
        initial=len(run.history),
        disable=not progress,
        unit="eval",
        desc=f"search x{run.factor:g}",
    )


def _evolve(model, run: _Run, length: int, seeds: Callable[[], dict[str, list[float]]]) -> None:
    """Generation 0 (the seed methods, then mutations of them) unless a resumed state holds it, the generation an
    interrupted search left unfinished, then generations until the budget is spent; the model unpatched after."""
    # a Mistral / Phi-3 window would hide the long context
    with sliding_window_widened(model, length):
        try:
            if not run.pool and not run.pending:  # generation 0: the three methods, then mutations of them
                run.first_generation(seeds())
            run.drain()  # a generation an interrupted search left unfinished
            while not (run.spent() or run.out_of_time()):
                run.next_generation()
                run.drain()
        finally:
            run.bar.close()
            if patched(model) is not None:  # a resume whose budget was already spent evaluated nothing
                unpatch(model)


def _write_outputs(result: SearchResult, run: _Run, out: str | Path, settings: dict, curves: dict) -> None:
    """The report (``report.md``, ``search.png``, with the seed methods' ``curves``) and ``longrope.json``."""
    write_report(result, curves, out)
    write_json(Path(out) / RESULT, {**result.rope_parameters(), "fitness": result.fitness, "seeds": run.seeds,
                                    "evaluations": len(run.history), "critical_dimension": result.critical,
                                    "settings": settings})  # fmt: skip
