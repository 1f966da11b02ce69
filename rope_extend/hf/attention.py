"""Attention that re-rotates queries and keys: the runtime of the attention methods and of log-n.

Route: an attention function registered with transformers' ``AttentionInterface`` (and a mask function with
``AttentionMaskInterface``, transformers' SDPA mask) under the name ``rope_extend``. ``install`` points the
model's config at it and gives every attention module an ``AttentionPlan``: the method's position rules
(``methods.attention``), the rotary module and frequency set of the layer, and the implementation the
model used before (``eager`` or ``sdpa``), which layers without a method (Gemma's local sliding layers) keep.

The function receives queries and keys already rotated at their true positions (cached keys too). RoPE
rotations compose, so a key rotated at ``j`` is moved to ``kpos`` by one more rotation by ``kpos - j``,
taken from the model's own rotary module and ``rotate_half`` (any layout, partial rotary included). For
each block of queries and each kind of pair the method defines, one attention pass runs on re-rotated
queries and keys over a range of keys, and the passes are merged by their log-sum-exp: memory is linear in
the length (a block of queries times the keys of one pass), never a full score matrix.

Positions: the query at row ``t`` of ``n`` is at ``position_ids[b, -1] - (n - 1 - t)``; the key in slot
``u`` of ``m`` at ``position_ids[b, -1] - (m - 1 - u)`` (keys end at the last query, as in a dynamic cache,
full or sliding; left padding gives negative positions, which the padding mask hides). Rows of a batch with
different offsets are computed apart. A ``StaticCache`` (keys not ending at the last query) is not supported.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..methods.attention import Rules, logn_scale
from . import rotary as R
from .config import LOCAL_LAYER_TYPES, nested_layer_types, text_config

NAME = "rope_extend"
PLAN_ATTR = "rope_extend_attention"
INNER = ("eager", "sdpa")
BLOCK = 512  # query rows per block
TILE = 1024  # key columns per tile of the plain-torch path (softcapping, non-CPU devices)


@dataclass
class AttentionPlan:
    """What one attention module does: rules (None: plain attention), log-n, and where its rotary lives."""

    inner: str  # the implementation the model used before: "eager" or "sdpa"
    rules: Rules | None
    logn: bool
    original_max_position_embeddings: int
    rotary: nn.Module | None = None
    layer_type: str | None = None
    scale_attr: str = "attention_scaling"

    @property
    def active(self) -> bool:
        return self.rules is not None or self.logn


# ------------------------------------------------------------------------------------------ registration
def register() -> None:
    """Register the attention function and its mask (transformers' SDPA mask) under ``NAME``. Idempotent."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def attention_modules(model: nn.Module, config) -> list[nn.Module]:
    """The decoder's attention modules: modules with a ``layer_idx`` that carry ``config``."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "layer_idx", None), int)
        and getattr(m, "config", None) is config
        and type(m).__name__.endswith("Attention")
    ]


def plans(model: nn.Module, config, scaling, rotary: list[nn.Module]) -> list[tuple[nn.Module, AttentionPlan]]:
    """Plan every attention module of ``model`` for ``scaling``; raises before anything is touched."""
    config = text_config(config)
    inner = config._attn_implementation
    if inner == NAME:
        inner = getattr(config, "_rope_extend_inner", "sdpa")
    if inner not in INNER:
        raise UnsupportedModelError(
            f"{scaling.method.name}{' with logn' if scaling.logn else ''} changes attention and runs on top of the "
            f"eager or sdpa implementation; this model uses {inner!r} (load it with attn_implementation='sdpa')"
        )
    modules = attention_modules(model, config)
    if not modules:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no attention modules with a layer_idx: rope-extend cannot change its attention"
        )
    rules = scaling.rules()
    nested = nested_layer_types(config)
    types = list(getattr(config, "layer_types", None) or ())
    mixed = bool(types) and not all(t in LOCAL_LAYER_TYPES for t in types)
    out = []
    for module in modules:
        idx = module.layer_idx
        layer_type = types[idx] if idx < len(types) else None
        local = mixed and layer_type in LOCAL_LAYER_TYPES
        plan = AttentionPlan(inner, None, False, scaling.original_max_position_embeddings)
        if not local:
            lt = layer_type if nested else None
            owner = next((m for m in rotary if lt in R.module_layer_types(m)), None)
            if owner is None:
                raise UnsupportedModelError(f"no rotary module holds the frequencies of layer {idx} ({layer_type})")
            plan = AttentionPlan(
                inner, rules, scaling.logn, scaling.original_max_position_embeddings, owner, lt, R.scale_name(lt)
            )
            if rules is not None:
                _rotate_half(module)  # raises if the family has none
        out.append((module, plan))
    return out


def install(config, planned) -> None:
    config = text_config(config)
    if config._attn_implementation != NAME:
        config._rope_extend_inner = config._attn_implementation
    for module, plan in planned:
        module.__dict__[PLAN_ATTR] = plan
    config._attn_implementation = NAME


def remove(config, inner: str, modules) -> None:
    config = text_config(config)
    for module in modules:
        module.__dict__.pop(PLAN_ATTR, None)
    config._attn_implementation = inner
    config.__dict__.pop("_rope_extend_inner", None)


# ------------------------------------------------------------------------------------------ the function
def _rotate_half(module: nn.Module):
    fn = getattr(sys.modules.get(type(module).__module__), "rotate_half", None)
    if fn is None:
        raise UnsupportedModelError(
            f"{type(module).__name__}'s module has no rotate_half: rope-extend cannot re-rotate its queries and keys"
        )
    return fn


def _inner(module: nn.Module, name: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "sdpa":
        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise UnsupportedModelError(f"{type(module).__name__}'s module has no eager_attention_forward")
    return fn


def _additive(mask: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """A boolean mask (True: attend) as eager attention's additive one."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def _allowed(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A mask as booleans (True: attend)."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
):
    """transformers' attention-function signature; ``query`` ``[b, h, n, d]``, ``key``/``value`` ``[b, h_kv, m, d]``."""
    plan: AttentionPlan | None = module.__dict__.get(PLAN_ATTR)
    inner = plan.inner if plan is not None else "sdpa"
    position_ids = kwargs.get("position_ids")
    if plan is None or plan.rules is None:
        if plan is not None and plan.logn:
            query = _logn(query, _query_positions(position_ids, query, key), plan)
        if inner == "eager":  # the SDPA mask leaves a plain causal mask out (None); eager needs it
            if attention_mask is None and getattr(module, "is_causal", True):
                n, m = query.shape[2], key.shape[2]
                rows = torch.arange(m - n, m, device=query.device)[:, None]
                attention_mask = (torch.arange(m, device=query.device)[None, :] <= rows)[None, None]
            attention_mask = _additive(attention_mask, query.dtype)
        extra = {"softcap": softcap} if softcap is not None else {}
        return _inner(module, inner)(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **extra, **kwargs
        )
    if dropout and module.training:
        raise UnsupportedModelError(f"{NAME} attention has no dropout; call model.eval() or set attention_dropout=0")
    if scaling is None:
        scaling = module.head_dim**-0.5
    return _attend(module, plan, query, key, value, _allowed(attention_mask), scaling, softcap, position_ids), None


def _query_positions(position_ids, query, key) -> torch.Tensor:
    if position_ids is not None:
        return position_ids.expand(query.shape[0], -1)
    n, m = query.shape[2], key.shape[2]
    return torch.arange(m - n, m, device=query.device).expand(query.shape[0], -1)


def _logn(query: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    scale = logn_scale(positions, plan.original_max_position_embeddings)  # [b, n]
    return (query.float() * scale[:, None, :, None]).to(query.dtype)


def _attend(module, plan, query, key, value, mask, scaling, softcap, position_ids) -> torch.Tensor:
    b, h, n, _ = query.shape
    m = key.shape[2]
    if position_ids is None:
        last = [m - 1] * b
    else:
        last = position_ids.expand(b, -1)[:, -1].tolist()  # one host sync per layer
    out = torch.zeros(b, n, h, value.shape[-1], dtype=query.dtype, device=query.device)
    groups: dict[int, list[int]] = {}
    for row, p in enumerate(last):
        groups.setdefault(int(p), []).append(row)
    for p, rows in groups.items():
        index = None if len(rows) == b else torch.tensor(rows, device=query.device)

        def take(t, index=index):
            return t if index is None or t is None else t.index_select(0, index)

        part = _attend_rows(
            module, plan, take(query), take(key), take(value), take(mask), scaling, softcap, p - (n - 1), p - (m - 1)
        )
        if index is None:
            out = part
        else:
            out[index] = part
    return out


def _rotation(plan: AttentionPlan, delta: torch.Tensor, device):
    """cos, sin ``[1, 1, len, rot]`` (float32) of a rotation by ``delta`` positions, without attention scaling."""
    x = torch.empty(0, dtype=torch.float32, device=device)
    extra = () if plan.layer_type is None else (plan.layer_type,)
    with torch.no_grad():
        cos, sin = R._raw_forward(type(plan.rotary))(plan.rotary, x, delta.to(device)[None], *extra)
    scale = float(getattr(plan.rotary, plan.scale_attr, 1.0) or 1.0)
    if scale != 1.0:
        cos, sin = cos / scale, sin / scale
    return cos[:, None].float(), sin[:, None].float()


def _rotate(x: torch.Tensor, cos, sin, rotate_half) -> torch.Tensor:
    """``x`` (float32) rotated on its first ``rot`` dimensions."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, tail = x[..., :rot], x[..., rot:]
    return torch.cat([head * cos + rotate_half(head) * sin, tail], dim=-1)


def _attend_rows(module, plan, query, key, value, mask, scaling, softcap, q0: int, k0: int) -> torch.Tensor:
    """Rows that share offsets: queries at ``q0 ..``, keys at ``k0 ..``. Returns ``[b, n, h, d_v]``."""
    rules, rotate_half = plan.rules, _rotate_half(module)
    b, h, n, _ = query.shape
    m, device, dtype = key.shape[2], query.device, query.dtype
    first = max(k0, 0)  # negative positions are padding
    qpos = torch.arange(q0, q0 + n, device=device)
    kpos = torch.arange(first, k0 + m, device=device)
    q = query.float()
    if plan.logn:
        q = q * logn_scale(qpos, plan.original_max_position_embeddings)[None, None, :, None]
    keys, values = key[:, :, first - k0 :].float(), value[:, :, first - k0 :]
    rotated, groups = {}, {}
    for kind in rules.kinds:  # every key at its position, once per key group: O(m) memory per group
        group = rules.key_group(kind)
        if group is None:
            rotated[kind] = keys
        elif group in groups:
            rotated[kind] = groups[group]
        else:
            delta = (rules.key_position(kind, kpos) - kpos).to(torch.float64)
            rotated[kind] = groups[group] = _rotate(keys, *_rotation(plan, delta, device), rotate_half)
    out = torch.zeros(b, n, h, value.shape[-1], dtype=dtype, device=device)
    for a, e in rules.blocks(max(q0, first), q0 + n, BLOCK):
        rows = slice(a - q0, e - q0)
        i = qpos[rows]
        acc = lse = None
        for kind, j0, j1, full in rules.passes(a, e, first):
            if j1 <= j0:
                continue
            if rules.key_group(kind) is None:  # true positions for both
                qk = q[:, :, rows]
            else:
                delta = (rules.query_position(kind, i) - i).to(torch.float64)
                qk = _rotate(q[:, :, rows], *_rotation(plan, delta, device), rotate_half)
            cols = slice(j0 - first, j1 - first)
            allow = None
            if not full:
                j = kpos[cols]
                allow = (rules.region(kind, i[:, None], j[None, :]) & (j[None, :] <= i[:, None]))[None, None]
            if mask is not None:
                given = mask[:, :, rows, j0 - k0 : j1 - k0]
                allow = given if allow is None else allow & given
            part, part_lse = _partial(qk, rotated[kind][:, :, cols], values[:, :, cols], allow, scaling, softcap)
            acc, lse = (part, part_lse) if acc is None else _merge(acc, lse, part, part_lse)
        if acc is not None:
            out[:, rows] = acc.transpose(1, 2).to(dtype)
    return out


def _partial(q, k, v, allow, scaling: float, softcap: float | None):
    """Attention of ``q`` over ``k``/``v`` (GQA by head groups) and its log-sum-exp, float32; rows with no key
    allowed give output 0 and log-sum-exp -inf."""
    v = v.float()
    if softcap is None and q.device.type == "cpu":
        bias = None
        if allow is not None:
            bias = torch.zeros(allow.shape, dtype=q.dtype, device=q.device).masked_fill(~allow, float("-inf"))
        # grouped-query attention: the CPU kernel maps query head h to key head h // (h_q / h_kv), as repeat_kv
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scaling
        )
        if allow is not None:
            none = ~allow.any(-1).expand_as(lse)
            lse = lse.masked_fill(none, float("-inf"))
            out = out.masked_fill(none[..., None], 0.0)
        return out, lse
    return _partial_torch(q, k, v, allow, scaling, softcap)


def _partial_torch(q, k, v, allow, scaling, softcap):
    """Plain torch, keys in tiles of ``TILE`` merged by log-sum-exp (softcapping; non-CPU devices)."""
    b, h, n, _ = q.shape
    groups = h // k.shape[1]
    qg = q.reshape(b, k.shape[1], groups * n, q.shape[-1])
    acc = lse = None
    for t0 in range(0, k.shape[2], TILE):
        kt, vt = k[:, :, t0 : t0 + TILE], v[:, :, t0 : t0 + TILE]
        s = torch.matmul(qg, kt.transpose(-1, -2)).view(b, h, n, -1) * scaling
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if allow is not None:
            s = s.masked_fill(~allow[..., t0 : t0 + TILE], float("-inf"))
        part_lse = torch.logsumexp(s, dim=-1)
        weights = torch.exp(s - part_lse.masked_fill(part_lse == float("-inf"), 0.0)[..., None])
        part = torch.matmul(weights.reshape(b, k.shape[1], groups * n, -1), vt).reshape(b, h, n, -1)
        acc, lse = (part, part_lse) if acc is None else _merge(acc, lse, part, part_lse)
    return acc, lse


def _merge(out_a, lse_a, out_b, lse_b):
    """Two partial results over disjoint keys as one: weights ``exp(lse_x - lse)``."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.masked_fill(lse == float("-inf"), 0.0)
    wa, wb = torch.exp(lse_a - safe)[..., None], torch.exp(lse_b - safe)[..., None]
    return out_a * wa + out_b * wb, lse
