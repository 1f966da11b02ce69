"""Command-line pieces every ``rope-extend`` subcommand shares: the method arguments, ``--param`` and the
flags of an output folder."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .errors import RopeExtendError
from .scaling import ScalingRequest
from .schema import parse_value


def parse_params(items: list[str] | None) -> dict[str, Any]:
    """``["beta_fast=32", "finetuned=true"]`` -> ``{"beta_fast": 32, "finetuned": True}`` (YAML scalars/lists)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise RopeExtendError(f"--param expects key=value (e.g. --param beta_fast=32), got {item!r}")
        out[key.strip()] = parse_value(value, f"--param {key.strip()}")
    return out


def add_method_arguments(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    """``--method/--factor/--target-length/--original-length/--param/--params-from``."""
    parser.add_argument("--method", required=required, help="scaling method (see `rope-extend methods`)")
    parser.add_argument("--factor", type=float, help="scale factor s = target / original length")
    parser.add_argument("--target-length", type=int, help="target context length (instead of --factor)")
    parser.add_argument(
        "--original-length",
        type=int,
        dest="original_max_position_embeddings",
        help="override the original pretraining length L",
    )
    parser.add_argument(
        "--param", action="append", metavar="KEY=VALUE", help="method parameter, e.g. --param beta_fast=32 (repeatable)"
    )
    parser.add_argument(
        "--params-from",
        metavar="JSON",
        help="the method's parameters from a JSON file, e.g. the longrope.json `rope-extend search` writes (its "
        "factor and original length too, unless given); --param wins",
    )


def add_model_arguments(
    parser: argparse.ArgumentParser,
    *,
    model: str | None = "saved model folder or hub name (a causal LM)",
    dtype: str = "auto",
    tokenizer: bool = False,
) -> None:
    """The flags that load a model, spelt and explained alike in every command: ``--model`` (unless ``model``
    is None: the command declares its own), ``--tokenizer`` (where asked), ``--dtype`` (default ``dtype``),
    ``--device`` and ``--trust-remote-code`` (off unless given)."""
    if model is not None:
        parser.add_argument("--model", required=True, help=model)
    if tokenizer:
        parser.add_argument("--tokenizer", help="tokenizer folder or name (default: the model's)")
    add_dtype_argument(parser, dtype)
    parser.add_argument("--device", help="e.g. cuda, cuda:1, cpu (default: where the model loads)")
    add_trust_argument(parser)


def add_dtype_argument(parser: argparse.ArgumentParser, default: str = "auto") -> None:
    parser.add_argument("--dtype", default=default, help=f"float32, bfloat16, float16 or auto (default {default})")


def add_trust_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="run the model's own code from its folder (off by default)"
    )


def add_progress_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="hide progress bars")


def add_folder_arguments(parser: argparse.ArgumentParser, what: str, *, resume: bool = True) -> None:
    """``--resume`` (where a run can continue) and ``--overwrite``, one or the other, with the same meaning in
    every command that claims an output folder (``io.claim_output_dir``)."""
    group = parser.add_mutually_exclusive_group()
    if resume:
        group.add_argument("--resume", action="store_true", help=f"continue the {what} in --out, reusing its results")
    group.add_argument(
        "--overwrite", action="store_true", help=f"replace an earlier {what} in --out (only what rope-extend wrote)"
    )


FLAGS = {
    "method": "--method",
    "factor": "--factor",
    "target_length": "--target-length",
    "original_max_position_embeddings": "--original-length",
    "params": "--param",
    "params_from": "--params-from",
}


def _flag(key: str) -> str:
    """How the command line spells a ``ScalingRequest`` key: ``--factor``, ``--param beta_fast``."""
    return f"--param {key[len('params.') :]}" if key.startswith("params.") else FLAGS.get(key, key)


def scaling_from_args(args: argparse.Namespace) -> ScalingRequest:
    """The checked ``ScalingRequest`` of parsed method arguments; errors name the flags. A factor, a target
    length or a parameter without a method is an error (it would silently measure the unscaled model).
    ``--params-from`` is read here (``ScalingRequest.read_params``), so every command that takes a method takes it."""
    spec = ScalingRequest(
        method=args.method or "none",
        factor=args.factor,
        target_length=args.target_length,
        original_max_position_embeddings=args.original_max_position_embeddings,
        params=parse_params(args.param),
    )
    if getattr(args, "params_from", None) is not None:
        return spec.read_params(args.params_from, f"--params-from {args.params_from}", spell=_flag)
    return spec.check(spell=_flag)


def method_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments for ``patch``/``configure`` from parsed method arguments (``scaling_from_args``)."""
    return scaling_from_args(args).patch_kwargs()


# ------------------------------------------------------------------------------------------ what a command prints
def add_json_argument(
    parser: argparse.ArgumentParser, help: str = "print the result as one JSON object (for scripts)"
) -> None:
    parser.add_argument("--json", action="store_true", help=help)


def _inline(value: Any) -> str:
    """A dict as ``key=value, ...`` (nested ones in braces), anything else as ``str``."""
    if isinstance(value, dict):
        return ", ".join(
            f"{k}={'{' + _inline(v) + '}' if isinstance(v, dict) else _inline(v)}" for k, v in value.items()
        )
    return str(value)


def print_result(result: dict[str, Any], *, as_json: bool) -> None:
    """A command's result: ``key: value`` lines for a person (a list one item a line below its key, an empty one
    as ``none``), or with ``--json`` the raw object for a script."""
    if as_json:
        print(json.dumps(result, indent=2, default=str))
        return
    width = max(map(len, result), default=0) + 1
    for key, value in result.items():
        label = f"{key}:".ljust(width)
        if isinstance(value, (list, tuple)):
            print(f"{label} {'none' if not value else ''}".rstrip())
            for item in value:
                print(f"  - {_inline(item)}")
        else:
            print(f"{label} {_inline(value)}")
