"""``rope-extend demo``: every piece of rope-extend on the bundled testbed model, offline.

1. Zero-shot: the bundled model (trained at ``L`` = 256 tokens) under no scaling, linear, ntk, dynamic,
   yarn and dynamic_yarn (factor 4), and the attention methods self_extend (group 16, reaching 12x ``L``),
   dual_chunk and rerope with log-n, at 1x, 2x, 4x and 8x ``L``: passkey accuracy and perplexity on the
   held-out corpus.
2. Fine-tune with the tiny recipe (``bundled-yarn-4x``: YaRN, 4x) on freshly generated
   documents sized for 4x ``L``.
3. The fine-tuned model, evaluated the same way.
4. One table on the terminal; a report folder with results.json/csv, report.md and the plots.
5. The long-context card of the bundled model under YaRN x4 (``rope-extend card``, ``card/``): RULER's needle
   tasks that fit ``L`` (niah_single_1 and niah_single_2: the model was taught RULER's formats at ``L``), passkey
   and perplexity at ``L``, 2 ``L`` and 4 ``L``, the effective lengths and the retention inside ``L``.

Deterministic under ``--seed`` (data, trials and training). ``--quick`` runs a smaller version of each
step in under a minute (39 s on 2 idle cores; the full run 4.9 minutes). One line per stage on stderr gives
the stage, the time elapsed and an estimate of the time left.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .io import claim_output_dir

if TYPE_CHECKING:  # evaluation is imported when a demo runs it, not when the command line is read
    from .evaluation.suite import MethodSpec

METHODS = ["none", "linear", "ntk", "dynamic", "yarn", "dynamic_yarn", "self_extend", "dual_chunk", "rerope logn"]
# the attention methods take no factor: (method, params) per demo name. self_extend's default group of 8 reaches
# (L - L/4) * 8 + L/4 = 6.25 L; a group of 16 reaches 12.25 L, past the demo's 8 L.
ATTENTION: dict[str, tuple[str, dict[str, Any]]] = {
    "self_extend": ("self_extend", {"group_size": 16}),
    "dual_chunk": ("dual_chunk", {}),
    "rerope logn": ("rerope", {"logn": True}),
}
# what a demo writes into its folder (--overwrite removes these, and refuses a folder holding anything else)
OWNED = {
    "zero-shot",
    "fine-tuned",
    "finetune",
    "data-4x",
    "records.jsonl",
    "results.json",
    "results.csv",
    "report.md",
    "passkey.png",
    "perplexity.png",
    "card",
}
FACTOR = 4.0
FINETUNED = "yarn x4 fine-tuned"
# relative cost of each stage (seconds measured on 2 idle cores, full run), for the time-left estimate
COST = {"attention": 15.0, "frequencies": 8.5, "fine-tune": 160.0, "card": 12.0}
# the card's RULER tasks: the two whose prompt and 64-token answer budget fit L = 256 (the others are too long)
CARD_TASKS = ["niah_single_1", "niah_single_2"]
CARD = "card (yarn x4)"


class Stages:
    """One progress line per stage on stderr: ``[demo] stage 3/11: ntk x4 | 0:21 elapsed | about 2:40 left``.

    The time left comes from this run's own speed: each stage still to run takes what the stages of its kind
    (its ``COST``) took so far, on average, and a kind not seen yet its ``COST`` times this run's seconds per unit of
    cost. Stage times are measured from the first stage on, so loading the model does not count as stage work.
    When the cores are busy with other work (the load average above the core count), the line says so."""

    def __init__(self, stages: list[tuple[str, float]], start: float):
        self.names = [name for name, _ in stages]
        self.costs = [cost for _, cost in stages]
        self.start, self.done = start, 0
        self.took: list[float] = []  # seconds each finished stage took
        self.last = start

    def next(self, name: str | None = None) -> str:
        i = self.done
        if i >= len(self.names):
            raise RuntimeError(f"demo: a stage past the last of {len(self.names)}")
        now = time.perf_counter()
        if i:
            self.took.append(now - self.last)
        self.last = now
        left = self.left(i)
        eta = f"about {_clock(left)} left" if left is not None else "estimating the time left"
        busy = _contention()
        line = f"[demo] stage {i + 1}/{len(self.names)}: {name or self.names[i]} | {_clock(now - self.start)} elapsed | {eta}"
        print(line + (f" ({busy})" if busy else ""), file=sys.stderr, flush=True)
        self.done += 1
        return line

    def left(self, i: int) -> float | None:
        """Seconds for stages ``i ..`` (None before any stage has finished)."""
        if not self.took:
            return None
        seen: dict[float, list[float]] = {}
        for cost, took in zip(self.costs, self.took, strict=False):
            seen.setdefault(cost, []).append(took)
        rate = sum(self.took) / (sum(self.costs[: len(self.took)]) or 1.0)  # this run's seconds per unit of cost
        return sum(sum(seen[c]) / len(seen[c]) if c in seen else c * rate for c in self.costs[i:])


def _contention() -> str | None:
    """A note when other work holds the cores (1-minute load average above the core count), else None."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):  # no load average on this platform
        return None
    return f"the cores are shared: load {load:.1f} on {cores}, so stages run slower" if load > cores + 0.5 else None


def _clock(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m}:{s:02d}"


@dataclass
class Effort:
    """How much the demo measures and trains: the quick run's or the full one's."""

    trials: int
    ppl_docs: int
    steps: int
    documents: int
    card_samples: int  # RULER samples per task and length on the card

    @staticmethod
    def of(quick: bool) -> Effort:
        return (
            Effort(trials=3, ppl_docs=2, steps=12, documents=150, card_samples=2)
            if quick
            else Effort(trials=20, ppl_docs=8, steps=200, documents=3000, card_samples=10)
        )


def _stage_per_method(stages: Stages) -> Callable[[MethodSpec], None]:
    """``run_suite``'s ``on_method``: each method starts the next stage (its progress line)."""

    def on_method(spec: MethodSpec) -> None:
        stages.next(spec.name())

    return on_method


def evaluate(
    model,
    tokenizer,
    methods: list[str],
    lengths: list[int],
    effort: Effort,
    out: Path,
    *,
    seed: int,
    labels: dict[str, str] | None = None,
    stages: Stages | None = None,
) -> list[dict]:
    """Passkey and perplexity of ``model`` under each method, records appended to ``out/records.jsonl``."""
    from . import bundled
    from .evaluation.compare import run_suite
    from .evaluation.passkey import PasskeyOptions
    from .evaluation.perplexity import PerplexityOptions
    from .evaluation.suite import MethodSpec, make_suite

    specs = []
    for m in methods:
        label = (labels or {}).get(m)
        if m in ATTENTION:
            method, params = ATTENTION[m]
            specs.append(MethodSpec(method=method, params=params, label=label or m))
        else:
            specs.append(MethodSpec(method=m, factor=None if m == "none" else FACTOR, label=label))
    suite = make_suite(
        model="bundled",
        methods=specs,
        passkey=PasskeyOptions(lengths=lengths, trials=effort.trials, seed=seed),
        perplexity=PerplexityOptions(lengths=lengths, data=str(bundled.EVAL_CORPUS), max_docs=effort.ppl_docs),
    )
    on_method = None if stages is None else _stage_per_method(stages)
    return run_suite(suite, out=out, model=model, tokenizer=tokenizer, on_method=on_method)["records"]


def finetune(out: Path, L: int, effort: Effort, seed: int):
    """Run the tiny recipe on documents generated for 4x ``L``; returns the fine-tuned model folder."""
    from .bundled.build import write_pretraining_data
    from .training import train
    from .training.args import load_args

    data = write_pretraining_data(out / "data-4x", seed=seed + 1, documents=effort.documents, context=int(FACTOR * L))
    args = load_args(
        "bundled-yarn-4x",
        [
            f"data.path={data / 'train.jsonl'}",
            f"output_dir={out / 'finetune'}",
            "overwrite_output_dir=true",
            f"max_steps={effort.steps}",
            f"seed={seed}",
            f"save_steps={effort.steps}",
            f"warmup_steps={max(1, effort.steps // 20)}",
        ],
    )
    # the loop's summary line (and any library log on stdout, DeepSpeed's among them) is `rope-extend train`'s
    # stdout; the demo's stdout is its own table and card line only, so the fine-tune writes on stderr
    with contextlib.redirect_stdout(sys.stderr):
        return train(args).final_dir


def long_context_card(out: Path, effort: Effort, seed: int) -> tuple[dict, str]:
    """The card of the bundled model under YaRN x4 in ``out``: ``(card, one line saying what it shows)``."""
    from .evaluation.card import card
    from .evaluation.card_options import CardOptions

    options = CardOptions(samples=effort.card_samples, tasks=CARD_TASKS, trials=effort.trials, engine=False, seed=seed)
    result = card("bundled", out, method="yarn", scaling_kwargs={"factor": FACTOR}, options=options)
    patched = result["backends"]["transformers"]
    ruler = ", ".join(f"{patched['ruler'][n]:.0f} at {n}" for n in result["ruler_lengths"])
    effective = (patched.get("effective") or {}).get("length") or "none"
    return result, f"RULER (yarn x4) {ruler}; effective length {effective} (L = {result['original_length']})"


def table(summary: dict, lengths: list[int]) -> str:
    """Method x length: passkey accuracy and perplexity, one line per method."""
    rows: dict[str, dict] = {}
    for r in summary.get("passkey", []):
        rows.setdefault(r["label"], {})[("passkey", r["length"])] = f"{100 * r['accuracy']:.0f}%"
    for r in summary.get("perplexity", []):
        rows.setdefault(r["label"], {})[("ppl", r["length"])] = f"{r['perplexity']:.2f}" if r["perplexity"] else "-"
    head = ["method"] + [f"passkey {n}" for n in lengths] + [f"ppl {n}" for n in lengths]
    lines = [head] + [
        [label] + [cells.get(("passkey", n), "-") for n in lengths] + [cells.get(("ppl", n), "-") for n in lengths]
        for label, cells in rows.items()
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        for line in lines
    ]
    footer = []
    trials = sorted({r["trials"] for r in summary.get("passkey", [])})
    if trials:
        from .evaluation.report import wilson

        n = trials[-1]
        spans = ", ".join(f"{k}/{n}: {100 * lo:.0f}-{100 * hi:.0f}%" for k in (n, n // 2) for lo, hi in [wilson(k, n)])
        footer = [f"passkey: {'/'.join(map(str, trials))} trials per cell; 95% Wilson intervals ({spans}) in report.md"]
    return "\n".join([text[0], "-" * len(text[0])] + text[1:] + footer)


def run(
    out: Path, *, quick: bool, seed: int, overwrite: bool, finetune_too: bool = True, card_too: bool = True
) -> dict:
    import torch

    from . import bundled
    from .evaluation.report import summarize, write_report

    claim_output_dir(
        out, kind="demo", owned=OWNED.__contains__, overwrite=overwrite, how="pass --overwrite to replace it"
    )
    torch.manual_seed(seed)
    effort = Effort.of(quick)
    start = time.perf_counter()
    model, tokenizer = bundled.load()
    L = bundled.trained_length()
    lengths = [L, 2 * L, 4 * L, 8 * L]
    print(
        f"[demo] bundled model trained at L={L}; lengths {lengths}; {effort.trials} passkey trials per length",
        file=sys.stderr,
    )
    stage_costs = [(m, COST["attention" if m in ATTENTION else "frequencies"]) for m in METHODS]
    if finetune_too:
        stage_costs += [(f"fine-tune ({effort.steps} steps)", COST["fine-tune"]), (FINETUNED, COST["frequencies"])]
    if card_too:
        stage_costs.append((CARD, COST["card"]))
    stages = Stages(stage_costs, start)
    records = evaluate(model, tokenizer, METHODS, lengths, effort, out / "zero-shot", seed=seed, stages=stages)
    if finetune_too:
        stages.next()
        tuned_dir = finetune(out, L, effort, seed)
        from .loading import load_model, load_tokenizer

        tuned, tuned_tok = load_model(str(tuned_dir)), load_tokenizer(str(tuned_dir))
        records += evaluate(
            tuned,
            tuned_tok,
            ["none"],
            lengths,
            effort,
            out / "fine-tuned",
            seed=seed,
            labels={"none": FINETUNED},
            stages=stages,
        )
    summary = summarize(records)
    notes = [
        (
            f"bundled model trained at {L} tokens; static methods at factor {FACTOR:g}; dynamic ones follow the "
            "length; attention methods (self_extend group 16, dual_chunk, rerope with log-n) keep plain RoPE"
        ),
        (
            f"passkey: {effort.trials} trials per length; perplexity: {effort.ppl_docs} held-out "
            "documents, one truncated window each"
        ),
        (f"`{FINETUNED}`: recipe bundled-yarn-4x, {effort.steps} steps"),
        f"seed {seed}; {'quick' if quick else 'full'} run",
    ]
    files = write_report(
        out,
        records,
        title="rope-extend demo: the bundled model",
        notes=notes,
        extra={"seed": seed, "quick": quick, "lengths": lengths},
    )
    text = table(summary, lengths)
    print(text)
    result: dict[str, Any] = {"summary": summary, "files": files, "table": text}
    if card_too:
        stages.next()
        result["card"], line = long_context_card(out / "card", effort, seed)
        print(f"\n{line}; card: {out / 'card' / 'card.md'}")
    print(
        f"\n[demo] report: {files['markdown']} (plots beside it); {time.perf_counter() - start:.0f} s", file=sys.stderr
    )
    return result


def register(sub) -> None:
    p = sub.add_parser("demo", help="zero-shot and fine-tuned comparison of the methods on the bundled model")
    p.add_argument("--quick", action="store_true", help="a smaller run of every step (under a minute)")
    p.add_argument("--out", default="runs/demo", help="report folder (default runs/demo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--no-finetune", action="store_true", help="zero-shot evaluation only")
    p.add_argument("--no-card", action="store_true", help="end without the long-context card")
    p.set_defaults(
        func=lambda a: (
            run(
                Path(a.out),
                quick=a.quick,
                seed=a.seed,
                overwrite=a.overwrite,
                finetune_too=not a.no_finetune,
                card_too=not a.no_card,
            )
            and 0
        )
    )
