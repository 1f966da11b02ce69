"""rope_extend.training.engine: what the recipe asks of accelerate, against what the launcher asked."""

import pytest

from rope_extend.training import engine
from rope_extend.training.args import RecipeError, TrainArgs


@pytest.mark.parametrize(
    ("keys", "launcher", "expected"),
    [
        ({}, None, "no"),
        ({"bf16": True}, None, "bf16"),
        ({"fp16": True}, "", "fp16"),
        ({"bf16": True}, "no", "bf16"),  # "no" is accelerate's default when nothing is configured: the recipe decides
        ({"bf16": True}, "BF16", "bf16"),
        ({}, "no", "no"),
    ],
)
def test_the_recipe_decides_where_the_launcher_agrees_or_asks_nothing(monkeypatch, keys, launcher, expected):
    if launcher is None:
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    else:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    assert engine.mixed_precision(TrainArgs(**keys)) == expected


@pytest.mark.parametrize(
    ("keys", "launcher", "message"),
    [
        ({}, "bf16", r"asks for mixed_precision=bf16 but the recipe's bf16/fp16 keys give no: set `bf16: true`"),
        ({"fp16": True}, "bf16", r"give fp16: set `bf16: true` .*, or launch with --mixed_precision fp16"),
        ({"bf16": True}, "fp8", r"mixed_precision=fp8 .*the recipe trains in bf16, fp16 or float32 only"),
    ],
)
def test_a_launcher_asking_another_precision_is_refused(monkeypatch, keys, launcher, message):
    """Before, Accelerator(mixed_precision=...) silently won over the launcher's config file."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    with pytest.raises(RecipeError, match=message):
        engine.mixed_precision(TrainArgs(**keys))
