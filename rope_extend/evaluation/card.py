"""``rope-extend card``: one context-extension claim, measured the way it is judged, as a model-card block.

    rope-extend card smollm2-135m --method yarn --factor 4 --out card-yarn
    rope-extend card ./finetuned --original smollm2-135m --out card-ft      # a fine-tune, against its base

What it measures, with the same prompts everywhere (every prompt is built from ``(seed, task, length, trial)``
and the tokenizer, so two backends or two models answer the same questions):

- **RULER** (``evaluation.ruler``: RULER's length accounting and chat template) at each length, its average over
  the tasks run (labelled with their count) and both **effective lengths** (``evaluation.effective``: RULER's
  threshold, and the share kept of the model's own score at L);
- **passkey** accuracy by length, with Wilson intervals, and **perplexity** by length;
- **retention** inside L (``evaluation.retention``): the same RULER samples, passkey trials and documents for the
  original model (the unpatched model, or ``--original``) and the patched or fine-tuned one, as a ratio with a
  paired bootstrap interval;
- **the served artifact**: when the method exports to GGUF exactly (``export.routes``) and llama-cpp-python is
  installed (the ``llama`` extra), the exported file is measured in llama.cpp (``evaluation.engines``) at every
  length, and the card says whether the backends agree within ``AGREE``: perplexity within 0.1% relative,
  retrieval scores within one trial's share per length; with ``--engine vllm``, the vLLM export in ``vllm.LLM``
  (``evaluation.vllm_engine``), passkey where its answer fits in the export's length.

Which tasks and lengths each measurement runs at is decided, and every check that needs no model output made, before
the first measurement (``evaluation.card_measurements``): what was given is measured exactly or refused, what was
left to the defaults fits the model, and each thing left out is one line, printed first and kept in the card.

Everything goes through the evaluation runner into ``OUT/records.jsonl``; ``--resume`` reuses a record only when
model (its digest: weights and config, or the GGUF's SHA-256), tokenizer, data and settings match. The card
(``card.md``, ``card.json``) and one figure (``card.png``) are written when complete, under temporary names.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..errors import RopeExtendError
from ..export import export
from ..hf.reading import text_config
from ..io import write_json, write_text
from ..loading import load_model, load_tokenizer, model_config
from ..patching import patch, unpatch
from ..shipped_switch import exact_shipped_switch
from .card_measurements import Measurements, check_engine, decide_measurements, default_lengths  # noqa: F401 (default_lengths: importable from here, as before)
from .card_options import CardOptions
from .card_writing import SERVED, figure, markdown
from .engines import LlamaCppModel
from .identity import tokenizer_digest
from .passkey import passkey
from .perplexity import perplexity
from .records import RecordLog, check_records_file
from .report import wilson
from .retention import retention_from_records
from .ruler.harness import ruler
from .tasks.base import Common
from .vllm_engine import VllmModel

AGREE = {"perplexity": 1e-3}  # relative; retrieval: within 1 / trials (one answer) per length
OWNED = {"records.jsonl", "card.md", "card.json", "card.png"}


@dataclass
class Backend:
    """One model measured: RULER averages, passkey accuracy and perplexity by length."""

    name: str
    ruler: dict[int, float] = field(default_factory=dict)
    ruler_tasks: int = 0
    passkey: dict[int, float] = field(default_factory=dict)
    passkey_interval: dict[int, tuple[float, float]] = field(default_factory=dict)
    perplexity: dict[int, float] = field(default_factory=dict)
    effective: dict[str, Any] | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class Bench:
    """What every backend of a card is measured on: the ``options``, the ``records`` file
    every harness appends to (with ``resume``: what the card measured earlier is reused, nothing twice) and the
    ``reference`` length whose RULER score the relative effective length keeps (L)."""

    options: CardOptions
    records: Path
    reference: int
    resume: bool = True


def measure(model, tokenizer, name: str, plan: Measurements, bench: Bench):
    """RULER, passkey and perplexity of ``model`` at the plan's lengths, on ``bench``."""

    start = time.perf_counter()
    options = bench.options
    common = Common(records=bench.records, resume=bench.resume, progress=True, run={"label": name})
    out = Backend(name)
    records: list[dict] = []
    if plan.tasks and plan.ruler_lengths:
        r = ruler(
            model,
            tokenizer,
            plan.ruler_lengths,
            tasks=plan.tasks,
            samples=options.samples,
            max_new_tokens=options.answer_tokens,
            budgets=plan.budgets,
            seed=options.seed,
            chat_template=options.chat_template,
            threshold=options.threshold,
            keep=options.keep,
            reference_length=bench.reference if bench.reference in plan.ruler_lengths else None,
            **common,
        )
        out.ruler, out.ruler_tasks, records = dict(r.average), r.tasks, records + r.records
        out.effective = r.effective.as_dict() if r.effective is not None else None
    p = passkey(model, tokenizer, plan.lengths, trials=options.trials, seed=options.seed, **common)
    out.passkey = dict(p.accuracy_by_length)
    out.passkey_interval = {n: wilson(a * options.trials, options.trials) for n, a in p.accuracy_by_length.items()}
    records += p.records
    if plan.perplexity_lengths:
        ppl = perplexity(model, tokenizer, plan.texts, plan.perplexity_lengths, max_docs=options.docs, **common)
        out.perplexity, records = dict(ppl.perplexity), records + ppl.records
    out.seconds = round(time.perf_counter() - start, 1)
    return out, records


def agreement(a: Backend, b: Backend, trials: int) -> dict[str, Any]:
    """Where two backends measured the same thing: the largest differences and whether they are within ``AGREE``."""
    common = sorted(set(a.perplexity) & set(b.perplexity))
    ppl = max((abs(a.perplexity[n] - b.perplexity[n]) / a.perplexity[n] for n in common), default=0.0)
    # every length both measured (vLLM measures no passkey where its answer would pass the export's length)
    pk = max((abs(a.passkey[n] - b.passkey[n]) for n in set(a.passkey) & set(b.passkey)), default=0.0)
    ru = max((abs(a.ruler[n] - b.ruler[n]) / 100 for n in set(a.ruler) & set(b.ruler)), default=0.0)
    one = 1 / trials + 1e-9
    return {
        "perplexity_rel_diff": ppl,
        "passkey_abs_diff": pk,
        "ruler_abs_diff": ru,
        "agree": ppl <= AGREE["perplexity"] and pk <= one and ru <= one,
    }


def hardware() -> dict[str, Any]:
    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _model(name: str, dtype: str):
    return load_model(name, dtype=dtype, attn_implementation="sdpa")


def check_original(original: str, model_name: str, tok) -> None:
    """``--original`` answers MODEL's prompts (every prompt is built with MODEL's tokenizer ``tok``, so that both
    models answer the same questions): its embedding must hold every id of ``tok``, and its own tokenizer must be
    ``tok`` (``identity.tokenizer_digest``: the same ids for the same text), else the same ids would mean other
    words to it. Read from its config and tokenizer, before any model loads."""
    rows = getattr(text_config(model_config(original)), "vocab_size", None)
    if isinstance(rows, int) and rows < len(tok):
        raise RopeExtendError(
            f"--original {original} has a vocabulary of {rows} tokens, fewer than the {len(tok)} of {model_name}'s "
            "tokenizer, which builds the prompts both models answer: give the original of this model (the same "
            "tokenizer)"
        )
    theirs = load_tokenizer(original)
    if tokenizer_digest(theirs) != tokenizer_digest(tok):
        raise RopeExtendError(
            f"--original {original} has another tokenizer ({len(theirs)} tokens) than {model_name} ({len(tok)} "
            "tokens): retention compares both models on the same prompts, which mean the same only with the same "
            "tokenizer; give the original of this model"
        )


def card(
    model_name: str,
    out: str | os.PathLike,
    *,
    method: str = "none",
    scaling_kwargs: dict[str, Any] | None = None,
    original: str | None = None,
    options: CardOptions | None = None,
    resume: bool = False,
    dtype: str = "float32",
    claim: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Measure the card of ``model_name`` patched with ``method`` (or as configured, ``method="none"``) and write
    it into ``out`` (see the module docstring). ``original``: the model retention is measured against (default:
    ``model_name`` unpatched). ``claim``: called once the model, scaling, lengths and texts are checked and before
    anything is written (the CLI claims ``out`` there, so a bad input leaves no folder behind); it decides what
    earlier records may stay (``--resume``) or go (``--overwrite``), so they are not checked here then. Returns the card as
    a dict (what ``card.json`` holds)."""
    options = options or CardOptions()
    out = Path(out)
    if claim is None and (out / "records.jsonl").exists() and not resume:  # a claim checks it, --overwrite too
        raise RopeExtendError(
            f"{out} already holds a card's records: pass resume=True (--resume) to continue it, or give another folder"
        )
    check_records_file(out / "records.jsonl", resume=resume)  # a folder, a link or a bad record: before any load
    check_engine(options)  # --engine without llama-cpp-python (--engine vllm without vLLM): refused before any load
    began = time.perf_counter()
    tok = load_tokenizer(model_name)
    if original is not None:
        check_original(original, model_name, tok)  # before anything loads or is measured
    model = _model(model_name, dtype)
    if method != "none":
        patch(model, method, **(scaling_kwargs or {}))
    else:  # as loaded; a shipped longrope runs with its cached keys turned at the switch (shipped_switch)
        said = exact_shipped_switch(model)
        if said is not None:
            print(f"rope-extend card: {said}", file=sys.stderr)
    plan = decide_measurements(model, tok, model_name, options)
    for line in plan.left_out:  # before anything is measured: what this card will not hold, and why
        print(f"rope-extend card: leaves out {line}", file=sys.stderr)
    if claim is not None:
        claim()  # everything checked: now write
    out.mkdir(parents=True, exist_ok=True)
    scaling, lengths = plan.scaling, plan.lengths
    L = scaling.original_max_position_embeddings
    label = scaling.describe()
    # every harness appends to one records file: what this card measured earlier is reused, nothing twice
    bench = Bench(options, out / "records.jsonl", L)
    backends: dict[str, Backend] = {}
    backends["transformers"], patched_records = measure(model, tok, label, plan, bench)
    served: dict[str, Any] | None = None
    if plan.served is None:
        served = _served(model, tok, label, plan.at(options.engine_lengths or lengths), bench, options.engine_name)
        backends[served["engine"]] = served.pop("backend")
    elif options.engine is not False:
        served = {"skipped": plan.served}
    # the original (unpatched, or --original) inside L: the same examples
    if original is None and method != "none":
        unpatch(model)
    else:
        model = _model(original or model_name, dtype)  # the prompts stay those of MODEL's tokenizer
    inside = plan.at([n for n in lengths if n <= L])
    backends["original"], original_records = measure(model, tok, "original", inside, bench)
    kept = retention(original_records, [r for r in patched_records if r["length"] <= L], L)
    result = _card_json(
        model_name, original, plan, options, backends=backends, kept=kept, served=served, began=began, bench=bench
    )
    write_json(out / "card.json", result)
    write_text(out / "card.md", markdown(result))
    figure(result, out / "card.png")
    return result


def _card_json(model_name, original, plan: Measurements, options, *, backends, kept, served, began, bench) -> dict:
    """The card as ``card.json`` holds it: what was measured, at which lengths, by which backend, the retention
    inside L and the agreement of the served GGUF; ``began``: ``time.perf_counter()`` before the first load."""
    scaling, lengths = plan.scaling, plan.lengths
    return {
        "model": model_name,
        "original": original or model_name,
        "scaling": scaling.describe(),
        "scaling_from": plan.scaling_from,  # "config": a fine-tune's card is no patch's
        "original_length": scaling.original_max_position_embeddings,
        "target_length": scaling.target_length,
        "lengths": lengths,
        "ruler_lengths": plan.ruler_lengths,
        "ruler_tasks": plan.tasks,
        "answer_tokens": plan.budgets,
        "perplexity_lengths": plan.perplexity_lengths,
        "left_out": plan.left_out,
        "options": asdict(options),
        "backends": {k: asdict(v) for k, v in backends.items()},
        "retention": kept,
        "served": served,
        "agreement": (
            agreement(backends["transformers"], backends[served["engine"]], options.trials)
            if served is not None and "engine" in served
            else None
        ),
        "seconds": round(time.perf_counter() - began, 1),
        "hardware": hardware(),
        "records": len(RecordLog(bench.records, resume=True).records),
    }


def retention(original: list[dict], patched: list[dict], within: int) -> dict[str, dict[str, Any]]:
    """``retention_from_records`` per measurement; one the original never scores on has no ratio: it is kept
    with the reason (``{"undefined": ...}``) instead of failing the card."""
    out: dict[str, dict[str, Any]] = {}
    for task in sorted({r["task"] for r in original}):
        mine = [r for r in original if r["task"] == task], [r for r in patched if r["task"] == task]
        try:
            out.update({k: v.as_dict() for k, v in retention_from_records(*mine, within=within).items()})
        except RopeExtendError as exc:
            out[task] = {"undefined": str(exc)}
    return out


def _served(model, tok, label: str, plan: Measurements, bench: Bench, engine: str) -> dict[str, Any]:
    """The export of the patched model, measured in ``engine`` at the plan's lengths: a GGUF in llama.cpp, or a
    vLLM folder in ``vllm.LLM`` (passkey at the lengths whose answer fits in the export, ``Measurements.served_passkey``).
    In a temporary folder: records name the file's or folder's digest, the same for the same model and export."""

    lengths = plan.lengths
    with tempfile.TemporaryDirectory() as tmp:
        if engine == "vllm":
            result = export(model, "vllm", Path(tmp) / "served", tokenizer=tok)  # the patched model's scaling
            opened: Any = VllmModel(result.out)
            plan = replace(plan, lengths=lengths if plan.served_passkey is None else plan.served_passkey)
        else:
            result = export(model, "gguf", Path(tmp) / "served.gguf", tokenizer=tok)
            scaling = plan.scaling
            opened = LlamaCppModel(
                result.out,
                n_ctx=max(lengths) + 256,  # RULER's budgets are inside the length; passkey adds 10 tokens
                method=scaling.method.name,
                factor=scaling.factor,
                original_length=scaling.original_max_position_embeddings,
            )
        with opened as served:
            backend, _ = measure(served, tok, f"{label} ({SERVED[engine][1]})", plan, bench)
            digest = served.digest
    return {"engine": engine, "how": result.how, "file_digest": digest, "backend": backend, "lengths": lengths}
