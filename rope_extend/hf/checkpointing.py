"""Activation (gradient) checkpointing under transformers' two names for it.

transformers 5.x renamed ``gradient_checkpointing_enable/disable`` and ``is_gradient_checkpointing`` to
``activation_checkpointing_*``; the old names warn, and the oldest supported version has only them.
"""

from __future__ import annotations

from torch import nn


def enable(model: nn.Module) -> None:
    """Checkpoint every decoder layer, non-reentrant (works with frozen inputs, LoRA and DDP)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def disable(model: nn.Module) -> None:
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    elif getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()
