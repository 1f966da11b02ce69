"""Command-line pieces every ``rope-extend`` subcommand shares: the method arguments, ``--param`` and the
flags of an output folder."""

from __future__ import annotations

import argparse
from typing import Any

from .errors import RopeExtendError
from .scaling import ScalingSpec
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
    """``--method/--factor/--target-length/--original-length/--param``."""
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
}


def _flag(key: str) -> str:
    """How the command line spells a ``ScalingSpec`` key: ``--factor``, ``--param beta_fast``."""
    return f"--param {key[len('params.') :]}" if key.startswith("params.") else FLAGS.get(key, key)


def scaling_from_args(args: argparse.Namespace) -> ScalingSpec:
    """The checked ``ScalingSpec`` of parsed method arguments; errors name the flags. A factor, a target
    length or a parameter without a method is an error (it would silently measure the unscaled model)."""
    spec = ScalingSpec(
        method=args.method or "none",
        factor=args.factor,
        target_length=args.target_length,
        original_max_position_embeddings=args.original_max_position_embeddings,
        params=parse_params(args.param),
    )
    return spec.check(spell=_flag)


def method_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments for ``patch``/``configure`` from parsed method arguments (``scaling_from_args``)."""
    return scaling_from_args(args).patch_kwargs()
