"""Attention that re-rotates queries and keys: the runtime of the attention methods and of log-n.

Route: an attention function registered with transformers' ``AttentionInterface`` (and a mask function with
``AttentionMaskInterface``) under the name ``rope_extend`` for models loaded with ``eager`` or ``sdpa`` (the SDPA
mask), and ``rope_extend_flash_attention_2`` / ``_3`` / ``rope_extend_flex_attention`` for the others (their own
mask: a padding mask, a ``BlockMask``). ``install`` points the model's config at it and gives every attention
module an ``AttentionPlan``: the method's position rules (``methods.attention``), the rotary module and frequency
set of the layer, and the implementation the model used before, which layers without a method (Gemma's local
sliding layers) keep, with the mask that implementation expects. A method layer reads the same mask as booleans
(``Mask``).

One module per job, each importing only those above it in this list:

- ``state``: the per-module state (``AttentionPlan`` under ``PLAN_ATTR``) and the names it is kept under;
- ``kernels``: one pass on aten's CPU flash attention or plain torch tiles, and the log-sum-exp merge;
- ``masks``: every implementation's mask as booleans (``Mask``);
- ``positions``: where the query rows are (``PositionKeeper``), and log-n's query scale;
- ``passes``: a method layer's attention as passes over re-rotated queries and keys (``Call``, ``_attend``);
- ``forward``: the attention function transformers calls (``attention_forward``), and each layer's path;
- ``registration``: the names in transformers' registries, and the entries registered there;
- ``plan``: planning and refusal, before anything is touched (``plans``);
- ``installation``: ``install``, ``remove`` and ``kernel`` (what runs the patched layers).

Which layers change, and what is refused: ``plan``. Kernels: on the CPU each pass runs aten's CPU flash
attention, which returns the log-sum-exp; with logit softcapping (Gemma 2) or on another device, a plain-torch
loop over key tiles (``kernels``); ``patched(model).kernel`` names them.

Positions: the query at row ``t`` of ``n`` is at ``position_ids[b, -1] - (n - 1 - t)``; the key in slot
``u`` at ``position_ids[b, -1] - (e - 1 - u)``, where ``e`` counts the slots up to the newest query's key
(``hf.slots``): all ``m`` of a dynamic cache (full or sliding, offloaded, quantized: keys end at the last query),
the filled length of a static cache layer (``StaticCache``: ``max_cache_len`` slots filled from 0; the slots
after ``e`` are cut off before anything else). Left padding gives negative positions, which the padding mask
hides. Rows of a batch with different offsets are computed apart. Position ids that disagree with this on a
token a real token sees (packed documents, PoSE jumps, right padding with cumulative ids) are refused
(``passes._check_positions``), never computed at the wrong positions. On an M-RoPE model the position ids are
the ones its rotary module turned the tokens by (``hf.mrope``: text tokens only, one position on every axis),
not the ones the layer passes. A method layer over a cache layer of a class ``hf.slots`` does not know is
refused.

torch.compile: a method layer's attention runs outside the graph (``hf.compiled``: its passes are laid out by
position ids and the cache length, read on the host), exactly as without compile; ``fullgraph=True`` is refused
by dynamo with that reason. log-n alone scales the queries by tensors and stays in the graph. A layer that keeps
transformers' FlexAttention (log-n alone, NoPE layers) over a full static cache layer is refused: that mask reads
the cache length after the layer's own update, so its queries see empty slots, with or without rope-extend.
"""

from __future__ import annotations

import sys
import types

from ...methods.attention import logn_scale
from ..config import text_config
from . import forward, installation, kernels, masks, passes, plan, positions, registration, state
from .forward import _method_attention as _method_attention
from .forward import attention_forward
from .installation import install, kernel, remove
from .kernels import SPLIT, TILE, compute_dtype, passes_kernel
from .kernels import _flash_cpu as _flash_cpu
from .kernels import _merge as _merge
from .kernels import _partial as _partial
from .kernels import _partial_cpu as _partial_cpu
from .masks import Mask
from .passes import BLOCK, REUSE_ROWS, ROTATE, Call
from .passes import _attend as _attend
from .passes import _attend_rows as _attend_rows
from .passes import _rotate as _rotate
from .passes import _rotated_keys as _rotated_keys
from .passes import _workspace as _workspace
from .plan import plans
from .positions import PositionKeeper
from .registration import is_registered_name, registered_name
from .state import (
    INNER,
    NAME,
    PLAN_ATTR,
    POSITIONS_HOOK,
    PROBE_HOOK,
    WORKSPACE_ATTR,
    AttentionPlan,
    attention_modules,
)

__all__ = [
    "BLOCK",
    "INNER",
    "NAME",
    "PLAN_ATTR",
    "POSITIONS_HOOK",
    "PROBE_HOOK",
    "REUSE_ROWS",
    "ROTATE",
    "SPLIT",
    "TILE",
    "WORKSPACE_ATTR",
    "AttentionPlan",
    "Call",
    "Mask",
    "PositionKeeper",
    "attention_forward",
    "attention_modules",
    "compute_dtype",
    "install",
    "is_registered_name",
    "kernel",
    "logn_scale",
    "passes_kernel",
    "plans",
    "registered_name",
    "remove",
    "text_config",
]

# the submodules' helpers that tests and benchmarks reach through this package (spies, monkeypatches), imported
# above with ``as`` to mark them re-exported
_PRIVATE = (
    "_attend",
    "_attend_rows",
    "_flash_cpu",
    "_merge",
    "_method_attention",
    "_partial",
    "_partial_cpu",
    "_rotate",
    "_rotated_keys",
    "_workspace",
)
_PARTS = (state, kernels, masks, positions, passes, forward, registration, plan, installation)


class _Package(types.ModuleType):
    """This package's module type: a name it re-exports, set on the package, is set in every submodule that holds
    it too.

    The kernel's tuning constants and helpers live in the submodules whose code reads them (``passes.BLOCK``,
    ``kernels._flash_cpu``, ``passes.logn_scale``); tests and benchmarks set them on the package, as on the single
    module this package was (``monkeypatch.setattr(attention, "BLOCK", 12)``, ``attention.compute_dtype = ...``).
    Forwarding the assignment makes it reach the code that reads the name, and monkeypatch's undo (one more
    assignment) restores both. Names the package does not re-export are set on the package alone."""

    def __setattr__(self, name: str, value) -> None:
        if name in __all__ or name in _PRIVATE:
            for part in _PARTS:
                if name in vars(part):
                    setattr(part, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
