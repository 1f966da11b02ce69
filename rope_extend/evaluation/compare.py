"""``rope-extend eval compare``: one model, several scalings, every task of a suite, one report folder.

The model is loaded once; for each method it is patched (``method: none`` leaves it as loaded), every
task runs with its records appended to ``OUT/records.jsonl``, and the model is unpatched again. The report
(results.json, results.csv, report.md, plots) is written at the end from all the records of this suite.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..errors import RopeExtendError
from ..io import write_text
from .records import RecordLog
from .suite import Suite, default_out, resolve_path


def _texts(suite: Suite, task) -> list[str]:
    from .data import default_texts, load_texts

    source = resolve_path(suite, task.data)
    if source is None:
        return default_texts()
    return load_texts(source, text_field=task.text_field, split=task.split, max_docs=task.max_docs)


def apply(model, spec) -> None:
    """Put ``model`` under ``spec``'s scaling (undoing any earlier rope-extend patch first)."""
    import rope_extend

    if rope_extend.patched(model) is not None:
        rope_extend.unpatch(model)
    if spec.method != "none":
        rope_extend.patch(model, spec.method, **spec.patch_kwargs())


def run_suite(suite: Suite, *, out: str | Path | None = None, resume: bool = False, progress: bool = True,
              model=None, tokenizer=None) -> dict[str, Any]:
    """Run every method x task of ``suite``; returns ``{"records": [...], "files": {...}, "out": path}``."""
    import rope_extend
    from .niah import niah
    from .passkey import passkey
    from .perplexity import perplexity
    from .report import write_report

    out = Path(out) if out is not None else default_out(suite)
    records_path = out / "records.jsonl"
    RecordLog(records_path, resume=resume)  # refuses to touch earlier results unless resuming
    texts = {name: _texts(suite, task) for name, task in (("niah", suite.niah), ("perplexity", suite.perplexity))
             if task is not None}  # bad data fails before the model is loaded
    if model is None:
        from ..loading import load_model, load_tokenizer

        name = resolve_path(suite, suite.model)
        model = load_model(name, dtype=suite.dtype, device=suite.device, trust_remote_code=suite.trust_remote_code)
        tokenizer = load_tokenizer(resolve_path(suite, suite.tokenizer) or name, trust_remote_code=suite.trust_remote_code)
    elif tokenizer is None:
        raise RopeExtendError("run_suite: give the tokenizer with the model")
    records: list[dict] = []
    common = dict(records=records_path, resume=True, progress=progress)
    try:
        for spec in suite.methods:
            apply(model, spec)
            run = {"label": spec.name()}
            if suite.passkey:
                t = suite.passkey
                records += passkey(model, tokenizer, t.lengths, depths=t.depths, trials=t.trials, seed=t.seed,
                                   key_range=tuple(t.key_range), max_new_tokens=t.max_new_tokens, run=run, **common).records
            if suite.niah:
                t = suite.niah
                extra = {k: getattr(t, k) for k in ("needle", "question", "answer") if getattr(t, k) is not None}
                records += niah(model, tokenizer, texts["niah"], t.lengths, depths=t.depths, trials=t.trials, seed=t.seed,
                                max_new_tokens=t.max_new_tokens, run=run, **extra, **common).records
            if suite.perplexity:
                t = suite.perplexity
                records += perplexity(model, tokenizer, texts["perplexity"], t.lengths, stride=t.stride,
                                      chunk_size=t.chunk_size, sliding_window=t.sliding_window, run=run, **common).records
    finally:
        if rope_extend.patched(model) is not None:
            rope_extend.unpatch(model)
    title = suite.title or f"{Path(suite.path).stem if suite.path else 'suite'}: {suite.model}"
    notes = [f"model: `{suite.model}`", "methods: " + ", ".join(f"`{m.name()}`" for m in suite.methods)]
    files = write_report(out, records, title=title, notes=notes, extra={"suite": asdict(suite)})
    if suite.path:
        write_text(out / "suite.yaml", Path(suite.path).read_text(encoding="utf-8"))
    return {"records": records, "files": files, "out": out}
