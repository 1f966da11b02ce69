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
- ``keys``: a DynamicCache's keys turned for the passes, kept on its layers so a decode step turns only new ones;
- ``passes``: a method layer's attention as passes over re-rotated queries and keys (``Call``, ``_attend``);
- ``forward``: the attention function transformers calls (``attention_forward``), and each layer's path;
- ``registration``: the names in transformers' registries, and the entries registered there;
- ``plan``: planning and refusal, before anything is touched (``plans``);
- ``installation``: ``install``, ``remove`` and ``kernel`` (what runs the patched layers).

The package re-exports the public names above, never the kernel's tuning constants (``passes.BLOCK``,
``kernels.SPLIT``, ...) or helpers: a copy here would take an assignment (a test's monkeypatch, a benchmark's
switch) and change nothing. Set them in the submodule whose functions read them.

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

from ..names import PLAN_ATTR, POSITIONS_HOOK, PROBE_HOOK, WORKSPACE_ATTR
from ..reading import text_config
from .forward import attention_forward
from .installation import install, kernel, remove
from .kernels import passes_kernel
from .masks import Mask
from .passes import Call
from .plan import plans
from .registration import is_registered_name, registered_name
from .state import (
    INNER,
    NAME,
    AttentionPlan,
    PositionKeeper,
    attention_modules,
)

__all__ = [
    "INNER",
    "NAME",
    "PLAN_ATTR",
    "POSITIONS_HOOK",
    "PROBE_HOOK",
    "WORKSPACE_ATTR",
    "AttentionPlan",
    "Call",
    "Mask",
    "PositionKeeper",
    "attention_forward",
    "attention_modules",
    "install",
    "is_registered_name",
    "kernel",
    "passes_kernel",
    "plans",
    "registered_name",
    "remove",
    "text_config",
]
