"""The attention function transformers calls on a patched model, and the path each layer takes through it.

A layer with a method's rules runs the passes (``passes``), outside torch.compile's graph (``_runner``); a layer
without (log-n alone, NoPE layers, a hybrid's local layers) calls the implementation the model used before
(``plan.inner``), with log-n's scale on its queries when it has one.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from ...errors import UnsupportedModelError
from .. import causal as causality
from .. import compiled, mrope, slots
from ..names import PLAN_ATTR
from . import keys as kept_keys
from .masks import Mask, _additive
from .passes import Call, _attend
from .positions import _logn, _query_positions, _query_slots
from .state import NAME, AttentionPlan


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
):
    """rope-extend's attention, registered with transformers' ``AttentionInterface`` (``register``).

    transformers' models call their attention function with the five tensors positionally and the rest by
    keyword (checked over the model files of 5.17 and 5.24), so ``dropout``, ``scaling`` and ``softcap`` are
    keyword-only here.

    Args:
        module: the attention module; its plan is ``module.__dict__[PLAN_ATTR]`` (none: plain SDPA).
        query: ``(B, H, T, D)``, rotated at the true positions.
        key: ``(B, H_kv, S, D)``, rotated at the true positions (cached keys too).
        value: ``(B, H_kv, S, D_v)``.
        attention_mask: the mask transformers built for the implementation (``masks.Mask``).
        dropout: attention dropout; refused on a method layer in training mode.
        scaling: the logit scale; None: ``module.head_dim ** -0.5``.
        softcap: logit softcapping (Gemma 2), or None.
        **kwargs: the layer's extra arguments (``position_ids``, ``s_aux``, ``sliding_window``, ...).

    Returns:
        ``(output (B, T, H, D_v), None)``: no attention weights.
    """
    plan: AttentionPlan | None = module.__dict__.get(PLAN_ATTR)
    inner = plan.inner if plan is not None else "sdpa"
    # on an M-RoPE model the positions its rotary turned the tokens by (``hf.mrope``), else the layer's
    position_ids = mrope.positions(module, kwargs.get("position_ids"), query.shape[2])
    if plan is None or plan.rules is None:
        if inner == "flex_attention" and plan is not None:
            _check_flex(plan, module)
        if plan is not None and plan.logn:
            query = _logn(query, _query_positions(position_ids, module, query, key, plan), plan)
        if inner == "eager":  # the SDPA mask leaves a plain causal mask out (None); eager needs it
            if attention_mask is None and getattr(module, "is_causal", True):
                rows = _query_slots(plan, module, query, key)[:, None]  # (T, 1)
                # (1, S) <= (T, 1) -> (T, S) -> (1, 1, T, S)
                attention_mask = (torch.arange(key.shape[2], device=query.device)[None, :] <= rows)[None, None]
            attention_mask = _additive(attention_mask, query.dtype)
        extra = {"softcap": softcap} if softcap is not None else {}
        return _inner(module, inner)(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **extra, **kwargs
        )
    if position_ids is not kwargs.get("position_ids"):
        kwargs = {**kwargs, "position_ids": position_ids}
    return plan.runner(
        module,
        plan,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        softcap=softcap,
        kwargs=kwargs,
    )


def _inner(module: nn.Module, name: str):
    """The attention function of implementation ``name`` for ``module``: transformers' registered one, or for
    ``eager`` the ``eager_attention_forward`` of the module's own modeling file (each family writes its own)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name != "eager":
        return ALL_ATTENTION_FUNCTIONS[name]
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise UnsupportedModelError(f"{type(module).__name__}'s module has no eager_attention_forward")
    return fn


def _method_attention(module, plan, query, key, value, attention_mask, *, dropout, scaling, softcap, kwargs):
    """A layer with a method's rules. Keys past the newest query's (a static cache's empty slots) are cut off
    first, so that the key in the last slot is the newest (``hf.slots``); then the call is checked (dropout,
    causality) and handed to the passes as one ``Call``. Returns ``(output (B, T, H, D_v), None)``."""
    if dropout and module.training:
        raise UnsupportedModelError(f"{NAME} attention has no dropout; call model.eval() or set attention_dropout=0")
    if scaling is None:
        scaling = module.head_dim**-0.5
    end = slots.filled(plan.recorder, module, key)
    if end is not None:
        end = int(end)  # one host sync: a static layer's length is a tensor
    # on the mask as the layers share it (before the cut below makes a copy per layer): checked once per forward
    filled = key.shape[2] if end is None else end
    noncausal = causality.check(module, attention_mask, query.shape[2], filled, kwargs.get("is_causal"))
    if end is not None:
        key, value = key[:, :, :end], value[:, :, :end]  # (B, H_kv, S_filled, D | D_v)
        # a 4D mask [b, 1, n, slots] or FlashAttention's padding mask [b, slots]; FlexAttention's BlockMask is
        # evaluated on slot indices (``Mask.block``), all below ``end``
        if isinstance(attention_mask, torch.Tensor):
            attention_mask = attention_mask[..., :end]
    if noncausal is not None:
        raise UnsupportedModelError(
            f"{plan.method} on {type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}): this input's "
            f"attention {noncausal}, and the method's position rules are defined for causal attention, where every "
            "key is at or before its query"
        )
    position_ids = kwargs.get("position_ids")
    if position_ids is None and plan.positions is not None:  # the decoder's (``PositionKeeper``): left padding
        position_ids = plan.positions.of(query)
    call = Call(
        module=module,
        plan=plan,
        query=query,
        key=key,
        value=value,
        mask=Mask.of(attention_mask, query, key, plan.inner, kwargs.get("sliding_window")),
        scaling=scaling,
        softcap=softcap,
        position_ids=position_ids,
        sinks=kwargs.get("s_aux"),  # GPT-OSS, Granite-SWA: one more logit per head, with value 0
        cache_layer=kept_keys.holder(plan, module, key) if end is None else None,
    )
    return _attend(call), None


def _check_flex(plan: AttentionPlan, module) -> None:
    """Refuse a layer that keeps transformers' FlexAttention over a full static cache layer: the ``BlockMask``
    transformers builds evaluates its causal rule inside the kernel with the cache's length as a tensor, which the
    layer's own cache update has already advanced, so every query also sees the empty slots after it (decode steps
    off by about 1e-2 on a tiny Llama, with or without rope-extend). The method's own layers are exact there: they
    cut the keys at the newest one first."""
    if slots.static_full(plan.recorder, module):
        raise UnsupportedModelError(
            f"{plan.method}{' (log-n)' if plan.logn else ''} with flex_attention and a static cache: layer {module.layer_idx} keeps transformers' "
            "FlexAttention, whose mask reads the static cache's length after the layer has advanced it, so its "
            "queries see empty slots (wrong even without rope-extend); use attn_implementation='sdpa' or 'eager', "
            "or a DynamicCache"
        )


def _runner(method: str):
    """``_method_attention`` wrapped so that torch.compile runs it eagerly (a graph break): its passes are laid out
    by position ids and a cache length read on the host. Under ``fullgraph=True`` dynamo refuses it with this
    reason. One wrapper per method name, so the reason names it."""
    if method not in _RUNNERS:
        reason = (
            f"rope-extend's {method} attention splits each layer into passes by position ids and the cache length "
            "read on the host, so torch.compile runs it outside the graph; compile with fullgraph=False (the "
            "default, and generate's)"
        )
        _RUNNERS[method] = compiled.eager(_method_attention, reason)
    return _RUNNERS[method]


_RUNNERS: dict[str, Any] = {}
