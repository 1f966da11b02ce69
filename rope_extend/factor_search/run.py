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
- fitness: token-weighted perplexity of the first ``target_length = s L`` tokens of each text (texts shorter than
  that are left out), computed with the perplexity harness' memory-safe ``window_nll``.

The state (population, fitnesses, history, random generator, and the generation's candidates not yet evaluated)
is written atomically after each fitness evaluation, so ``resume=True`` continues an interrupted search from its
last finished evaluation and, under an evaluation budget, ends exactly where an uninterrupted one would; a larger
budget on resume continues the same sequence. A time budget stops after the evaluation that crosses it and is not
reproducible.
Not implemented: the paper's "start tokens" (the first positions kept unscaled need position-dependent
frequencies, which ``patch`` does not apply) and LongRoPE2's needle-driven fitness.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import untrusted
from ..errors import RopeExtendError
from ..evaluation.perplexity import window_nll
from ..evaluation.runner import check_reachable
from ..hf import config as hf_config
from ..hf import head as hf_head
from ..hf.window import sliding_window_widened
from ..io import claim_output_dir, write_json
from ..methods import registry
from ..methods._common import rope_frequencies
from ..patching import patch, patched, unpatch
from ..progress import bar as progress_bar
from . import evolution
from .report import write_report

STATE = "search_state.json"
MAX_STATE = 64 << 20  # bytes of a saved state: a pool and history of thousands of evaluations fit in a few MiB
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


def _geometry(model) -> tuple[int, float, int]:
    config = hf_config.text_config(model.config)
    layer_type = next((t for t in hf_config.scaled_layer_types(config) if t is not None), None)
    dim, base = hf_config.rotary_geometry(config, layer_type)
    return dim, base, hf_config.original_length(config)


def _tokens(tokenizer, texts, length: int) -> list[list[int]]:
    texts = [t for t in texts if isinstance(t, str) and t.strip()]
    if not texts:
        raise RopeExtendError("the search needs texts: give at least one non-empty document")
    docs = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
    kept = [d[:length] for d in docs if len(d) >= length]
    if not kept:
        raise RopeExtendError(
            f"no text reaches the target length {length} tokens (the longest has {max(map(len, docs))}); give "
            "longer texts or a smaller factor"
        )
    return kept


def _settings(model, docs, *, factor, dim, base, length, population, seed) -> dict[str, Any]:
    """What a resumed search must share with the saved one: the model, the scaling and geometry, a digest of the
    token ids, and the search's own settings."""
    digest = hashlib.sha1(json.dumps(docs).encode()).hexdigest()[:16]
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    return {"model": str(name), "factor": factor, "dim": dim, "base": base, "target_length": length,
            "texts": digest, "population": population, "seed": seed}  # fmt: skip


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
        self.bar = None
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
        """Token-weighted perplexity of the texts with ``candidate`` as LongRoPE's long factors."""
        patch(self.model, "longrope", factor=self.factor, short_factor=[1.0] * self.space.size, long_factor=candidate)
        total = count = 0
        for x in self.ids:
            nll, n = window_nll(self.head, x, 1)
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


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _factors(x, size: int) -> bool:
    return isinstance(x, list) and len(x) == size and all(_number(v) for v in x)


def _state_problem(state, size: int) -> str | None:
    """What is wrong with the shape of a saved state (field by field, as ``_Run.state`` writes it), or None."""
    if not isinstance(state, dict):
        return f"the state is a JSON {type(state).__name__}, not an object"
    for key in ("settings", "rng", "pool", "history", "seeds"):
        if key not in state:
            return f"it has no {key!r}"
    if not isinstance(state["settings"], dict):
        return "'settings' is not an object"
    rng = state["rng"]
    if not (
        isinstance(rng, list)
        and len(rng) == 3
        and isinstance(rng[0], int)
        and isinstance(rng[1], list)
        and len(rng[1]) == 625  # Mersenne Twister: 624 words and the position
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32 for v in rng[1])
        and (rng[2] is None or _number(rng[2]))
    ):
        return "'rng' is not a random generator's state [version, 625 integers, gauss]"
    pool = state["pool"]
    if not isinstance(pool, list) or not all(
        isinstance(e, list) and len(e) == 2 and _factors(e[0], size) and _number(e[1]) for e in pool
    ):
        return f"'pool' is not a list of [{size} factors, fitness]"
    history = state["history"]
    if not isinstance(history, list) or not all(
        isinstance(e, list) and len(e) == 3 and all(map(_number, e)) for e in history
    ):
        return "'history' is not a list of [evaluation, fitness, best]"
    if not isinstance(state["seeds"], dict) or not all(map(_number, state["seeds"].values())):
        return "'seeds' is not an object of fitnesses"
    candidates = state.get("seed_candidates", {})
    if not isinstance(candidates, dict) or not all(_factors(c, size) for c in candidates.values()):
        return f"'seed_candidates' is not an object of {size} factors each"
    pending = state.get("pending", [])
    if not isinstance(pending, list) or not all(_factors(c, size) for c in pending):
        return f"'pending' is not a list of {size} factors each"
    return None


def _read_state(path: Path, size: int) -> dict[str, Any]:
    """The state saved at ``path``, checked field by field; a damaged one (truncated, empty, not UTF-8, not
    JSON, or of another shape) is refused in one line naming the file. It is read as hostile (``untrusted``):
    a regular file of at most ``MAX_STATE`` bytes, not through a link (the search wrote it there)."""
    fix = "start the search again into a new --out, or with --overwrite"
    name = f"resume: the search state {path}"
    state = untrusted.read_json(path, limit=MAX_STATE, name=name, follow_links=False, fix=fix)
    problem = _state_problem(state, size)
    if problem is None:
        return state
    raise RopeExtendError(f"resume: the search state {path} is damaged: {problem}; {fix}")


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
        state = _read_state(state_path, run.space.size)
        if state["settings"] != settings:
            diff = [
                f"{k}: {untrusted.shown(state['settings'].get(k), 80)} there, {settings[k]!r} now"
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
    upper: float = 1.25,
    out: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> SearchResult:
    """Search LongRoPE factors for ``model`` at ``factor`` x its trained length on ``texts`` (see the module
    docstring). ``max_evaluations`` / ``max_seconds``: the budget (at least one). ``out``: a folder for the state
    (``search_state.json``), the result (``longrope.json``) and the report (``report.md``, ``search.png``);
    ``resume`` continues the state found there, ``overwrite`` replaces an earlier search there (a folder
    rope-extend did not make is never touched).
    The model is left as it was (unpatched)."""
    _check_budget(max_evaluations, max_seconds, population)
    if patched(model) is not None:
        raise RopeExtendError("the model is already patched: unpatch it first; the search patches it itself")
    dim, base, L = _geometry(model)
    space = evolution.Space.for_factor(dim // 2, factor, upper)
    length = round(float(factor) * L)
    docs = _tokens(tokenizer, texts, length)
    check_reachable(model, length, cache=False)
    settings = _settings(
        model, docs, factor=float(factor), dim=dim, base=base, length=length, population=population, seed=seed
    )
    head = hf_head.lm_head(model, decoder=True)
    device = next(model.parameters()).device
    ids = [torch.tensor(d, device=device) for d in docs]
    run = _Run(
        model,
        head,
        ids,
        space,
        factor=float(factor),
        population=population,
        rng=random.Random(seed),
        max_evaluations=max_evaluations,
    )

    state_path = _open_state(out, settings, run, resume=resume, overwrite=overwrite)

    def save() -> None:
        if state_path is not None:
            write_json(state_path, run.state(settings))

    run.save = save
    run.deadline = None if max_seconds is None else time.monotonic() + max_seconds
    run.bar = progress_bar(
        total=max_evaluations, initial=len(run.history), disable=not progress, unit="eval", desc=f"search x{factor:g}"
    )
    # a Mistral / Phi-3 window would hide the long context
    with sliding_window_widened(model, length):
        try:
            if not run.pool and not run.pending:  # generation 0: the three methods, then mutations of them
                run.first_generation({name: seed_factors(name, dim, base, float(factor), L) for name in SEED_METHODS})
            run.drain()  # a generation an interrupted search left unfinished
            while not (run.spent() or run.out_of_time()):
                run.next_generation()
                run.drain()
        finally:
            run.bar.close()
            if patched(model) is not None:  # a resume whose budget was already spent evaluated nothing
                unpatch(model)
    best, fit = run.best()
    result = SearchResult(float(factor), L, best, fit, dict(run.seeds), run.history, len(run.history))
    if out is not None:
        curves = {name: seed_factors(name, dim, base, float(factor), L) for name in SEED_METHODS}
        write_report(result, curves, out)
        write_json(Path(out) / RESULT, {**result.rope_parameters(), "fitness": fit, "seeds": run.seeds,
                                        "evaluations": len(run.history), "settings": settings})  # fmt: skip
    return result
