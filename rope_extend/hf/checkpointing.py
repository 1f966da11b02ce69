"""Activation (gradient) checkpointing under transformers' two names for it.

transformers 5.x renamed ``gradient_checkpointing_enable/disable`` and ``is_gradient_checkpointing`` to
``activation_checkpointing_*``; the old names warn, and the oldest supported version has only them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from torch import nn


def _method(model: nn.Module, name: str) -> Callable[..., Any]:
    """``model.<name>``: a ``PreTrainedModel`` method, or one a wrapper (peft) forwards; torch types an attribute
    of an ``nn.Module`` as ``Tensor | Module``."""
    return cast(Callable[..., Any], getattr(model, name))


def enable(model: nn.Module) -> None:
    """Checkpoint every decoder layer, non-reentrant (works with frozen inputs, LoRA and DDP)."""
    if hasattr(model, "activation_checkpointing_enable"):
        _method(model, "activation_checkpointing_enable")({"use_reentrant": False})
    else:
        _method(model, "gradient_checkpointing_enable")(gradient_checkpointing_kwargs={"use_reentrant": False})


def disable(model: nn.Module) -> None:
    if hasattr(model, "activation_checkpointing_disable"):
        _method(model, "activation_checkpointing_disable")()
    elif getattr(model, "is_gradient_checkpointing", False):
        _method(model, "gradient_checkpointing_disable")()
