"""``ruler()``: RULER's synthetic tasks on a model at each length, through the evaluation runner."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ...errors import RopeExtendError
from .. import retrieval, ruler_words, runner
from ..data import default_texts
from ..effective import KEEP, RULER_THRESHOLD, EffectiveLength, check_effective_options, effective_lengths
from ..tasks.base import options_for
from ..tasks.options import RulerOptions
from .scoring import score, tables
from .sizing import Haystack, PromptFormat, RulerPrompt, build_prompt
from .subtasks import ESSAY, GENERATE, VERSION, check_tasks


@dataclass
class RulerResult:
    """Every sample's record and RULER's tables.

    ``accuracy[task][length]``: the mean sample score (a share); ``scores[task][length]``: RULER's number, that
    mean in percent rounded to 2 decimals; ``empty[task][length]``: the samples whose answer was empty after
    RULER's post-processing; ``average[length]``: the mean of ``scores`` over the tasks measured (percent; over
    ``tasks`` of them, never RULER's 13: see ``RULER_TASKS``); ``effective``: the effective lengths
    (``effective.EffectiveLength``) of ``average``."""

    records: list[dict]
    accuracy: dict[str, dict[int, float]] = field(default_factory=dict)
    scores: dict[str, dict[int, float]] = field(default_factory=dict)
    empty: dict[str, dict[int, int]] = field(default_factory=dict)
    average: dict[int, float] = field(default_factory=dict)
    tasks: int = 0
    effective: EffectiveLength | None = None


def ruler(
    model,
    tokenizer,
    lengths: str | Iterable[Any] | None = None,
    *,
    options: RulerOptions | None = None,
    haystack: Sequence[str] | None = None,
    budgets: dict[str, int] | None = None,
    threshold: float = RULER_THRESHOLD,
    reference_length: int | None = None,
    keep: float = KEEP,
    records: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool = True,
    run: dict[str, Any] | None = None,
    **given: Any,
) -> RulerResult:
    """RULER accuracy of ``model`` for each of ``tasks`` (default: all eleven) at each of ``lengths``.

    The options are ``RulerOptions``'s (the task's, declared once), given as keywords or as ``options=``; of
    its text options only ``max_docs`` (the essay haystack is given). ``samples`` prompts per task and length,
    each drawn from ``(seed, task, length, sample)`` only; a length counts the tokens to generate, as RULER's
    ``max_seq_length``. ``max_new_tokens`` replaces RULER's per-task generation budget (and so the prompt's
    share of the length). ``chat_template``: wrap the prompt in the tokenizer's chat template when it has one
    (RULER does for instruct models); False keeps RULER's ``base`` template.
    ``haystack``: texts for the essay tasks (default: the bundled held-out corpus).
    ``budgets``: tokens to generate per task where they differ from RULER's (``card`` caps them on a model whose
    trained context RULER's would crowd); ``max_new_tokens`` wins over them.
    ``threshold``, ``reference_length`` and ``keep``: the effective lengths' (``effective.effective_lengths``).
    ``records``/``resume``/``progress``/``run`` are the evaluation runner's (see ``evaluation.runner``).
    """
    if lengths is not None:
        given["lengths"] = lengths
    options = options_for(RulerOptions, options, given, harness="ruler")
    lengths, seed, samples, max_new_tokens = options.lengths, options.seed, options.samples, options.max_new_tokens
    names = check_tasks(options.tasks)
    if options.max_docs is not None:
        haystack = list(default_texts() if haystack is None else haystack)[: options.max_docs]
    check_effective_options(threshold, reference_length, keep)
    retrieval.check_can_generate(model)
    fmt = PromptFormat(tokenizer, options.chat_template)
    budget = _budget(names, budgets, max_new_tokens)
    runner.check_reachable(model, max(lengths), cache=True)  # the length holds the generated tokens
    prompts = _Prompts(tokenizer, seed, Haystack(haystack), fmt, budget)
    for task in names:  # a length a task cannot reach fails before any work
        for length in {min(lengths), max(lengths)}:
            prompts.get(task, length, 0)
    digest = prompts.haystack.digest() if any(t in ESSAY for t in names) else None
    jobs = [
        {"ruler_task": task, "length": length, "sample": i, "max_new_tokens": budget[task]}
        | ({"haystack": digest} if task in ESSAY else {})
        for task in names
        for length in lengths
        for i in range(samples)
    ]
    setting = {"seed": seed, "protocol": "ruler-synthetic", "template": fmt.setting(), "words": ruler_words.digest()}
    done = runner.run(
        model,
        tokenizer=tokenizer,
        task="ruler",
        setting=setting,
        jobs=jobs,
        measure=partial(_measure, model, tokenizer, prompts),
        longest=max(lengths),
        records=records,
        resume=resume,
        progress=progress,
        run=run,
        sliding_window=options.sliding_window,
        cache=True,
        unit="sample",
        version=VERSION,
    )
    table = tables(done)
    eff = effective_lengths(table["average"], threshold=threshold, reference_length=reference_length, keep=keep)
    return RulerResult(done, table["accuracy"], table["scores"], table["empty"], table["average"], table["tasks"], eff)


def _budget(names: list[str], budgets: dict[str, int] | None, max_new_tokens: int | None) -> dict[str, int]:
    """The tokens to generate per task: ``max_new_tokens``, else ``budgets``' (checked), else RULER's own."""
    for t, n in (budgets or {}).items():
        if t not in GENERATE or isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise RopeExtendError(f"budgets[{t!r}] must be a positive number of tokens of a RULER task, got {n!r}")
    return {t: max_new_tokens or (budgets or {}).get(t) or GENERATE[t] for t in names}


@dataclass
class _Prompts:
    """RULER's prompts, each built once (the reachability check builds some before the run) and dropped once
    measured."""

    tokenizer: Any
    seed: int
    haystack: Haystack
    fmt: PromptFormat
    budget: dict[str, int]
    built: dict[tuple[str, int, int], RulerPrompt] = field(default_factory=dict)

    def get(self, task: str, length: int, sample: int) -> RulerPrompt:
        key = (task, length, sample)
        if key not in self.built:
            self.built[key] = build_prompt(
                self.tokenizer,
                task,
                length,
                seed=self.seed,
                sample=sample,
                haystack=self.haystack,
                chat_template=self.fmt,
                max_new_tokens=self.budget[task],
            )
        return self.built[key]


def _measure(model, tokenizer, prompts: _Prompts, job: dict) -> dict:
    """One sample: the prompt, the greedy answer and RULER's score of it."""
    task = job["ruler_task"]
    p = prompts.get(task, job["length"], job["sample"])
    prompts.built.pop((task, job["length"], job["sample"]), None)
    output = retrieval.greedy(model, tokenizer, p.input_ids, job["max_new_tokens"])
    got = score(task, output, p.answers)
    return {
        "answers": p.answers,
        "output": output,
        "score": got,
        "correct": got == 1.0,
        "units": p.units,
        "prompt_tokens": len(p),
    }
