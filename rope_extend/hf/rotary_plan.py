"""What planning knows of one rotary module: its frequency sets, each checked against the module's buffer.

``hf.patch_plan`` (``rope_extend.patch``) and ``hf.register`` (a model built from a config naming a rope-extend
type) both plan the rotary runtime with ``entry`` before anything is installed; ``hf.attach`` then installs the
``RotaryPlan`` values it is given, without planning anything again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import UnsupportedModelError
from . import rotary
from .reading import rotary_geometry, rotating


@dataclass(frozen=True)
class RotaryPlan:
    """One rotary module to run rope-extend's runtime: the config its frequencies come from and its frequency sets
    (``{layer_type: Entry}``), each checked against the module's buffer (``entry``)."""

    module: nn.Module
    config: Any
    entries: dict[str | None, rotary.Entry]


def entry(module: nn.Module, config, scaling, layer_type, computed=None) -> rotary.Entry:
    """The runtime's entry for ``module``'s frequency set ``layer_type`` scaled by ``scaling``, with the rotary
    dimension and base that ``config`` implies (``computed``: its frequencies and attention scale at ``L`` when the
    caller has them, ``hf.config.ConfigEdit.frequencies``, so they are not computed again); refuses a module whose buffer holds another number of frequencies
    (a rotary layout rope-extend does not know, which it would scale wrong)."""
    dim, base = rotary_geometry(config, layer_type)
    buffer = rotary.buffers(module)[rotary.buffer_name(layer_type)]
    if buffer.numel() != dim // 2:
        raise UnsupportedModelError(
            f"{type(module).__name__}.{rotary.buffer_name(layer_type)} has {buffer.numel()} frequencies but the config "
            f"implies a rotary dimension of {dim} ({dim // 2} frequencies): unsupported rotary layout"
        )
    first = None if computed is None else (computed[0].clone(), computed[1])  # each module owns its buffer
    return rotary.Entry(scaling, dim, base, rotating(config, layer_type), first=first)
