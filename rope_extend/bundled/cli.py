"""``rope-extend bundled-data``: write the bundled model's pretraining data and tokenizer."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import RopeExtendError


def _cmd(args: argparse.Namespace) -> int:
    from . import EVAL_CORPUS
    from .build import write_eval_corpus, write_pretraining_data

    if args.eval_corpus:
        print(write_eval_corpus(EVAL_CORPUS if args.out is None else args.out))
        return 0
    if args.out is None:
        raise RopeExtendError("bundled-data needs --out DIR (or --eval-corpus to rebuild the shipped corpus)")
    shares = {
        k: getattr(args, k)
        for k in ("passkey_share", "needle_share", "drill_share", "recall_share", "ruler_share")
        if getattr(args, k) is not None
    }
    print(
        write_pretraining_data(
            args.out,
            seed=args.seed,
            documents=args.documents,
            vocab_size=args.vocab_size,
            context=args.context,
            **shares,
        )
    )
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from . import MODEL_DIR
    from .export import COMMANDS, export

    commands = args.commands.replace("\\n", "\n") if args.commands else COMMANDS
    notes = Path(args.notes).read_text(encoding="utf-8") if args.notes else ""
    print(export(args.run, args.out or MODEL_DIR, commands=commands, notes=notes))
    return 0


def register(sub) -> None:
    p = sub.add_parser("bundled-data", help="write the bundled model's pretraining data and tokenizer")
    p.add_argument("--out", help="folder for train.jsonl and tokenizer/ (or the corpus file with --eval-corpus)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--documents", type=int, default=60000)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--context", type=int, default=256, help="window the documents are sized for")
    for kind in ("passkey", "needle", "drill", "recall", "ruler"):
        p.add_argument(f"--{kind}-share", type=float, help=f"fraction of {kind} documents (the rest: chronicles)")
    p.add_argument("--eval-corpus", action="store_true", help="rebuild the shipped held-out corpus instead")
    p.set_defaults(func=_cmd)

    p = sub.add_parser("bundled-export", help="copy a finished pretraining run into the package as the bundled model")
    p.add_argument("run", help="the run's output_dir (holding model/ and loss.csv)")
    p.add_argument("--out", help="target folder (default: the package's bundled model folder)")
    p.add_argument("--commands", help="the commands that made it, for the model card")
    p.add_argument("--notes", help="a markdown file for the model card: how it was trained, what it measures")
    p.set_defaults(func=_cmd_export)
