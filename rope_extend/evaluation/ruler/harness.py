"""The ``ruler`` task: its options, its harness ``ruler()`` (RULER's synthetic tasks on a model at each length,
through the evaluation runner; the protocol is in ``evaluation.ruler``'s docstring) and its ``TASK``, whose report
gives per run a task x length table and the effective lengths."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from ...errors import RopeExtendError
from ...hf.window import SlidingWindowMode
from ...schema import option
from .. import retrieval, ruler_words, runner
from ..data import default_texts
from ..effective import KEEP, RULER_THRESHOLD, EffectiveLength, check_effective_options, effective_lengths
from ..report import label_of, labels_of, length_name, plot_heatmap, proportion, slug
from ..tasks.base import WINDOW_HELP, Context, Task, TextOptions, check_lengths, check_positive, options_for
from .scoring import average_label, score, tables
from .sizing import Haystack, PromptFormat, RulerPrompt, build_prompt
from .subtasks import ESSAY, GENERATE, RULER_TASKS, VERSION, check_tasks


@dataclass(kw_only=True)
class RulerOptions(TextOptions):
    """RULER's synthetic tasks; ``data`` is the essay haystack (niah_single_2/3, niah_multikey_1, niah_multivalue,
    niah_multiquery). A suite's section, the subcommand's flags and ``ruler()``'s keywords (of the text options
    only ``max_docs``: the harness takes the haystack itself)."""

    lengths: list[Any] = option(help="lengths in tokens; as RULER's, each holds the prompt and the tokens to generate")
    tasks: list[str] | None = option(
        None,
        help="RULER tasks: niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery, vt, cwe, fwe "
        "(default: all eleven)",
    )
    samples: int = option(10, help="prompts per task and length")
    seed: int = option(0, help="seed")
    max_new_tokens: int | None = option(None, help="tokens generated (default: RULER's per task)")
    chat_template: bool = option(
        True, help="wrap prompts in the tokenizer's chat template when it has one, as RULER does for instruct models"
    )
    sliding_window: SlidingWindowMode = option("auto", help=WINDOW_HELP)

    def __post_init__(self):
        check_lengths(self)
        check_positive(self, "samples", "max_new_tokens")
        if self.tasks is not None:
            self.tasks = check_tasks(self.tasks)


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


# ------------------------------------------------------------------------------------------ the task
def _run(model, tokenizer, options: RulerOptions, context: Context) -> list[dict]:
    return ruler(model, tokenizer, options=options, haystack=context.texts, **context.common()).records


def _reference(records: list[dict], lengths: list[int]) -> int:
    """The length the relative effective length is measured from: the model's original context when the run
    records one (a scaled model) and it was measured, else the shortest length measured."""
    original = {r.get("original_length") for r in records} - {None}
    if len(original) == 1 and (n := original.pop()) in lengths:
        return n
    return min(lengths)


def _summarize(records: list[dict]) -> dict[str, list[dict]]:
    """Per (run, RULER task, length): the mean score with its Wilson interval, RULER's score (percent, rounded to
    2 decimals) and the empty answers; per (run, length): the average of RULER's task scores and how many tasks
    it is over; per run: the effective lengths (``effective.effective_lengths``, RULER's threshold, and 90% of
    the score at the original context or the shortest length)."""
    runs: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        runs[label_of(r)].append(r)
    rows, effective = [], []
    for label, mine in runs.items():
        t = tables(mine)
        for name, by in t["accuracy"].items():
            for length in by:
                xs = [float(r["score"]) for r in mine if r["ruler_task"] == name and r["length"] == length]
                cell = proportion(xs)
                rows.append(
                    {
                        "label": label,
                        "task": name,
                        "length": length,
                        **cell,
                        "samples": cell["trials"],
                        "score": t["scores"][name][length],
                        "empty": t["empty"][name][length],
                    }
                )
        for length, avg in t["average"].items():
            rows.append(
                {
                    "label": label,
                    "task": "average",
                    "length": length,
                    "score": avg,
                    "accuracy": avg / 100,
                    "tasks": t["tasks"],
                    "ruler_tasks": RULER_TASKS,
                }
            )
        if t["average"]:
            eff = effective_lengths(t["average"], reference_length=_reference(mine, sorted(t["average"])))
            effective.append({"label": label, **eff.as_dict(), "tasks": t["tasks"]})
    return {"ruler": rows, "ruler_effective": effective}


def _cell(r: dict | None, average: bool) -> str:
    if r is None:
        return ""
    if average:
        return f"**{r['score']:.2f}**"
    empty = f"; {r['empty']} empty" if r.get("empty") else ""
    if "score" not in r:  # a summary written before RULER's rounding was reported
        return f"{100 * r['accuracy']:.1f}"
    return f"{r['score']:.2f} (n={r['trials']}; {100 * r['low']:.0f}-{100 * r['high']:.0f}{empty})"


def _effective_lines(eff: dict) -> list[str]:
    def name(n):
        return length_name(n) if n is not None else "none (no length reaches it)"

    return [
        (
            f"Effective length (RULER's rule: the longest length whose average is >= {eff['threshold']:g}, RULER's "
            f"threshold, Llama-2-7B's 13-task average at 4k; this average is over {eff['tasks']} tasks): "
            f"**{name(eff['length'])}**."
        ),
        "",
        (
            f"Relative effective length (the longest length keeping >= {100 * eff['keep']:g}% of the average at "
            f"{length_name(eff['reference_length'])}, {eff['reference_score']:.2f}): **{name(eff['relative_length'])}**."
        ),
        "",
    ]


def _render(summary: dict) -> list[str]:
    """Per run, a task x length table of RULER's scores (string_match_all, percent rounded to 2 decimals as
    RULER) with the average labelled with its task count and the effective lengths; with several runs first the
    averages side by side."""
    rows = summary.get("ruler")
    if not rows:
        return []
    effective = {e["label"]: e for e in summary.get("ruler_effective", [])}
    lines = ["## RULER synthetic tasks (string_match_all, %)", ""]
    lengths = sorted({r["length"] for r in rows})
    labels = labels_of(rows)
    averages = [r for r in rows if r["task"] == "average"]
    counts = sorted({r["tasks"] for r in averages})
    if len(labels) > 1 and averages:
        mean = {(r["label"], r["length"]): r for r in averages}
        lines += [
            f"Average ({' / '.join(average_label(c) for c in counts)}; not comparable to RULER's published averages):",
            "",
            "| length | " + " | ".join(labels) + " |",
            "|---:|" + "---:|" * len(labels),
        ]
        for n in lengths:
            cells = [_cell(mean.get((lb, n)), True) for lb in labels]
            lines.append(f"| {length_name(n)} | " + " | ".join(cells) + " |")
        lines.append("")
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        table = {(r["task"], r["length"]): r for r in mine}
        names = [t for t in dict.fromkeys(r["task"] for r in mine) if t != "average"]
        count = next((r["tasks"] for r in mine if r["task"] == "average"), len(names))
        lines += [
            f"### {label}",
            "",
            (
                "Each cell: RULER's score, the mean sample score in % rounded to 2 decimals (samples; 95% Wilson "
                "interval, %; answers left empty). The length holds the prompt and the tokens to generate, as RULER's."
            ),
            "",
        ]
        lines += ["| task | " + " | ".join(length_name(n) for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
        for name in names:
            lines.append(f"| {name} | " + " | ".join(_cell(table.get((name, n)), False) for n in lengths) + " |")
        if any(r["task"] == "average" for r in mine):
            cells = [_cell(table.get(("average", n)), True) for n in lengths]
            lines.append(f"| **{average_label(count)}** | " + " | ".join(cells) + " |")
        lines.append("")
        if label in effective:
            lines += _effective_lines(effective[label])
    return lines


def _plot(summary: dict, out: Path) -> dict[str, Path]:
    """Per run, a RULER task x length heatmap (the average last)."""
    rows = summary.get("ruler", [])
    files = {}
    for label in labels_of(rows):
        name = f"ruler_heatmap_{slug(label)}"
        files[name] = plot_heatmap(
            [r for r in rows if r["label"] == label],
            out / f"{name}.png",
            title=f"RULER: {label}",
            row_key="task",
            row_names=str,
            ylabel="task",
            order=lambda names: [t for t in names if t != "average"] + ["average"],
        )
    return files


TASK = Task(
    name="ruler",
    help="RULER's synthetic tasks (needles, variable tracking, word counts) per length",
    title="RULER synthetic tasks",
    options=RulerOptions,
    run=_run,
    summarize=_summarize,
    render=_render,
    plot=_plot,
)
