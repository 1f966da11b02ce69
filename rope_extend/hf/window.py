"""Sliding-window attention: how wide a model's window is, and widening it for a long-context measurement.

The project's evaluation protocol disables a model's sliding-window attention when measuring long context. Mistral and
Phi-3 use one window in every layer (a memory saving their long-context versions drop); Gemma 2 and 3
interleave local layers with global ones by design (the local layers keep their own rotary).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Literal

from ..errors import RopeExtendError
from .families.context import LOCAL_LAYER_TYPES
from .reading import text_config

logger = logging.getLogger("rope_extend")

SlidingWindowMode = Literal["auto", "full", "keep"]
SLIDING_WINDOW_MODES = ("auto", "full", "keep")


def sliding_window(config) -> int | None:
    """The attention window of a model's sliding-window layers, or None when every layer attends fully
    (Qwen2's ``use_sliding_window: false`` counts as none)."""
    config = text_config(config)
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and not any(t in LOCAL_LAYER_TYPES for t in types):
        return None
    return window


def check_sliding_window_mode(mode: Any, where: str = "sliding_window") -> str:
    if mode not in SLIDING_WINDOW_MODES:
        raise RopeExtendError(f"{where} must be one of {', '.join(SLIDING_WINDOW_MODES)}; got {mode!r}")
    return mode


@contextlib.contextmanager
def sliding_window_widened(model, length: int, mode: str = "auto"):
    """Inside the block, sliding-window attention sees ``length`` tokens; yields whether anything was widened
    and puts every window back on leaving.

    ``mode``: ``"full"`` widens every sliding window; ``"keep"`` leaves the model alone; ``"auto"`` widens a
    window that every layer uses (Mistral, Phi-3) and keeps windows interleaved with full-attention layers
    (Gemma 2 and 3: local layers by design, which keep their own rotary and were never meant to see further).
    """
    check_sliding_window_mode(mode)
    config = text_config(model.config)
    window = sliding_window(config)
    saved: list[tuple[Any, int]] = []
    types = list(getattr(config, "layer_types", None) or ())
    if mode == "keep" or window is None or window >= length:
        pass
    elif mode == "auto" and types and not all(t in LOCAL_LAYER_TYPES for t in types):
        logger.info("keeping the %d-token sliding window of the interleaved local layers", window)
    else:
        saved.append((config, window))
        for module in model.modules():  # attention modules that copied the window at construction
            value = getattr(module, "sliding_window", None)
            if isinstance(value, int) and not isinstance(value, bool):
                saved.append((module, value))
        for obj, _ in saved:
            obj.sliding_window = length
        logger.info("sliding-window attention (%d tokens) widened to %d tokens for this evaluation", window, length)
    try:
        yield bool(saved)
    finally:
        for obj, value in reversed(saved):
            obj.sliding_window = value
