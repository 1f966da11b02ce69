"""hf.generation and patch: transformers' "exceeded the model's predefined maximum length" reminder is printed
only past what the patch reaches (issue 55)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers.generation import stopping_criteria
from transformers.utils import logging as hf_logging

import rope_extend
from tests.tiny import tiny_model

REMINDER = "exceeded the model's predefined maximum length"


@pytest.fixture
def reminders():
    """The reminders logged during the test (transformers logs it once per message: that cache is cleared)."""
    got: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            if REMINDER in record.getMessage():
                got.append(record.getMessage())

    logger = hf_logging.get_logger(stopping_criteria.__name__)
    handler = Catch()
    logger.addHandler(handler)
    forget_reminders()
    yield got
    logger.removeHandler(handler)
    forget_reminders()


def forget_reminders() -> None:
    """transformers' ``warning_once`` is an lru_cache on the logger class: clear it so a reminder can come again."""
    type(hf_logging.get_logger(stopping_criteria.__name__)).warning_once.cache_clear()


def generate(model, length: int) -> torch.Tensor:
    ids = torch.randint(3, 500, (1, length), generator=torch.Generator().manual_seed(0))
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)


@pytest.mark.parametrize(
    ("method", "kwargs"),
    [("yarn", {"factor": 4}), ("self_extend", {"factor": 2}), ("rerope", {}), ("dual_chunk", {"logn": True})],
)
def test_patched_model_generating_past_L_within_reach_is_quiet(reminders, method, kwargs):
    model = rope_extend.patch(tiny_model("llama"), method, **kwargs)  # L = 256
    generate(model, 300)
    assert reminders == []


def test_unpatched_and_past_the_target_still_remind(reminders):
    model = tiny_model("llama")
    generate(model, 300)
    assert len(reminders) == 1 and "(256)" in reminders[0]

    rope_extend.patch(model, "yarn", factor=2)  # target 512
    generate(model, 520)
    assert len(reminders) == 2 and "(512)" in reminders[1]

    rope_extend.patch(model, "leaky_rerope")  # its positions pass L at w + k (L - w): not unlimited
    forget_reminders()
    generate(model, 300)
    assert len(reminders) == 3

    rope_extend.patch(model, "rerope")
    forget_reminders()
    generate(model, 300)
    assert len(reminders) == 3
    rope_extend.unpatch(model)  # unpatched, generate is transformers' own again
    assert "_get_stopping_criteria" not in model.__dict__
    forget_reminders()
    generate(model, 300)
    assert len(reminders) == 4


def test_patched_generation_is_unchanged(reminders):
    """Only the reminder goes: the tokens are those generate gives with transformers' own stopping criteria."""
    model = rope_extend.patch(tiny_model("llama"), "rerope")
    quiet = generate(model, 300)
    del model.__dict__["_get_stopping_criteria"]
    forget_reminders()
    assert torch.equal(generate(model, 300), quiet) and len(reminders) == 1
