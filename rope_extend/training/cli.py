"""``rope-extend train RECIPE [key=value ...]`` (also ``accelerate launch -m rope_extend train ...``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import resources


def find_recipe(name: str | Path) -> Path:
    """A recipe file, or the name of a shipped recipe (``tiny-cpu``)."""
    from .args import RecipeError

    return resources.find_recipe(name, RecipeError)


def _cmd_train(args: argparse.Namespace) -> int:
    from .. import schema
    from .args import load_args

    overrides = [o for o in args.overrides if o != "--check"]  # --check may come after the overrides too
    args.check = args.check or len(overrides) < len(args.overrides)
    train_args = load_args(args.recipe, overrides)
    if args.check:
        print(f"# {args.recipe}: valid; resolved with defaults and overrides\n{schema.annotated(train_args)}")
        return 0
    from accelerate import PartialState

    from .loop import train

    try:
        result = train(train_args)
        if result.history and PartialState().is_main_process:
            last = result.history[-1]
            print(
                json.dumps(
                    {
                        "output_dir": str(result.output_dir),
                        "final_dir": str(result.final_dir),
                        "adapter_dir": str(result.adapter_dir) if result.adapter_dir else None,
                        "step": last["step"],
                        "loss": last["loss"],
                    }
                )
            )
    finally:
        # The command is the end of the script: leave the process group in order (accelerate's end_training does
        # this, but only the runs with trackers call it). Left to the interpreter's exit, gloo's threads were
        # sometimes torn down while joinable, and a rank died with "terminate called without an active
        # exception" after the run had saved everything.
        PartialState().destroy_process_group()
    return 0


def register(subparsers) -> None:
    shipped = ", ".join(resources.names(resources.RECIPES))
    p = subparsers.add_parser(
        "train",
        help="fine-tune a model for a longer context from a YAML recipe",
        description="Fine-tune from a YAML recipe. Overrides: key=value, dotted keys for "
        f"sections (rope.factor=8 lora.r=16 max_steps=10). Shipped: {shipped}.",
    )
    p.add_argument("recipe", help="recipe YAML file, or the name of a shipped recipe (e.g. tiny-cpu)")
    p.add_argument("overrides", nargs=argparse.REMAINDER, metavar="KEY=VALUE", help="recipe overrides; these win")
    p.add_argument(
        "--check",
        action="store_true",
        help="validate the recipe as the run would, print it resolved with each key's help, and exit",
    )
    p.set_defaults(func=_cmd_train)
