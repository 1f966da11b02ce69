"""The ``rope-extend`` command.

Core subcommands live here (``methods``, ``configure``); the evaluation, training and demo packages
add theirs through a ``register(subparsers)`` function in their own ``cli`` module, so each part of the
project owns its commands.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

# Modules that add subcommands: each has register(subparsers). Missing ones are skipped.
PLUGINS = ("rope_extend.evaluation.cli", "rope_extend.training.cli", "rope_extend.bundled.cli", "rope_extend.demo")


def parse_params(items: list[str] | None) -> dict[str, Any]:
    """``["beta_fast=32", "finetuned=true"]`` -> ``{"beta_fast": 32, "finetuned": True}`` (YAML scalars/lists)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"rope-extend: --param expects key=value, got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def add_method_arguments(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    """``--method/--factor/--target-length/--original-length/--param``, shared by every subcommand."""
    parser.add_argument("--method", required=required, help="scaling method (see `rope-extend methods`)")
    parser.add_argument("--factor", type=float, help="scale factor s = target / original length")
    parser.add_argument("--target-length", type=int, help="target context length (instead of --factor)")
    parser.add_argument("--original-length", type=int, dest="original_max_position_embeddings",
                        help="override the original pretraining length L")
    parser.add_argument("--param", action="append", metavar="KEY=VALUE",
                        help="method parameter, e.g. --param beta_fast=32 (repeatable)")


def method_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments for ``rope_extend.patch``/``configure`` from parsed method arguments."""
    kwargs = dict(factor=args.factor, target_length=args.target_length,
                  original_max_position_embeddings=args.original_max_position_embeddings)
    kwargs.update(parse_params(args.param))
    return kwargs


def _cmd_methods(args: argparse.Namespace) -> int:
    from .methods import registry as M

    rows = [(m.name, m.rope_type, "yes" if m.in_transformers else "no", "yes" if m.dynamic else "no", m.source)
            for m in map(M.get, M.names())]
    header = ("method", "rope_type", "in transformers", "dynamic", "source")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def _cmd_configure(args: argparse.Namespace) -> int:
    """Copy a saved model folder with its config rewritten for a scaling; the weights are not loaded."""
    from transformers import AutoConfig

    from . import configure
    from .io import atomic_path

    source, out = Path(args.model), Path(args.out)
    if not (source / "config.json").is_file():
        raise SystemExit(f"rope-extend: {source} is not a saved model folder (no config.json)")
    if out.exists() and not args.overwrite:
        raise SystemExit(f"rope-extend: {out} exists; pass --overwrite to replace it")
    config = AutoConfig.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    configure(config, args.method, **method_kwargs(args))
    with atomic_path(out) as tmp:
        shutil.copytree(source, tmp)
        config.save_pretrained(tmp)
    print(json.dumps({"out": str(out), "rope_parameters": config.get_text_config().rope_parameters,
                      "max_position_embeddings": config.get_text_config().max_position_embeddings}, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rope-extend", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("methods", help="list the scaling methods")
    p.set_defaults(func=_cmd_methods)

    p = sub.add_parser("configure", help="write a scaling into a saved model's config (copies the folder)")
    p.add_argument("model", help="saved model folder")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--trust-remote-code", action="store_true")
    add_method_arguments(p, required=True)
    p.set_defaults(func=_cmd_configure)

    for name in PLUGINS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and name.startswith(exc.name):
                continue  # that part of the project is not there (yet)
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    import rope_extend  # noqa: F401  (registers the rope types)

    from .errors import NotPatchedError, RopeExtendError, UnsupportedModelError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (RopeExtendError, UnsupportedModelError, NotPatchedError) as exc:
        print(f"rope-extend: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
