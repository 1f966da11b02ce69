"""``rope-extend eval compare``: one model, several scalings, every task of a suite, one report folder.

The model is loaded once; for each method it is patched (``method: none`` leaves it as loaded), every
task runs with its records appended to ``OUT/records.jsonl``, and the model is unpatched again. The report
(results.json, results.csv, report.md, plots) is written at the end from all the records of this suite.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .. import schema
from ..errors import RopeExtendError
from ..hf import config as hf_config
from ..hf.reading import text_config
from ..io import claim_output_dir, write_text
from ..loading import load_model, load_tokenizer
from ..patching import patched, unpatch
from .records import check_records_file, earlier_records, import_records
from .report import owned, write_report
from .suite import MethodSpec, Suite, default_out, resolve_path
from .tasks.base import Context, load_task_texts


def apply(model, spec: MethodSpec) -> None:
    """Put ``model`` under ``spec``'s scaling (undoing any earlier rope-extend patch first)."""
    if patched(model) is not None:
        unpatch(model)
    spec.apply(model)


def check_methods(model, suite: Suite) -> None:
    """Every method of the suite against the model's config, before the first one runs."""
    config = text_config(model.config)
    for spec in suite.methods:
        if spec.scales:
            hf_config.scaling_for(config, spec.method, **spec.patch_kwargs())


def run_suite(
    suite: Suite,
    *,
    out: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    model=None,
    tokenizer=None,
    on_method: Callable[[MethodSpec], None] | None = None,
    records_from: Sequence[str | Path] = (),
) -> dict[str, Any]:
    """Run every method x task of ``suite``; returns ``{"records": [...], "files": {...}, "out": path}``.

    ``resume`` continues an earlier run in ``out``; ``overwrite`` replaces it (``io.claim_output_dir``).
    ``on_method(spec)`` is called before each method is applied (a caller's progress line). ``records_from``
    (records.jsonl / results.json files or run folders) are added to ``out``'s records first
    (``records.import_records``): what they hold under this suite's settings is not measured again."""
    out = Path(out) if out is not None else default_out(suite)
    records_path = out / "records.jsonl"
    claim_output_dir(out, kind="eval", owned=owned, resume=resume, overwrite=overwrite, check_only=True)
    earlier = earlier_records(records_from)  # a bad file fails before the model is loaded
    check_records_file(records_path, resume=resume)  # so does a bad OUT/records.jsonl
    texts = {
        task.name: load_task_texts(options, resolve_path(suite, options.data))
        for task, options in suite.tasks()
        if task.reads_texts
    }  # bad data fails before the model is loaded
    if model is None:
        name = resolve_path(suite, suite.model)
        model = load_model(name, dtype=suite.dtype, device=suite.device, trust_remote_code=suite.trust_remote_code)
        tokenizer = load_tokenizer(
            resolve_path(suite, suite.tokenizer) or name, trust_remote_code=suite.trust_remote_code
        )
    elif tokenizer is None:
        raise RopeExtendError("run_suite: give the tokenizer with the model")
    check_methods(model, suite)
    claim_output_dir(out, kind="eval", owned=owned, resume=resume, overwrite=overwrite)  # checked: now write
    import_records(records_path, earlier)
    records: list[dict] = []
    try:
        for spec in suite.methods:
            if on_method is not None:
                on_method(spec)
            apply(model, spec)
            for task, options in suite.tasks():
                context = Context(
                    texts=texts.get(task.name),
                    records=records_path,
                    resume=True,
                    progress=progress,
                    run={"label": spec.name()},
                )
                records += task.run(model, tokenizer, options, context)
    finally:
        if patched(model) is not None:
            unpatch(model)
    title = suite.title or f"{Path(suite.path).stem if suite.path else 'suite'}: {suite.model}"
    notes = [f"model: `{suite.model}`", "methods: " + ", ".join(f"`{m.name()}`" for m in suite.methods)]
    files = write_report(out, records, title=title, notes=notes, extra={"suite": schema.to_dict(suite)})
    if suite.path:
        write_text(out / "suite.yaml", Path(suite.path).read_text(encoding="utf-8"))
    return {"records": records, "files": files, "out": out}
