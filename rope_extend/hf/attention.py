"""Attention that re-rotates queries and keys: the runtime of the attention methods and of log-n.

Route: an attention function registered with transformers' ``AttentionInterface`` (and a mask function with
``AttentionMaskInterface``, transformers' SDPA mask) under the name ``rope_extend``. ``install`` points the
model's config at it and gives every attention module an ``AttentionPlan``: the method's position rules
(``methods.attention``), the rotary module and frequency set of the layer, and the implementation the
model used before (``eager`` or ``sdpa``), which layers without a method (Gemma's local sliding layers) keep.

The function receives queries and keys already rotated at their true positions (cached keys too). RoPE
rotations compose, so a key rotated at ``j`` is moved to ``kpos`` by one more rotation by ``kpos - j``, in the
layer's own convention as ``hf.layout.probe`` measured it on the model (pairing, which dimensions, which
frequency set; NoPE layers are left alone, and a layer rope-extend cannot reproduce is refused). For each block
of queries and each kind of pair the method defines, one attention pass runs on re-rotated queries and keys
over a range of keys, and the passes are merged by their log-sum-exp (attention sinks, ``s_aux``, as one more
term): memory is linear in the length (a block of queries times the keys of one pass), never a full score
matrix.

Positions: the query at row ``t`` of ``n`` is at ``position_ids[b, -1] - (n - 1 - t)``; the key in slot
``u`` of ``m`` at ``position_ids[b, -1] - (m - 1 - u)`` (keys end at the last query, as in a dynamic cache,
full or sliding; left padding gives negative positions, which the padding mask hides). Rows of a batch with
different offsets are computed apart. A ``StaticCache`` (keys not ending at the last query) is not supported.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..methods.attention import Rules, logn_scale
from . import layout as rope_layout
from .config import LOCAL_LAYER_TYPES, family, naming, nested_layer_types, rope_dict, text_config

logger = logging.getLogger("rope_extend")

NAME = "rope_extend"
PLAN_ATTR = "rope_extend_attention"
INNER = ("eager", "sdpa")
BLOCK = 512  # query rows per block
TILE = 1024  # key columns per tile of the plain-torch path (softcapping, non-CPU devices)
ROTATE = 4096  # keys rotated at a time (float32 work space)
SPLIT = 64  # a masked CPU pass is cut into unmasked / causal / masked column ranges from this width on


@dataclass
class AttentionPlan:
    """What one attention module does: rules (None: plain attention), log-n, and where its rotary lives."""

    inner: str  # the implementation the model used before: "eager" or "sdpa"
    rules: Rules | None
    logn: bool
    original_max_position_embeddings: int
    layout: rope_layout.Layout | None = None  # how the layer rotates (``hf.layout``); None until the model is probed

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


def _refuse(config, scaling, why: str) -> UnsupportedModelError:
    """A refusal; ``patch`` (through ``hf.config.naming``) puts the family and the method in front."""
    logn = " (log-n changes attention too)" if scaling.logn and not scaling.method.attention else ""
    return UnsupportedModelError(f"{why}{logn}")


def _on_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def plans(
    model: nn.Module, config, scaling, rotary: list[nn.Module], *, defer: bool = False
) -> list[tuple[nn.Module, AttentionPlan]]:
    """Plan every attention module of ``model`` for ``scaling``; raises before anything is touched.

    The layers' rotation is found by ``hf.layout.probe``. A model built from a config (``defer``: its weights
    are not loaded yet) or still on the meta device is planned without it, and ``install`` probes it at its
    first forward."""
    config = text_config(config)
    inner = config._attn_implementation
    if inner == NAME:
        inner = getattr(config, "_rope_extend_inner", "sdpa")
    if inner not in INNER:
        raise _refuse(
            config,
            scaling,
            f"it changes attention and runs on top of the eager or sdpa implementation; this model "
            f"uses {inner!r} (load it with attn_implementation='sdpa')",
        )
    for lt in nested_layer_types(config) or [None]:
        params = rope_dict(config, lt) or {}
        if params.get("mrope_section") is not None:
            raise _refuse(
                config,
                scaling,
                "its M-RoPE (rope_parameters.mrope_section) gives each token three positions (time, "
                "height, width) and the attention methods' position rules are one-dimensional; use a frequency "
                "method (yarn, linear, ...)",
            )
    probed = (
        None
        if defer or _on_meta(model)
        else rope_layout.probe(model, config, rotary, scaling.original_max_position_embeddings)
    )
    return _plan_modules(model, config, scaling, inner, probed)


def _plan_modules(model, config, scaling, inner: str, probed) -> list[tuple[nn.Module, AttentionPlan]]:
    modules = attention_modules(model, config)
    if probed is not None:
        if not probed:
            raise _refuse(
                config,
                scaling,
                "its attention layers do not call transformers' attention interface, so rope-extend cannot change them",
            )
        missed = [m for m in modules if m not in probed]
        if missed:
            raise _refuse(
                config,
                scaling,
                f"{type(missed[0]).__name__} (layer {missed[0].layer_idx}) does not call "
                "transformers' attention interface, so rope-extend cannot change it",
            )
        modules += [m for m in probed if m not in modules]
    if not modules:
        raise _refuse(config, scaling, f"{type(model).__name__} has no attention modules with a layer_idx")
    rules = scaling.rules()
    types = list(getattr(config, "layer_types", None) or ())
    mixed = bool(types) and not all(t in LOCAL_LAYER_TYPES for t in types)
    out = []
    for module in modules:
        idx = getattr(module, "layer_idx", None)
        layer_type = types[idx] if isinstance(idx, int) and idx < len(types) else None
        plan = AttentionPlan(inner, None, False, scaling.original_max_position_embeddings)
        seen = probed.get(module) if probed is not None else None
        local = mixed and layer_type in LOCAL_LAYER_TYPES
        if not local and (seen is None or seen.kind != "nope"):  # NoPE layers have no position to change
            if seen is not None and seen.kind == "unknown":
                how = seen.why or f"best known layout off by {seen.error:.2g} relative"
                raise _refuse(
                    config,
                    scaling,
                    f"layer {idx} rotates its queries and keys in a way rope-extend cannot reproduce ({how})",
                )
            unknown = sorted(seen.kwargs - rope_layout.KNOWN_KWARGS) if seen is not None else []
            if unknown:
                raise _refuse(
                    config,
                    scaling,
                    f"layer {idx} passes {', '.join(unknown)} to its attention function, which "
                    "rope-extend's attention does not implement",
                )
            plan = AttentionPlan(
                inner, rules, scaling.logn, scaling.original_max_position_embeddings, seen.layout if seen else None
            )
        out.append((module, plan))
    if probed is not None and not any(plan.active for _, plan in out):
        logger.warning(
            "%s changes no layer of %s: its global layers do not rotate (NoPE) and its local layers keep their window",
            scaling.method.name,
            family(config),
        )
    return out


PROBE_HOOK = "_rope_extend_probe_hook"


def install(model: nn.Module, config, planned, scaling=None, rotary=()) -> None:
    """Give every planned module its plan and point the config at ``NAME``. Plans of a model that was on the
    meta device are completed by a probe at its first forward (which raises if the model is refused)."""
    config = text_config(config)
    if config._attn_implementation != NAME:
        config._rope_extend_inner = config._attn_implementation
    for module, plan in planned:
        module.__dict__[PLAN_ATTR] = plan
    config._attn_implementation = NAME
    pending = any(plan.active and plan.layout is None for _, plan in planned)
    decoder = rope_layout.decoder_of(model)
    if pending and PROBE_HOOK not in decoder.__dict__:
        inner = config._rope_extend_inner

        def complete(_module, _args):
            decoder.__dict__.pop(PROBE_HOOK).remove()
            config._attn_implementation = inner
            try:
                with naming(config, scaling.method.name):
                    probed = rope_layout.probe(model, config, list(rotary), scaling.original_max_position_embeddings)
                    final = _plan_modules(model, config, scaling, inner, probed)
            finally:
                config._attn_implementation = NAME
            for module, plan in final:
                module.__dict__[PLAN_ATTR] = plan

        decoder.__dict__[PROBE_HOOK] = decoder.register_forward_pre_hook(complete)


def remove(model: nn.Module, config, inner: str, modules) -> None:
    config = text_config(config)
    for module in modules:
        module.__dict__.pop(PLAN_ATTR, None)
    hook = rope_layout.decoder_of(model).__dict__.pop(PROBE_HOOK, None)
    if hook is not None:
        hook.remove()
    config._attn_implementation = inner
    config.__dict__.pop("_rope_extend_inner", None)


# ------------------------------------------------------------------------------------------ the function
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
    sinks = kwargs.get("s_aux")  # GPT-OSS, Granite-SWA: one more logit per head, with value 0
    out = _attend(module, plan, query, key, value, _allowed(attention_mask), scaling, softcap, position_ids, sinks)
    return out, None


def _query_positions(position_ids, query, key) -> torch.Tensor:
    if position_ids is not None:
        return position_ids.expand(query.shape[0], -1)
    n, m = query.shape[2], key.shape[2]
    return torch.arange(m - n, m, device=query.device).expand(query.shape[0], -1)


def _logn(query: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    scale = logn_scale(positions, plan.original_max_position_embeddings)  # [b, n]
    return (query.float() * scale[:, None, :, None]).to(query.dtype)


def _attend(module, plan, query, key, value, mask, scaling, softcap, position_ids, sinks=None) -> torch.Tensor:
    b, h, n, _ = query.shape
    m = key.shape[2]
    # the last position of each row; reading it is one host sync per layer
    last = [m - 1] * b if position_ids is None else position_ids.expand(b, -1)[:, -1].tolist()
    out = None  # allocated only for a batch whose rows have different offsets
    groups: dict[int, list[int]] = {}
    for row, p in enumerate(last):
        groups.setdefault(int(p), []).append(row)
    for p, rows in groups.items():
        index = None if len(rows) == b else torch.tensor(rows, device=query.device)

        def take(t, index=index):
            return t if index is None or t is None else t.index_select(0, index)

        part = _attend_rows(
            module,
            plan,
            take(query),
            take(key),
            take(value),
            take(mask),
            scaling,
            softcap,
            p - (n - 1),
            p - (m - 1),
            sinks,
        )
        if index is None:
            return part
        if out is None:
            out = torch.zeros(b, n, h, value.shape[-1], dtype=query.dtype, device=query.device)
        out[index] = part
    return out


def _attend_rows(module, plan, query, key, value, mask, scaling, softcap, q0: int, k0: int, sinks=None) -> torch.Tensor:
    """Rows that share offsets: queries at ``q0 ..``, keys at ``k0 ..``. Returns ``[b, n, h, d_v]``.

    Precision: rotations in float32 (angles in float64), the passes in the model's dtype (``compute_dtype``:
    the kernels accumulate in float32), their outputs merged in float32 and cast once per block."""
    rules, layout = plan.rules, plan.layout
    b, h, n, _ = query.shape
    m, device, dtype = key.shape[2], query.device, query.dtype
    compute = compute_dtype(dtype)
    first = max(k0, 0)  # negative positions are padding
    qpos = torch.arange(q0, q0 + n, device=device)
    kpos = torch.arange(first, k0 + m, device=device)
    scale = logn_scale(qpos, plan.original_max_position_embeddings) if plan.logn else None
    keys, values = key[:, :, first - k0 :], value[:, :, first - k0 :].to(compute)
    rotated = _rotated_keys(rules, layout, keys, kpos, compute)
    out = torch.zeros(b, n, h, value.shape[-1], dtype=dtype, device=device)
    for a, e in rules.blocks(max(q0, first), q0 + n, BLOCK):
        rows = slice(a - q0, e - q0)
        i = qpos[rows]
        q = query[:, :, rows].float()
        if scale is not None:
            q = q * scale[rows][None, None, :, None]
        acc = lse = None
        for kind, j0, j1, full in rules.passes(a, e, first):
            if j1 <= j0:
                continue
            if rules.key_group(kind) is None:  # true positions for both
                qk = q
            else:
                delta = (rules.query_position(kind, i) - i).to(torch.float64)
                qk = layout.rotate(q, delta)
            cols = slice(j0 - first, j1 - first)
            allow = None
            if not full:
                j = kpos[cols]
                allow = (rules.region(kind, i[:, None], j[None, :]) & (j[None, :] <= i[:, None]))[None, None]
            if mask is not None:
                given = mask[:, :, rows, j0 - k0 : j1 - k0]
                allow = given if allow is None else allow & given
            part, part_lse = _partial(
                qk.to(compute), rotated[kind][:, :, cols], values[:, :, cols], allow, scaling, softcap
            )
            acc, lse = (part, part_lse) if acc is None else _merge(acc, lse, part, part_lse)
        if acc is not None and sinks is not None:
            sink = sinks.float().reshape(1, -1, 1).expand_as(lse)
            acc, lse = _merge(acc, lse, torch.zeros_like(acc), sink)
        if acc is not None:
            out[:, rows] = acc.transpose(1, 2).to(dtype)
    return out


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the passes run in: the model's for bf16 and fp16 (the kernels accumulate in float32), else
    float32."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def _rotated_keys(rules, layout, keys, kpos, compute) -> dict:
    """``{pass kind: the keys rotated to that pass's key positions}``, in ``compute``: every key once per key
    group, so O(m) memory per group; a kind without a key group keeps the keys at their true positions."""
    rotated, groups, plain = {}, {}, None
    for kind in rules.kinds:
        group = rules.key_group(kind)
        if group is None:
            plain = rotated[kind] = plain if plain is not None else keys.to(compute)
        elif group in groups:
            rotated[kind] = groups[group]
        else:
            delta = (rules.key_position(kind, kpos) - kpos).to(torch.float64)
            rotated[kind] = groups[group] = _rotate(layout, keys, delta, compute)
    return rotated


def _rotate(layout, keys, delta, compute) -> torch.Tensor:
    """``layout.rotate`` in float32, ``ROTATE`` keys at a time, into a tensor of dtype ``compute`` (no float32
    copy of all the keys)."""
    m = keys.shape[2]
    if m <= ROTATE:  # one piece: no work space beyond the result
        return layout.rotate(keys.float(), delta).to(compute)
    out = torch.empty(keys.shape, dtype=compute, device=keys.device)
    for c in range(0, m, ROTATE):
        out[:, :, c : c + ROTATE] = layout.rotate(keys[:, :, c : c + ROTATE].float(), delta[c : c + ROTATE])
    return out


def _partial(q, k, v, allow, scaling: float, softcap: float | None):
    """Attention of ``q`` over ``k``/``v`` (GQA by head groups; all three of one dtype, the products accumulated
    in float32) and its log-sum-exp, both returned in float32; rows with no key allowed give output 0 and
    log-sum-exp -inf. Value heads narrower or wider than query heads (MLA) are padded with zeros, which changes
    neither the scores nor the output."""
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - dv))
    elif dv > q.shape[-1]:
        q, k = (torch.nn.functional.pad(t, (0, dv - t.shape[-1])) for t in (q, k))
    out, lse = _partial_padded(q, k, v, allow, scaling, softcap)
    return out[..., :dv].float(), lse


def _partial_padded(q, k, v, allow, scaling: float, softcap: float | None):
    if softcap is None and q.device.type == "cpu":
        return _partial_cpu(q, k, v, allow, scaling)
    return _partial_torch(q, k, v, allow, scaling, softcap)


def _partial_cpu(q, k, v, allow, scaling: float):
    """The CPU flash kernel. A masked pass is cut where its mask allows: a causal square at its end (the diagonal
    block) runs with the kernel's own causal skipping, the columns every row sees with no mask, and only the
    rest with an additive mask (a band pass then costs about its allowed area)."""
    if allow is None or allow.shape[-1] < 2 * SPLIT:
        return _flash_cpu(q, k, v, allow, scaling)
    rows, end = allow.shape[-2], allow.shape[-1]
    pieces = []  # (first column, last + 1, mask or None, causal)
    if end >= rows and bool((allow[..., end - rows :] == _tril(rows)).all()):  # every batch row and head
        pieces.append((end - rows, end, None, True))
        end -= rows
    if end:
        seen = allow[..., :end].all(dim=-2).reshape(-1, end).all(0)  # columns every row of every batch sees
        cols = seen.nonzero().flatten().tolist()  # one host sync, on the CPU
        masked = [(0, end)]
        if len(cols) >= SPLIT and cols[-1] - cols[0] + 1 == len(cols):
            pieces.append((cols[0], cols[-1] + 1, None, False))
            masked = [(0, cols[0]), (cols[-1] + 1, end)]
        pieces += [(c0, c1, allow[..., c0:c1], False) for c0, c1 in masked if c1 > c0]
    acc = lse = None
    for c0, c1, mask, causal in pieces:
        out, out_lse = _flash_cpu(q, k[:, :, c0:c1], v[:, :, c0:c1], mask, scaling, causal=causal)
        acc, lse = (out, out_lse) if acc is None else _merge(acc.float(), lse, out.float(), out_lse)
    return acc, lse


def _tril(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def _flash_cpu(q, k, v, allow, scaling: float, causal: bool = False):
    bias = None
    if allow is not None:
        bias = torch.zeros(allow.shape, dtype=q.dtype, device=q.device).masked_fill(~allow, float("-inf"))
    # grouped-query attention: the CPU kernel maps query head h to key head h // (h_q / h_kv), as repeat_kv
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=scaling
    )
    if allow is not None:
        none = ~allow.any(-1).expand_as(lse)
        lse = lse.masked_fill(none, float("-inf"))
        out = out.masked_fill(none[..., None], 0.0)
    return out, lse


def _partial_torch(q, k, v, allow, scaling, softcap):
    """Plain torch, keys in tiles of ``TILE`` merged by log-sum-exp (softcapping; non-CPU devices)."""
    b, h, n, _ = q.shape
    groups = h // k.shape[1]
    qg = q.reshape(b, k.shape[1], groups * n, q.shape[-1])
    acc = lse = None
    for t0 in range(0, k.shape[2], TILE):
        kt, vt = k[:, :, t0 : t0 + TILE], v[:, :, t0 : t0 + TILE]
        s = torch.matmul(qg, kt.transpose(-1, -2)).view(b, h, n, -1).float() * scaling
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if allow is not None:
            s = s.masked_fill(~allow[..., t0 : t0 + TILE], float("-inf"))
        part_lse = torch.logsumexp(s, dim=-1)
        weights = torch.exp(s - part_lse.masked_fill(part_lse == float("-inf"), 0.0)[..., None])
        part = torch.matmul(weights.to(vt.dtype).reshape(b, k.shape[1], groups * n, -1), vt)
        part = part.reshape(b, h, n, -1).float()
        acc, lse = (part, part_lse) if acc is None else _merge(acc, lse, part, part_lse)
    return acc, lse


def _merge(out_a, lse_a, out_b, lse_b):
    """Two partial results over disjoint keys as one: weights ``exp(lse_x - lse)``."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.masked_fill(lse == float("-inf"), 0.0)
    wa, wb = torch.exp(lse_a - safe)[..., None], torch.exp(lse_b - safe)[..., None]
    return out_a * wa + out_b * wb, lse
