"""``rope-extend eval passkey|niah|ruler|perplexity|compare`` and ``rope-extend plot spectrum``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..arguments import add_folder_arguments, add_method_arguments, method_kwargs
from ..hf.window import SLIDING_WINDOW_MODES


def _json_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        action="store_true",
        help="print one line of JSON (the output folder, the summary, the files) instead of the tables",
    )


def _print_result(args, report: Path, payload: dict) -> None:
    """The report's tables at the terminal and where the files went; or, with --json, one line for a program."""
    if args.json:
        print(json.dumps(payload, default=str))
        return
    print(report.read_text(encoding="utf-8").rstrip())
    print(f"\nwrote {len(payload['files'])} files into {payload['out']} (report.md, results.json/.csv, plots)")


def _common(p: argparse.ArgumentParser, *, data: bool = False) -> None:
    p.add_argument("--model", required=True, help="saved model folder or hub name (a causal LM)")
    p.add_argument("--tokenizer", help="tokenizer folder or name (default: the model's)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default)")
    p.add_argument("--device", help="e.g. cuda, cuda:1, cpu (default: where the model loads)")
    p.add_argument("--trust-remote-code", action="store_true")
    add_method_arguments(p)
    p.add_argument("--label", help="name of this run in tables and plots (default: method and factor)")
    p.add_argument("--lengths", required=True, help="context lengths in tokens, e.g. 1k,2k,4k (1k = 1024)")
    p.add_argument("--out", required=True, help="output folder (records.jsonl, results.json/.csv, report.md, PNGs)")
    add_folder_arguments(p, "run")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide progress bars")
    _json_argument(p)
    p.add_argument(
        "--sliding-window",
        choices=SLIDING_WINDOW_MODES,
        default="auto",
        help="auto: widen a window every layer uses (Mistral, Phi-3), keep interleaved local layers "
        "(Gemma 2/3); full: widen all; keep: none",
    )
    if data:
        p.add_argument("--data", help="a .txt file, a folder of .txt files, .jsonl, .parquet, or a hub dataset name")
        p.add_argument("--text-field", default="text", help="column holding the text (JSONL, Parquet, datasets)")
        p.add_argument("--split", default="train", help="dataset split (hub datasets)")
        p.add_argument("--max-docs", type=int, help="use at most this many documents")
        p.add_argument(
            "--sample-by",
            choices=("document", "paragraph", "line"),
            default="document",
            help="a text file is one document (default), or split by paragraph or line",
        )


def _prepare(args):
    """Check cheap arguments, then load (and patch) the model; returns (model, tokenizer, records path)."""
    from ..io import claim_output_dir
    from ..loading import load_model, load_tokenizer
    from ..methods import registry
    from ..patch import patch
    from .data import parse_lengths
    from .report import owned

    args.lengths = parse_lengths(args.lengths)
    method = args.method or "none"
    kwargs = method_kwargs(args)  # a factor without a method is refused here
    if method != "none":
        registry.get(method)  # an unknown method fails before a model is loaded
    records = Path(args.out) / "records.jsonl"
    claim_output_dir(args.out, kind="eval", owned=owned, resume=args.resume, overwrite=args.overwrite, check_only=True)
    texts = None
    if getattr(args, "data", "absent") != "absent":
        from .data import default_texts, load_texts

        texts = (
            load_texts(
                args.data,
                text_field=args.text_field,
                split=args.split,
                max_docs=args.max_docs,
                sample_by=args.sample_by,
            )
            if args.data
            else default_texts()
        )
    model = load_model(args.model, dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code)
    tokenizer = load_tokenizer(args.tokenizer or args.model, trust_remote_code=args.trust_remote_code)
    if method != "none":
        patch(model, method, **kwargs)
    # everything checked: now write
    claim_output_dir(args.out, kind="eval", owned=owned, resume=args.resume, overwrite=args.overwrite)
    return model, tokenizer, records, texts


def _finish(args, records: list[dict], title: str) -> int:
    from .report import summarize, write_report

    files = write_report(args.out, records, title=title, notes=[f"model: `{args.model}`"])
    payload = {"out": str(args.out), "summary": summarize(records), "files": [str(f) for f in files.values()]}
    _print_result(args, files["markdown"], payload)
    return 0


def _run(args) -> dict:
    return {"label": args.label} if args.label else {}


def _cmd_passkey(args) -> int:
    from .passkey import passkey

    model, tokenizer, records, _ = _prepare(args)
    result = passkey(
        model,
        tokenizer,
        args.lengths,
        depths=args.depths,
        trials=args.trials,
        seed=args.seed,
        key_range=tuple(args.key_range),
        max_new_tokens=args.max_new_tokens,
        records=records,
        resume=True,
        progress=args.progress,
        run=_run(args),
        sliding_window=args.sliding_window,
    )
    return _finish(args, result.records, f"Passkey retrieval: {args.model}")


def _cmd_niah(args) -> int:
    from .niah import niah

    model, tokenizer, records, texts = _prepare(args)
    extra = {k: getattr(args, k) for k in ("needle", "question", "answer") if getattr(args, k)}
    result = niah(
        model,
        tokenizer,
        texts,
        args.lengths,
        depths=args.depths,
        trials=args.trials,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        records=records,
        resume=True,
        progress=args.progress,
        run=_run(args),
        sliding_window=args.sliding_window,
        **extra,
    )
    return _finish(args, result.records, f"Needle in a haystack: {args.model}")


def _cmd_ruler(args) -> int:
    from .ruler import check_tasks, ruler

    check_tasks(args.tasks)  # an unknown task fails before the model is loaded
    model, tokenizer, records, texts = _prepare(args)
    result = ruler(
        model,
        tokenizer,
        args.lengths,
        tasks=args.tasks,
        samples=args.samples,
        seed=args.seed,
        haystack=texts,
        max_new_tokens=args.max_new_tokens,
        records=records,
        resume=True,
        progress=args.progress,
        run=_run(args),
        sliding_window=args.sliding_window,
    )
    return _finish(args, result.records, f"RULER synthetic tasks: {args.model}")


def _cmd_perplexity(args) -> int:
    from .perplexity import perplexity

    model, tokenizer, records, texts = _prepare(args)
    result = perplexity(
        model,
        tokenizer,
        texts,
        args.lengths,
        stride=args.stride,
        chunk_size=args.chunk_size,
        records=records,
        resume=True,
        progress=args.progress,
        run=_run(args),
        sliding_window=args.sliding_window,
    )
    return _finish(args, result.records, f"Perplexity: {args.model}")


def _cmd_compare(args) -> int:
    from .compare import run_suite
    from .suite import load_suite

    overrides = list(args.set or [])
    if args.model:
        overrides.append(f"model={json.dumps(args.model)}")
    suite = load_suite(args.suite, overrides)
    result = run_suite(suite, out=args.out, resume=args.resume, overwrite=args.overwrite, progress=args.progress)
    payload = {"out": str(result["out"]), "files": [str(f) for f in result["files"].values()]}
    _print_result(args, result["files"]["markdown"], payload)
    return 0


def _cmd_spectrum(args) -> int:
    from ..errors import RopeExtendError
    from ..methods import registry
    from .spectrum import plot_spectrum, spectrum

    out = Path(args.out)
    if out.is_dir() or out.suffix.lower() != ".png":
        raise RopeExtendError(
            f"--out {out} must name a .png file to write (e.g. spectrum.png)"
            + (", not a folder" if out.is_dir() else "")
        )
    registry.check_factor(args.factor)
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


def register(subparsers) -> None:
    ev = subparsers.add_parser("eval", help="long-context evaluation: passkey, needle, RULER, perplexity, compare")
    sub = ev.add_subparsers(dest="eval_command", required=True, metavar="TASK")

    p = sub.add_parser("passkey", help="passkey retrieval accuracy per length (and depth)")
    _common(p)
    p.add_argument(
        "--depths",
        help="depth grid for a heatmap: 0,0.5,1 or 0%%,50%%,100%% or grid:5 (default: a random depth per trial)",
    )
    p.add_argument("--trials", type=int, default=10, help="trials per length (per depth with --depths)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--key-range", type=int, nargs=2, default=[1, 50000], metavar=("LOW", "HIGH"))
    p.add_argument("--max-new-tokens", type=int, default=10)
    p.set_defaults(func=_cmd_passkey)

    p = sub.add_parser("niah", help="needle in a haystack: length x depth heatmap, substring match")
    _common(p, data=True)
    p.add_argument("--needle", help="the sentence to hide (default: the San Francisco needle)")
    p.add_argument("--question", help="the question asked at the end")
    p.add_argument("--answer", help="the substring a correct answer contains")
    p.add_argument("--depths", default="grid:5", help="depth grid (default grid:5 = 0,25,50,75,100%%)")
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.set_defaults(func=_cmd_niah)

    p = sub.add_parser("ruler", help="RULER's synthetic tasks (needles, variable tracking, word counts) per length")
    _common(p, data=True)
    p.add_argument(
        "--tasks",
        help="comma-separated: niah_single_1, niah_multikey_2, niah_multikey_3, niah_multivalue, niah_multiquery, "
        "vt, cwe, fwe (default: all); --data is the essay haystack",
    )
    p.add_argument("--samples", type=int, default=10, help="prompts per task and length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, help="tokens generated (default: RULER's per task: 128, 30, 120, 50)")
    p.set_defaults(func=_cmd_ruler)

    p = sub.add_parser("perplexity", help="token-weighted perplexity per length (chunked, no full logits)")
    _common(p, data=True)
    p.add_argument("--stride", type=int, help="sliding-window step (default: one truncated window per document)")
    p.add_argument("--chunk-size", type=int, help="positions per LM-head chunk (default: 16M logits / vocab)")
    p.set_defaults(func=_cmd_perplexity)

    p = sub.add_parser("compare", help="run a YAML suite: one model under several methods, one report")
    p.add_argument(
        "suite",
        help="suite YAML file, or the name of a shipped suite (rope-extend recipes lists them: smoke, smollm2, ...)",
    )
    p.add_argument("--model", help="override the suite's model")
    p.add_argument("--out", help="report folder (default: the suite's out, else runs/<suite name>)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a suite key, e.g. passkey.trials=2")
    add_folder_arguments(p, "suite run")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    _json_argument(p)
    p.set_defaults(func=_cmd_compare)

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
    p.add_argument("--json", action="store_true", help="print one line of JSON (the file, methods drawn, skipped)")
    p.set_defaults(func=_cmd_spectrum)
