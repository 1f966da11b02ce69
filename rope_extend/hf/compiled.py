"""Code that torch.compile runs outside its graphs, and why.

rope-extend's runtime reads positions and cache lengths on the host to decide what to compute: the attention
methods lay out their passes by them (``hf.attention``), the dynamic methods' cache keeper turns cached keys when
the length crosses a step (``hf.cache_keeper``). Traced, each such read is a graph break in the middle of transformers'
code, and dynamo resumes there with the values it read as guards, recompiling as they change. Marked with
``eager`` instead, the whole function runs as plain Python between two graphs, exactly as without compile; under
``fullgraph=True`` dynamo refuses it before running anything, with ``reason`` in its message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def eager(fn: Callable, reason: str) -> Callable:
    """``fn`` as ``torch.compiler.disable`` wraps it, with ``reason`` (dropped on torch before 2.7, which has no
    such argument)."""
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:
        return torch.compiler.disable(fn)


def run_eagerly(reason: str) -> Callable[[Callable], Any]:
    """``eager`` as a decorator."""
    return lambda fn: eager(fn, reason)
