"""``rope-extend eval TASK`` (one subcommand per registered task, its options from the task's dataclass),
``rope-extend eval compare`` and ``rope-extend plot spectrum``."""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

from ..arguments import (
    add_dtype_argument,
    add_folder_arguments,
    add_json_argument,
    add_method_arguments,
    add_model_arguments,
    add_progress_argument,
    scaling_from_args,
)
from ..schema import add_arguments
from .card_options import CardOptions
from .tasks.base import tasks


def _json_argument(p: argparse.ArgumentParser) -> None:
    add_json_argument(p, "print one line of JSON (the output folder, the summary, the files) instead of the tables")


def _print_result(args, report: Path, payload: dict) -> None:
    """The report's tables at the terminal and where the files went; or, with --json, one line for a program."""
    if args.json:
        print(json.dumps(payload, default=str))
        return
    print(report.read_text(encoding="utf-8").rstrip())
    print(f"\nwrote {len(payload['files'])} files into {payload['out']} (report.md, results.json/.csv, plots)")


def _common(p: argparse.ArgumentParser) -> None:
    """The model, the scaling and the output folder: what every task's command takes besides its options."""
    add_model_arguments(p, tokenizer=True)
    p.add_argument(
        "--backend",
        choices=["transformers", "vllm"],
        default="transformers",
        help="what runs the model: transformers (default; --method patches it), or vllm: --model is a folder "
        "`rope-extend export --to vllm` wrote, served by vllm.LLM as exported (the same prompts)",
    )
    add_method_arguments(p)
    p.add_argument("--label", help="name of this run in tables and plots (default: method and factor)")
    p.add_argument("--out", required=True, help="output folder (records.jsonl, results.json/.csv, report.md, PNGs)")
    add_folder_arguments(p, "run")
    _records_argument(p)
    add_progress_argument(p)
    _json_argument(p)


def _records_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--records-from",
        action="append",
        metavar="PATH",
        default=[],
        help="first add to --out the records of an earlier run (its records.jsonl, results.json or folder; "
        "repeatable): the trials and documents they hold with this run's setting are not measured again",
    )


def _cmd_task(args) -> int:
    """``rope-extend eval TASK``: the task's options checked (as a suite section would be), the texts read,
    then the model loaded and patched, the task run, and its report written."""
    from .. import schema
    from ..io import claim_output_dir
    from ..loading import load_model, load_tokenizer
    from .records import check_records_file, earlier_records, import_records
    from .report import owned
    from .tasks.base import Context, get_task, load_task_texts

    task = get_task(args.eval_command)
    if args.backend == "vllm":
        check_served_arguments(args)  # vLLM missing, or a flag it would ignore: refused before anything is read
    options = schema.build(task.options, schema.arguments_data(args, task.options), where="the command line")
    scaling = scaling_from_args(args)  # checked before a model is loaded
    claim_output_dir(args.out, kind="eval", owned=owned, resume=args.resume, overwrite=args.overwrite, check_only=True)
    earlier = earlier_records(args.records_from)  # a bad file fails before the model is loaded
    check_records_file(Path(args.out) / "records.jsonl", resume=args.resume)  # so does a bad --out/records.jsonl
    texts = load_task_texts(options) if task.reads_texts else None
    if args.backend == "vllm":
        model = open_served(args, task.name, options)
    else:
        model = load_model(args.model, dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code)
    tokenizer = load_tokenizer(args.tokenizer or args.model, trust_remote_code=args.trust_remote_code)
    if args.backend != "vllm":
        scaling.apply(model)
    # everything checked: now write
    claim_output_dir(args.out, kind="eval", owned=owned, resume=args.resume, overwrite=args.overwrite)
    import_records(Path(args.out) / "records.jsonl", earlier)
    context = Context(
        texts=texts,
        records=Path(args.out) / "records.jsonl",
        resume=True,
        progress=args.progress,
        run={"label": args.label} if args.label else {},
    )
    try:
        records = task.run(model, tokenizer, options, context)
    finally:
        if args.backend == "vllm":
            model.close()
    return _finish(args, records, f"{task.title}: {args.model}")


def check_served_arguments(args) -> None:
    """``--backend vllm``: vLLM importable (else the command that installs it), and no flag it would ignore:
    the export's folder is served as exported (its scaling is in its config), on vLLM's own device."""
    from ..errors import RopeExtendError
    from .vllm_engine import vllm_missing

    problem = vllm_missing()
    if problem is not None:
        raise RopeExtendError(f"--backend vllm: {problem}")
    given = [
        flag
        for flag, value in (
            ("--method", args.method),
            ("--factor", args.factor),
            ("--target-length", args.target_length),
            ("--original-length", args.original_max_position_embeddings),
            ("--param", args.param),
            ("--params-from", getattr(args, "params_from", None)),
            ("--device", args.device),
        )
        if value is not None
    ]
    if given:
        raise RopeExtendError(
            f"--backend vllm serves the exported folder as it is: {', '.join(given)} would change nothing; export "
            "the scaling (rope-extend export MODEL --to vllm --method ...) and give the folder as --model"
        )


def open_served(args, task: str, options):
    """The ``--model`` folder in vLLM, opened for the task's longest length plus the tokens it generates (a
    length past the export's is refused here, before vLLM starts)."""
    from .vllm_engine import VllmModel, check_served, read_export

    _, served, _ = read_export(Path(args.model))
    # the tokens a retrieval task generates past each length (RULER's lengths hold them); a task of one's own is
    # checked by its harness, before its first prompt
    generated = 0 if task == "ruler" else getattr(options, "max_new_tokens", None) or 0
    check_served(args.model, served, max(options.lengths), generated)
    longest = max(options.lengths) + generated
    return VllmModel(args.model, max_len=longest, dtype=args.dtype, trust_remote_code=args.trust_remote_code)


def _finish(args, records: list[dict], title: str) -> int:
    from .report import summarize, write_report

    files = write_report(args.out, records, title=title, notes=[f"model: `{args.model}`"])
    payload = {"out": str(args.out), "summary": summarize(records), "files": [str(f) for f in files.values()]}
    _print_result(args, files["markdown"], payload)
    return 0


def _cmd_compare(args) -> int:
    from .compare import run_suite
    from .suite import load_suite

    overrides = list(args.set or [])
    if args.model:
        overrides.append(f"model={json.dumps(args.model)}")
    suite = load_suite(args.suite, overrides)
    result = run_suite(
        suite,
        out=args.out,
        resume=args.resume,
        overwrite=args.overwrite,
        progress=args.progress,
        records_from=args.records_from,
    )
    payload = {"out": str(result["out"]), "files": [str(f) for f in result["files"].values()]}
    _print_result(args, result["files"]["markdown"], payload)
    return 0


def _cmd_spectrum(args) -> int:
    from ..errors import RopeExtendError
    from ..methods import registry
    from ..methods._common import check_factor
    from .spectrum import plot_spectrum, spectrum

    out = Path(args.out)
    if out.is_dir() or out.suffix.lower() != ".png":
        raise RopeExtendError(
            f"--out {out} must name a .png file to write (e.g. spectrum.png)"
            + (", not a folder" if out.is_dir() else "")
        )
    check_factor(args.factor)
    names = [m for m in (args.methods or ",".join(registry.names())).split(",") if m.strip()]
    curves, skipped = spectrum(
        names, factor=args.factor, head_dim=args.head_dim, base=args.base, original_length=args.original_length
    )
    for name, why in skipped.items():
        print(f"rope-extend: skipped {name}: {why}")
    if not curves:
        raise RopeExtendError(f"no method could be drawn: {'; '.join(f'{n}: {w}' for n, w in skipped.items())}")
    path = plot_spectrum(
        curves,
        out,
        factor=args.factor,
        head_dim=args.head_dim,
        base=args.base,
        original_length=args.original_length,
        x=args.x,
    )
    if args.json:
        print(json.dumps({"out": str(path), "methods": list(curves), "skipped": list(skipped)}))
    else:
        print(f"wrote {path}: {', '.join(curves)}")
    return 0


def _cmd_card(args) -> int:
    """``rope-extend card MODEL``: options and scaling checked, the folder claimed, then the card measured."""
    from .. import schema
    from ..io import claim_output_dir
    from .card import OWNED, card

    options = schema.build(CardOptions, schema.arguments_data(args, CardOptions), where="the command line")
    spec = scaling_from_args(args)
    claim = functools.partial(
        claim_output_dir, args.out, kind="card", owned=OWNED.__contains__, resume=args.resume, overwrite=args.overwrite
    )
    claim(check_only=True)  # refused before a model is loaded; claimed once the inputs are checked (card's claim)
    result = card(
        args.model,
        args.out,
        method=spec.method,
        scaling_kwargs=spec.patch_kwargs(),
        original=args.original,
        options=options,
        resume=args.resume,
        dtype=args.dtype,
        claim=claim,
    )
    if args.json:
        print(json.dumps({"out": args.out, "card": result}, default=str))
    else:
        print((Path(args.out) / "card.md").read_text(encoding="utf-8").rstrip())
    return 0


def register(subparsers) -> None:
    ev = subparsers.add_parser("eval", help="long-context evaluation: passkey, needle, RULER, perplexity, compare")
    sub = ev.add_subparsers(dest="eval_command", required=True, metavar="TASK")

    for task in tasks():
        p = sub.add_parser(task.name, help=task.help)
        _common(p)
        add_arguments(p, task.options)
        p.set_defaults(func=_cmd_task)

    p = sub.add_parser("compare", help="run a YAML suite: one model under several methods, one report")
    p.add_argument(
        "suite",
        help="suite YAML file, or the name of a shipped suite (rope-extend recipes lists them: smoke, smollm2, ...)",
    )
    p.add_argument("--model", help="override the suite's model")
    p.add_argument("--out", help="report folder (default: the suite's out, else runs/<suite name>)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a suite key, e.g. passkey.trials=2")
    add_folder_arguments(p, "suite run")
    _records_argument(p)
    add_progress_argument(p)
    _json_argument(p)
    p.set_defaults(func=_cmd_compare)

    p = subparsers.add_parser(
        "card",
        help="one context-extension claim measured as it is judged (RULER by length, effective length, retention, "
        "passkey, perplexity; on the served GGUF too) and written as a model-card block",
    )
    p.add_argument("model", help="saved model folder or a name rope-extend knows (bundled, smollm2-135m)")
    add_method_arguments(p)
    p.add_argument("--original", help="the model retention is measured against (default: MODEL unpatched)")
    add_dtype_argument(p, "float32")
    p.add_argument("--out", required=True, help="output folder (records.jsonl, card.md, card.json, card.png)")
    add_folder_arguments(p, "card")
    add_arguments(p, CardOptions)
    _json_argument(p)
    p.set_defaults(func=_cmd_card)

    pl = subparsers.add_parser("plot", help="pictures: the rotary spectrum of each method")
    psub = pl.add_subparsers(dest="plot_command", required=True, metavar="PLOT")
    p = psub.add_parser("spectrum", help="per method, each rotary dimension's frequency ratio theta'/theta")
    p.add_argument(
        "--methods", help="comma-separated methods (default: all; ones needing extra parameters are skipped)"
    )
    p.add_argument("--factor", type=float, default=8.0)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--base", type=float, default=10000.0)
    p.add_argument("--original-length", type=int, default=4096)
    p.add_argument("--x", choices=["wavelength", "dim"], default="wavelength", help="x axis")
    p.add_argument("--out", default="spectrum.png", help="PNG file to write")
    add_json_argument(p, "print one line of JSON (the file, methods drawn, skipped)")
    p.set_defaults(func=_cmd_spectrum)
