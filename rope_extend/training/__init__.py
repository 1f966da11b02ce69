"""Long-context fine-tuning: YAML recipes -> ``TrainArgs`` -> one accelerate + PEFT training loop.

from rope_extend.training import load_args, train
result = train(load_args("recipes/tiny-cpu.yaml", ["max_steps=20"]))
"""

from .args import RecipeError, TrainArgs, load_args


def train(args, **kwargs):
    from .loop import train as _train

    return _train(args, **kwargs)


__all__ = ["RecipeError", "TrainArgs", "load_args", "train"]
