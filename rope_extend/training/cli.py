"""``rope-extend train RECIPE.yaml [key=value ...]`` (also ``accelerate launch -m rope_extend train ...``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def find_recipe(name: str) -> Path:
    """A recipe file, or a recipe's name in the checkout's recipes/ folder (``tiny-cpu``)."""
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (RECIPES / name, RECIPES / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    from .args import RecipeError

    known = sorted(p.stem for p in RECIPES.glob("*.yaml")) if RECIPES.is_dir() else []
    raise RecipeError(f"recipe {name}: no such file, and not a recipe name ({', '.join(known) or 'none found'})")


def _cmd_train(args: argparse.Namespace) -> int:
    from .args import load_args, to_dict

    train_args = load_args(find_recipe(args.recipe), args.overrides)
    if args.check:
        print(json.dumps(to_dict(train_args), indent=1, default=str))
        return 0
    from .loop import train

    result = train(train_args)
    from accelerate import PartialState

    if result.history and PartialState().is_main_process:
        last = result.history[-1]
        print(json.dumps({"output_dir": str(result.output_dir), "final_dir": str(result.final_dir),
                          "adapter_dir": str(result.adapter_dir) if result.adapter_dir else None,
                          "step": last["step"], "loss": last["loss"]}))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="fine-tune a model for a longer context from a YAML recipe",
                              description="Fine-tune from a YAML recipe. Overrides: key=value, dotted keys for "
                                          "sections (rope.factor=8 lora.r=16 max_steps=10).")
    p.add_argument("recipe", help="recipe YAML file, or a name from recipes/ (e.g. tiny-cpu)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides; these win")
    p.add_argument("--check", action="store_true", help="validate the recipe, print it resolved, and exit")
    p.set_defaults(func=_cmd_train)
