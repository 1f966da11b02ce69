"""A method layer's attention as passes over re-rotated queries and keys, merged by their log-sum-exp.

The layer's queries and keys arrive rotated at their true positions (cached keys too). RoPE rotations compose,
``R(a) R(b) = R(a + b)``, so a key rotated at ``j`` is moved to the method's key position ``kpos(j)`` by one more
rotation by ``kpos(j) - j``, in the layer's own convention as ``hf.layout.probe`` measured it, and a query the
same way. For each block of ``BLOCK`` queries and each kind of pair the method defines (``methods.attention``'s
``Rules``: Self-Extend's near and grouped keys, Dual Chunk's intra / successive / inter chunks, ReRoPE's window
and beyond), one pass runs on the re-rotated queries over a range of keys (``kernels``); the passes are merged
by their log-sum-exp, attention sinks (``s_aux``) as one more term. Memory is linear in the length (a block of
queries times the keys of one pass), never a full score matrix.

Positions: the query at row ``t`` of ``n`` is at ``position_ids[b, -1] - (n - 1 - t)``; the key in slot ``u``
at ``position_ids[b, -1] - (m - 1 - u)`` (the keys end at the newest query's). Rows of a batch with different
offsets (left padding) are computed apart; position ids that disagree with this rule on a token a real token
sees are refused (``_check_positions``).

Shapes: ``B`` batch, ``H`` query heads, ``H_kv`` key/value heads, ``T`` query rows, ``S`` keys, ``D`` head
size, ``D_v`` value head size.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace

import torch
from torch import nn

from ...errors import RopeExtendError
from ...methods.attention import logn_scale
from ..names import WORKSPACE_ATTR
from . import keys as kept_keys
from .kernels import _autograd, _merge, _partial, compute_dtype
from .masks import Mask
from .state import NAME, AttentionPlan

BLOCK = 512  # query rows per block
ROTATE = 4096  # keys rotated at a time (float32 work space)
REUSE_ROWS = 64  # calls with at most this many query rows (decode steps) rotate keys into kept work space


@dataclass(frozen=True, kw_only=True)
class Call:
    """What one attention call of a method layer needs, handed down the passes as one argument.

    ``query`` and ``key`` are rotated at their true positions; ``key`` and ``value`` are cut at the newest key
    (a static cache's empty slots dropped, ``hf.slots``), so that the last key slot is the newest token's."""

    module: nn.Module  # the attention module (its layer index and head size, for messages)
    plan: AttentionPlan  # the method's rules, the layer's rotation (``plan.layout``), log-n
    query: torch.Tensor  # (B, H, T, D)
    key: torch.Tensor  # (B, H_kv, S, D)
    value: torch.Tensor  # (B, H_kv, S, D_v)
    mask: Mask | None  # None: every key at or before its query is allowed
    scaling: float  # the logit scale, usually D ** -0.5
    softcap: float | None = None  # logit softcapping (Gemma 2): tanh(s / c) * c
    position_ids: torch.Tensor | None = None  # (1 | B, T); None: the rows are the last T key slots
    sinks: torch.Tensor | None = None  # (H,): GPT-OSS's ``s_aux``, one more logit per head with value 0
    cache_layer: object = None  # the DynamicLayer ``key`` is, where turned keys may be kept on it (``keys``)

    def rows(self, index: torch.Tensor | None) -> Call:
        """The call on the batch rows ``index`` (None: all of them, ``self``). Their positions then travel as
        the offsets ``_attend_rows`` is given, so ``position_ids`` are dropped."""
        if index is None:
            return self
        return replace(
            self,
            query=self.query.index_select(0, index),  # (B', H, T, D)
            key=self.key.index_select(0, index),  # (B', H_kv, S, D)
            value=self.value.index_select(0, index),  # (B', H_kv, S, D_v)
            mask=self.mask.rows(index) if self.mask is not None else None,
            position_ids=None,
            cache_layer=None,  # kept keys cover every batch row
        )


def _attend(call: Call) -> torch.Tensor:
    """The method's attention over the whole batch: rows grouped by the position of their newest query, each
    group through ``_attend_rows``.

    Args:
        call: the attention call (``Call``).

    Returns:
        ``(B, T, H, D_v)`` in the query's dtype, as transformers' attention functions return it.
    """
    query, value, mask = call.query, call.value, call.mask
    b, h, n, _ = query.shape
    m = call.key.shape[2]
    last = [m - 1] * b
    if call.position_ids is not None:
        pos = call.position_ids.expand(b, -1)  # (1 | B, T) -> (B, T)
        if n == 1:
            last = pos[:, -1].tolist()  # one host sync per layer
        else:  # the query rows whose position id is not where consecutive positions put them
            off = pos != pos[:, -1:] - torch.arange(n - 1, -1, -1, device=pos.device)  # (B, T)
            *last, any_off = torch.cat([pos[:, -1], off.any()[None]]).tolist()  # still one sync
            if any_off:
                _check_positions(off, mask, n, m)
    out = None  # allocated only for a batch whose rows have different offsets
    groups: dict[int, list[int]] = {}
    for row, p in enumerate(last):
        groups.setdefault(int(p), []).append(row)
    for p, rows in groups.items():
        index = None if len(rows) == b else torch.tensor(rows, device=query.device)
        if index is not None:  # rows apart: the kept keys (all rows) are not brought up to date
            kept_keys.drop(call.cache_layer)
        part = _attend_rows(call.rows(index), p - (n - 1), p - (m - 1))  # (B', T, H, D_v)
        if index is None:
            return part
        if out is None:
            out = torch.zeros(b, n, h, value.shape[-1], dtype=query.dtype, device=query.device)  # (B, T, H, D_v)
        out[index] = part
    assert out is not None  # a batch has rows: either one group held them all (returned) or ``out`` was made
    return out


def _check_positions(off: torch.Tensor, mask: Mask | None, n: int, m: int) -> None:
    """Refuse position ids the positions rule above would get wrong, before anything is computed.

    The rows ``off`` (``(B, T)``) have a position id other than their consecutive one. That is exact only where
    they are padding: each such row sees no key, and no row sees its key (slot ``m - n + t``), so neither its
    output nor its position reaches a real token. Left padding masked by ``attention_mask`` passes (its ids are
    0 or 1, whatever the caller filled in); packed documents (ids restarting inside a row), PoSE's jumps and
    right padding with cumulative ids do not. Costs a pass over the mask's rows and columns of the off rows, and
    runs only when some row is off."""
    rows_off = off.any(0).nonzero().flatten().tolist()  # (B, T) -> (T,) -> the off rows' indices
    r0, r1 = rows_off[0], rows_off[-1] + 1

    def seen(rows: slice, cols: slice) -> torch.Tensor:  # (B | 1, rows, cols): mask and causality by slot
        r = torch.arange(rows.start, rows.stop, device=off.device)[:, None]  # (rows, 1)
        c = torch.arange(cols.start, cols.stop, device=off.device)[None, :]  # (1, cols)
        allow = (c <= m - n + r)[None, None]  # (1, 1, rows, cols)
        given = mask.block(rows, cols) if mask is not None else None
        return (allow if given is None else allow & given).any(1)

    def blocks(start: int, stop: int):
        return (slice(a, min(a + BLOCK, stop)) for a in range(start, stop, BLOCK))

    keys_off = slice(m - n + r0, m - n + r1)  # any() stops at the first block that shows it
    off_row_sees = any(bool((seen(rows, slice(0, m)).any(-1) & off[:, rows]).any()) for rows in blocks(r0, r1))
    if off_row_sees or any(bool((seen(rows, keys_off).any(-2) & off[:, r0:r1]).any()) for rows in blocks(0, n)):
        raise RopeExtendError(
            f"{NAME} attention: position_ids are not consecutive within a sequence (packed documents "
            "with positions restarting, PoSE position jumps, or right padding); the attention methods place each "
            "token at the row's last position id minus its distance from the end, which would give wrong results. "
            "Allowed: consecutive position ids per row, with left padding masked out by attention_mask"
        )


def _attend_rows(call: Call, q0: int, k0: int) -> torch.Tensor:
    """Rows that share offsets: queries at positions ``q0 ..``, keys at ``k0 ..``. Returns ``(B, T, H, D_v)``.

    Precision: rotations in float32 (angles in float64), the passes in the model's dtype (``compute_dtype``:
    the kernels accumulate in float32), their outputs merged in float32 and cast once per block."""
    plan, query, key, value, mask = call.plan, call.query, call.key, call.value, call.mask
    rules, layout = plan.rules, plan.layout
    # the passes run only for a plan with rules (``forward``), and such a plan has the layer's layout once the model
    # is probed: at planning, or by the deferred probe before the first forward (``installation``)
    assert rules is not None and layout is not None
    b, h, n, _ = query.shape
    m, device, dtype = key.shape[2], query.device, query.dtype
    compute = compute_dtype(dtype)
    first = max(k0, 0)  # negative positions are padding
    qpos = torch.arange(q0, q0 + n, device=device)  # (T,)
    kpos = torch.arange(first, k0 + m, device=device)  # (S',): the keys at positions >= 0
    scale = logn_scale(qpos, plan.original_max_position_embeddings) if plan.logn else None  # (T,)
    keys, values = key[:, :, first - k0 :], value[:, :, first - k0 :].to(compute)  # (B, H_kv, S', D | D_v)
    small = n <= REUSE_ROWS  # a decode step (or a few rows)
    # keys moved by a constant per run (Dual Chunk's chunks): a few queries turn once per run, no key turns
    by_query = small and rules.run_length is not None
    # autograd keeps what the passes read for the backward: then no rotated keys in reused memory
    reuse = small and not _autograd(query, key, value)
    # a DynamicCache's layer: the turned keys of earlier steps may be kept on it (``keys``)
    kept = (call.cache_layer, first - k0, first) if call.cache_layer is not None else None
    rotated = _rotated_keys(rules, layout, keys, kpos, compute, reuse=reuse, by_query=by_query, kept=kept)
    out = torch.zeros(b, n, h, value.shape[-1], dtype=dtype, device=device)  # (B, T, H, D_v)
    for a, e in rules.blocks(max(q0, first), q0 + n, BLOCK):
        rows = slice(a - q0, e - q0)
        i = qpos[rows]  # (T_b,)
        q = query[:, :, rows].float()  # (B, H, T_b, D)
        if scale is not None:
            q = q * scale[rows][None, None, :, None]  # scale as (1, 1, T_b, 1)
        acc = lse = None
        for kind, j0, j1, full in rules.passes(a, e, first):
            if j1 <= j0:
                continue
            turn = None  # how far the queries turn: None for a kind at true positions for both
            if rules.key_group(kind) is not None:
                turn = (rules.query_position(kind, i) - i).to(torch.float64)  # (T_b,)
            runs = _key_runs(rules, kind, j0, j1) if by_query and rules.moves_keys(kind) else [(j0, j1, 0)]
            for r0, r1, shift in runs:  # keys r0 .. r1-1 moved by ``shift`` (0: not moved, or already turned)
                if turn is None and not shift:
                    qk = q
                else:  # keys move only in a kind with a key group (``Rules.moves_keys``), whose queries turn too
                    assert turn is not None
                    qk = layout.rotate(q, turn - shift)
                cols = slice(r0 - first, r1 - first)
                allow = None
                if not full:
                    j = kpos[cols]  # (S_p,)
                    # (T_b, 1) against (1, S_p) -> (T_b, S_p) -> (1, 1, T_b, S_p)
                    allow = (rules.region(kind, i[:, None], j[None, :]) & (j[None, :] <= i[:, None]))[None, None]
                given = mask.block(rows, slice(r0 - k0, r1 - k0)) if mask is not None else None
                if given is not None:
                    allow = given if allow is None else allow & given
                part, part_lse = _partial(  # (B, H, T_b, D_v), (B, H, T_b)
                    qk.to(compute), rotated[kind][:, :, cols], values[:, :, cols], allow, call.scaling, call.softcap
                )
                acc, lse = (part, part_lse) if acc is None else _merge(acc, lse, part, part_lse)
        if acc is not None and lse is not None and call.sinks is not None:  # (acc and lse are set together)
            sink = call.sinks.float().reshape(1, -1, 1).expand_as(lse)  # (H,) -> (1, H, 1) -> (B, H, T_b)
            acc, lse = _merge(acc, lse, torch.zeros_like(acc), sink)
        if acc is not None:
            out[:, rows] = acc.transpose(1, 2).to(dtype)  # (B, H, T_b, D_v) -> (B, T_b, H, D_v)
    return out


def _key_runs(rules, kind: str, j0: int, j1: int) -> list[tuple[int, int, int]]:
    """The keys ``j0 .. j1-1`` cut at multiples of ``rules.run_length``, each run with the constant
    ``key_position(j) - j`` of its keys: ``(first, last + 1, shift)``."""
    s, out = rules.run_length, []
    while j0 < j1:
        end = min(j1, (j0 // s + 1) * s)
        out.append((j0, end, int(rules.key_position(kind, torch.tensor([j0]))[0]) - j0))
        j0 = end
    return out


def _rotated_keys(rules, layout, keys, kpos, compute, *, reuse=False, by_query=False, kept=None) -> dict:
    """``{pass kind: the keys (B, H_kv, S', D) rotated to that pass's key positions}``, in ``compute``: every key
    once per key group, so O(m) memory per group. A kind that keeps its keys at their true positions (no key
    group, STRING's far keys), or every kind with ``by_query`` (its queries turn per run of keys instead), gets
    them unturned. ``reuse``: write them into kept work space (``_rotate``). ``kept``: ``(cache layer, its first
    slot in keys, that slot's position)``: with ``reuse``, the turned keys are kept on the cache layer across steps
    and only the slots added since the last step are turned (``keys``), the same values as turning them all."""
    if kept is not None and (by_query or not reuse):  # prefill, autograd: nothing kept, the copy is out of date
        kept_keys.drop(kept[0])
        kept = None
    rotated: dict[str, torch.Tensor] = {}
    groups: dict[str | None, torch.Tensor] = {}  # by key group
    plain = None
    for kind in rules.kinds:
        group = rules.key_group(kind)
        if by_query or not rules.moves_keys(kind):
            plain = rotated[kind] = plain if plain is not None else keys.to(compute)
        elif group in groups:
            rotated[kind] = groups[group]
        else:
            if kept is None:
                delta = rules.key_position(kind, kpos) - kpos  # (S',)
                rotated[kind] = groups[group] = _rotate(layout, keys, delta, compute, group if reuse else None)
                continue
            layer, offset, first = kept
            space, done = kept_keys.reserve(
                layer, group, owner=layout, shape=keys.shape, dtype=compute, offset=offset, first=first
            )
            if done < keys.shape[2]:  # the slots added since the last step (all of them the first time)
                new = kpos[done:]  # (S' - done,)
                delta = rules.key_position(kind, new) - new
                _rotate(layout, keys[:, :, done:], delta, compute, group, out=space[:, :, done:])
            rotated[kind] = groups[group] = space
    if kept is not None:
        kept_keys.seal(kept[0])
    return rotated


def _rotate(layout, keys, delta, compute, group: str | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``layout.rotate`` in float32, ``ROTATE`` keys at a time, written into a tensor of dtype ``compute`` (no
    float32 copy of all the keys), with cos and sin from ``layout.cos_sin`` (the same values ``rotate`` computes).

    With a ``group`` (a decode step, no autograd saving the result) the keys are written into that group's work
    space, kept on the rotary module for the next layer and step (``_workspace``), and cos and sin of whole
    positions come from the shared table, so a step computes no angles and touches no fresh memory. With None
    (prefill, where O(n^2) attention dwarfs both; or autograd) nothing is kept: fresh memory, angles computed, so
    a long prefill's peak holds no table or work space of its length. ``out`` (with a ``group``): write there
    instead of the group's work space (kept keys, ``keys``)."""
    cos, sin = layout.cos_sin(delta, torch.float32, table=group is not None)  # (S', dim / 2) each
    if group is None:  # prefill or autograd (out= writes are not differentiable either)
        out = torch.empty(keys.shape, dtype=compute, device=keys.device)  # (B, H_kv, S', D)
        for c in range(0, keys.shape[2], ROTATE):
            piece = slice(c, c + ROTATE)
            out[:, :, piece] = layout.apply(keys[:, :, piece].float(), cos[piece], sin[piece]).to(compute)
        return out
    if out is None:
        out = _workspace(layout.rotary, group, keys.shape, compute, keys.device)  # (B, H_kv, S', D)
    b, h, m, _ = keys.shape
    # the rotation's two products of one piece: (2, B, H_kv, min(S', ROTATE), dim / 2)
    scratch = _workspace(layout.rotary, None, (2, b, h, min(m, ROTATE), layout.dim // 2), torch.float32, keys.device)
    for c in range(0, m, ROTATE):
        piece = slice(c, c + ROTATE)
        part = scratch[:, :, :, : min(m - c, ROTATE)]  # (2, B, H_kv, S_piece, dim / 2)
        layout.apply(keys[:, :, piece].float(), cos[piece], sin[piece], out=out[:, :, piece], scratch=part)
    return out


def _workspace(owner: nn.Module, group: str | None, shape, dtype, device) -> torch.Tensor:
    """A tensor of ``shape`` for the rotated keys of one key group (``group``; None: the rotation's products),
    from memory kept on ``owner`` (the rotary module the layers share) and reused by every layer and decode
    step: on the CPU fresh memory costs a page fault per page, more than a decode step's rotation itself.
    Layers run one after another and a layer's rotated keys are dead once its attention returns, so one space
    per group and thread suffices. Grown by a quarter past the need, so a decode step (one key more) reuses it;
    freed by ``remove``. Only for calls of at most ``REUSE_ROWS`` query rows; never under autograd."""
    spaces = owner.__dict__.setdefault(WORKSPACE_ATTR, {})
    numel = math.prod(shape)
    key = (threading.get_ident(), group, dtype, device)  # per thread: a model may serve several
    space = spaces.get(key)
    if space is None or space.numel() < numel:
        space = spaces[key] = torch.empty(numel + numel // 4, dtype=dtype, device=device)
    return space[:numel].view(shape)  # flat -> shape
