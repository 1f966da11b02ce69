"""``rope-extend search``: the LongRoPE factor search from the command line."""

from __future__ import annotations

import json
import sys


def _cmd_search(args) -> int:
    from ..documents import read_documents
    from ..errors import RopeExtendError
    from ..loading import load_model, load_tokenizer
    from ..methods.longrope import critical_dimension
    from .run import check_critical_pair, claim, geometry, search

    if args.data is None:
        if args.model != "bundled":
            raise RopeExtendError("--data is required (texts at least factor x the trained length long)")
        from .. import bundled

        texts = bundled.eval_texts()[:4]  # the held-out chronicles 0-3; 4-7 stay unseen for evaluation
    else:
        texts = read_documents(args.data, text_field=args.text_field, max_docs=args.max_docs)
    check_critical_pair(args.critical_pair, args.space)
    claim(args.out, resume=args.resume, overwrite=args.overwrite, check_only=True)  # refused before the model loads
    model = load_model(args.model, dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code)
    tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    dim, base, L = geometry(model)
    critical = critical_dimension(dim, base, L)
    check_critical_pair(args.critical_pair, args.space, dim)
    pair = critical // 2 if args.critical_pair is None else args.critical_pair
    split = "it" if args.critical_pair is None else f"pair {pair} (--critical-pair)"
    print(
        f"critical dimension (LongRoPE2): {critical} of {dim} (frequency pair {critical // 2}; rotary base {base:g}, "
        f"trained length {L}); search bounds: "
        + (f"[{args.factor:g}, 2 x {args.factor:g}] from {split} on, NTK scaling below it"
           if args.space == "longrope2" else f"[1, 1.25 x {args.factor:g}] for every pair"),
        file=sys.stderr,
    )  # fmt: skip
    result = search(
        model,
        tokenizer,
        args.factor,
        texts,
        max_evaluations=args.evals,
        max_seconds=args.seconds,
        population=args.population,
        seed=args.seed,
        out=args.out,
        resume=args.resume,
        overwrite=args.overwrite,
        progress=args.progress,
        fitness=args.fitness,
        space=args.space,
        critical_pair=args.critical_pair,
    )
    print(
        json.dumps(
            {
                "out": args.out,
                "fitness": result.fitness,
                "seeds": result.seeds,
                "evaluations": result.evaluations,
                "objective": result.objective,
                "critical_dimension": result.critical,
            }
        )
    )
    return 0


def register(subparsers) -> None:
    from ..arguments import add_folder_arguments, add_model_arguments, add_progress_argument
    from .choices import FITNESSES, SPACES

    p = subparsers.add_parser(
        "search",
        help="search LongRoPE rescale factors (one per frequency) with perplexity as fitness (texts or needles)",
        description="Evolutionary search for LongRoPE factors (Ding et al. 2024), seeded from PI, NTK and YaRN. "
        "Writes longrope.json (rope_parameters for patch/configure), report.md, search.png and a resumable state.",
    )
    p.add_argument("--model", required=True, help="saved model folder, .gguf file or shipped name (bundled, ...)")
    p.add_argument("--factor", type=float, required=True, help="extension ratio s (target = s x trained length)")
    p.add_argument("--data", help="texts to search on (.txt, folder, .jsonl, canterbury); default for bundled: "
                   "its held-out chronicles 0-3")  # fmt: skip
    p.add_argument("--text-field", default="text", help="column holding the text (JSONL, Parquet)")
    p.add_argument("--max-docs", type=int, help="use at most this many documents")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--evals", type=int, default=64, help="budget: fitness evaluations, at least 3 (default 64)")
    p.add_argument(
        "--seconds",
        type=float,
        help="budget: seconds (stops after the evaluation that crosses it, once the seeds are evaluated; resumable, not reproducible)",
    )
    p.add_argument("--population", type=int, default=16, help="candidates per generation (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fitness",
        choices=FITNESSES,
        default="text",
        help="text: perplexity of the texts at the target length (LongRoPE); needle: perplexity of the answer "
        "tokens of passkey and RULER key-value needles at several depths of documents built from the texts "
        "(LongRoPE2), six documents an evaluation; needle-multiquery: the same with one document an evaluation, "
        "five RULER key-value needles asked for together (a sixth of the cost). Default text",
    )
    p.add_argument(
        "--space",
        choices=SPACES,
        default="longrope",
        help="the factors' bounds: longrope [1, 1.25 s] for every pair; longrope2 split at the critical dimension, "
        "[s, 2 s] from it on and NTK scaling from its factor below it (LongRoPE2). Default longrope",
    )
    p.add_argument(
        "--critical-pair",
        type=int,
        help="with --space longrope2: the frequency pair the split is at, instead of the computed critical "
        "dimension's (LongRoPE2's authors pass theirs by hand, often 2-6 pairs below it)",
    )
    add_folder_arguments(p, "search")
    add_model_arguments(p, model=None, dtype="float32")
    add_progress_argument(p)
    p.set_defaults(func=_cmd_search)
