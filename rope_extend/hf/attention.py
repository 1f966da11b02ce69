"""Attention that re-rotates queries and keys: the runtime of the attention methods and of log-n.

Route: an attention function registered with transformers' ``AttentionInterface`` (and a mask function with
``AttentionMaskInterface``) under the name ``rope_extend`` for models loaded with ``eager`` or ``sdpa`` (the SDPA
mask), and ``rope_extend_flash_attention_2`` / ``_3`` / ``rope_extend_flex_attention`` for the others (their own
mask: a padding mask, a ``BlockMask``). ``install`` points the model's config at it and gives every attention
module an ``AttentionPlan``: the method's position rules (``methods.attention``), the rotary module and frequency
set of the layer, and the implementation the model used before, which layers without a method (Gemma's local
sliding layers) keep, with the mask that implementation expects. A method layer reads the same mask as booleans
(``Mask``).

Which layers change: a method's position rules apply to every layer that rotates and is not local (a sliding
window or chunks, by ``config.layer_types``, in a model that also has global layers); local layers never see a
distance beyond their window, and NoPE layers have no rotation to move. log-n scales the queries of every layer
that is not local, NoPE layers included (the log-length temperature they need at long context; Llama 4 ships
one, ``attn_temperature_tuning``, and log-n on top of it is refused: ``hf.config.own_temperature``). A patch
that would change no layer is refused before anything is touched (``_check_changes``): an attention method on a
NoPE hybrid whose RoPE layers are all local (Cohere 2, EXAONE 4, Llama 4, AFMoE), with the layers named.

Kernels (``kernel``): on the CPU each pass runs aten's CPU flash attention, which returns the log-sum-exp; with
logit softcapping (Gemma 2) or on another device, a plain-torch loop over key tiles. ``patched(model).kernel``
names them.

The function receives queries and keys already rotated at their true positions (cached keys too). RoPE
rotations compose, so a key rotated at ``j`` is moved to ``kpos`` by one more rotation by ``kpos - j``, in the
layer's own convention as ``hf.layout.probe`` measured it on the model (pairing, which dimensions, which
frequency set; NoPE layers are not turned, and a layer rope-extend cannot reproduce is refused). For each block
of queries and each kind of pair the method defines, one attention pass runs on re-rotated queries and keys
over a range of keys, and the passes are merged by their log-sum-exp (attention sinks, ``s_aux``, as one more
term): memory is linear in the length (a block of queries times the keys of one pass), never a full score
matrix.

Positions: the query at row ``t`` of ``n`` is at ``position_ids[b, -1] - (n - 1 - t)``; the key in slot
``u`` at ``position_ids[b, -1] - (e - 1 - u)``, where ``e`` counts the slots up to the newest query's key
(``hf.slots``): all ``m`` of a dynamic cache (full or sliding, offloaded, quantized: keys end at the last query),
the filled length of a static cache layer (``StaticCache``: ``max_cache_len`` slots filled from 0; the slots
after ``e`` are cut off before anything else). Left padding gives negative positions, which the padding mask
hides. Rows of a batch with different offsets are computed apart. Position ids that disagree with this on a
token a real token sees (packed documents, PoSE jumps, right padding with cumulative ids) are refused
(``_check_positions``), never computed at the wrong positions. On an M-RoPE model the position ids are the
ones its rotary module turned the tokens by (``hf.mrope``: text tokens only, one position on every axis), not
the ones the layer passes. A method layer over a cache layer of a class
``hf.slots`` does not know is refused.

torch.compile: a method layer's attention runs outside the graph (``hf.compiled``: its passes are laid out by
position ids and the cache length, read on the host), exactly as without compile; ``fullgraph=True`` is refused
by dynamo with that reason. log-n alone scales the queries by tensors and stays in the graph. A layer that keeps
transformers' FlexAttention (log-n alone, NoPE layers) over a full static cache layer is refused: that mask reads
the cache length after the layer's own update, so its queries see empty slots, with or without rope-extend.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import RopeExtendError, UnsupportedModelError
from ..methods.attention import Rules, logn_scale
from . import causal as causality
from . import compiled, mrope, slots
from . import layout as rope_layout
from .config import LOCAL_LAYER_TYPES, naming, own_temperature, text_config

logger = logging.getLogger("rope_extend")

NAME = "rope_extend"
PLAN_ATTR = "rope_extend_attention"
WORKSPACE_ATTR = "rope_extend_workspace"  # on a rotary module: {(key group, dtype, device): flat tensor}
INNER = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
BLOCK = 512  # query rows per block
TILE = 1024  # key columns per tile of the plain-torch path (softcapping, non-CPU devices)
ROTATE = 4096  # keys rotated at a time (float32 work space)
REUSE_ROWS = 64  # calls with at most this many query rows (decode steps) rotate keys into kept work space
SPLIT = 64  # a masked CPU pass is cut into unmasked / causal / masked column ranges from this width on


@dataclass
class AttentionPlan:
    """What one attention module does: rules (None: plain attention), log-n, and where its rotary lives."""

    inner: str  # the implementation the model used before (one of INNER)
    rules: Rules | None
    logn: bool
    original_max_position_embeddings: int
    layout: rope_layout.Layout | None = None  # how the layer rotates (``hf.layout``); None until the model is probed
    method: str = ""  # the method's name, for messages
    runner: Any = None  # ``_method_attention`` kept out of torch.compile graphs, named for the method (``_runner``)
    watch: slots.Watch | None = None  # the decoder's record of the cache of the running forward (``hf.slots``)
    keep_positions: bool = False  # a method or log-n on a layer whose attention function is given no position ids
    positions: PositionKeeper | None = None  # where it reads them then (``install`` sets it)

    @property
    def active(self) -> bool:
        return self.rules is not None or self.logn


# ------------------------------------------------------------------------------------------ registration
def registered_name(inner: str) -> str:
    """The name the config carries while patched, for a model whose layers used ``inner``: ``NAME`` over eager
    and sdpa (the SDPA mask), ``NAME_<inner>`` over the others, so that the mask transformers builds is the one
    ``inner`` expects (and ``flash`` stays in the name, which transformers reads to prepare flash inputs)."""
    return NAME if inner in ("eager", "sdpa") else f"{NAME}_{inner}"


def is_registered_name(name: str | None) -> bool:
    return name in {registered_name(inner) for inner in INNER}


def register() -> None:
    """Register the attention function under ``registered_name`` of every implementation in ``INNER``, each with
    its mask function (transformers' SDPA mask for ``NAME``). Idempotent."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    masks = AttentionMaskInterface._global_mapping
    for inner in INNER:
        name = registered_name(inner)
        mask = sdpa_mask if name == NAME else masks.get(inner)
        if mask is not None:  # an implementation this transformers does not have stays unregistered
            AttentionInterface.register(name, attention_forward)
            AttentionMaskInterface.register(name, mask)


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
    if is_registered_name(inner):
        inner = getattr(config, "_rope_extend_inner", "sdpa")
    if inner not in INNER:
        raise _refuse(
            config,
            scaling,
            f"it changes attention and runs on top of the model's implementation, one of {', '.join(INNER)}; "
            f"this model uses {inner!r} (load it with attn_implementation='sdpa')",
        )
    # M-RoPE (mrope_section) is planned like 1-D RoPE: text tokens are at one position on every axis, and
    # hf.mrope refuses image tokens at the forward
    probed = None if defer or _on_meta(model) else rope_layout.probe(model, config, rotary, scaling.pretraining_length)
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
        plan = AttentionPlan(inner, None, False, scaling.original_max_position_embeddings, method=scaling.method.name)
        seen = probed.get(module) if probed is not None else None
        local = mixed and layer_type in LOCAL_LAYER_TYPES
        if not local and seen is not None and seen.kind == "nope":  # no position to change; log-n scales its queries
            if scaling.logn and own_temperature(module):
                raise _refuse(config, scaling, own_temperature(module))
            plan = AttentionPlan(
                inner, None, scaling.logn, scaling.original_max_position_embeddings, method=scaling.method.name
            )
        elif not local:
            if seen is not None and seen.kind == "unknown":
                how = seen.why or f"best known layout off by {seen.error:.2g} relative"
                raise _refuse(
                    config,
                    scaling,
                    f"layer {idx} rotates its queries and keys in a way rope-extend cannot reproduce ({how})",
                )
            noncausal = causality.flag(module, None) or (seen.noncausal if seen is not None else None)
            if noncausal is not None and rules is not None:
                raise _refuse(
                    config,
                    scaling,
                    f"layer {idx} {noncausal}; {scaling.method.name}'s position rules are defined for causal "
                    "attention, where every key is at or before its query",
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
                inner,
                rules,
                scaling.logn,
                scaling.original_max_position_embeddings,
                seen.layout if seen else None,
                scaling.method.name,
                _runner(scaling.method.name) if rules is not None else None,
            )
        # the methods and log-n read the query positions; a layer whose attention function is not given them gets
        # the decoder's (``PositionKeeper``)
        moved = plan.logn or plan.rules is not None
        plan.keep_positions = moved and seen is not None and "position_ids" not in seen.kwargs
        out.append((module, plan))
    if probed is not None:
        _check_changes(config, scaling, out, probed, types if mixed else [])
    return out


def _check_changes(config, scaling, planned, probed, types: list) -> None:
    """Refuse a patch that would change nothing: an attention method none of whose layers takes its position
    rules (every RoPE layer local, every other layer NoPE: Cohere 2, EXAONE 4, Llama 4, AFMoE), or log-n with
    no layer to scale. A patch that changes some layers and leaves others (SmolLM3's NoPE layers, Gemma 3's
    local ones) is accepted."""
    if scaling.rules() is None and (not scaling.logn or any(plan.logn for _, plan in planned)):
        return
    if scaling.rules() is not None and any(plan.rules is not None for _, plan in planned):
        return
    local: dict[str, int] = {}
    nope = rope = 0
    for module, _ in planned:
        idx, kind = getattr(module, "layer_idx", None), probed[module].kind
        layer_type = types[idx] if isinstance(idx, int) and idx < len(types) else None
        if layer_type in LOCAL_LAYER_TYPES:
            local[layer_type] = local.get(layer_type, 0) + 1
            rope += kind == "rope"
        else:
            nope += 1
    parts = []
    if local:
        which = "RoPE" if rope == sum(local.values()) else "local"
        reach = " and ".join(f"{_reach(config, lt)} ({_count(n, lt + ' layer')})" for lt, n in local.items())
        parts.append(f"its {which} layers attend {reach}")
    if nope:
        layers = _count(nope, "global layer" if local else "attention layer")
        parts.append(f"its {layers} {'has' if nope == 1 else 'have'} no RoPE")
    layers = " and ".join(parts)
    if scaling.rules() is None:
        raise _refuse(config, scaling, f"{layers}: log-n has no layer to scale")
    alone = " (alone: patch(model, 'linear', factor=1, logn=True))" if nope else ""
    logn = f"; log-n scales the NoPE layers{alone}" if nope else ""
    raise _refuse(config, scaling, f"{layers}: {scaling.method.name} has nothing to change{logn}")


def _reach(config, layer_type: str) -> str:
    """How far a local layer type attends, in words."""
    chunk = getattr(config, "attention_chunk_size", None)
    if layer_type == "chunked_attention" and chunk:
        return f"within {chunk}-token chunks"
    window = getattr(config, "sliding_window", None)
    return f"within a {window}-token window" if window else "locally"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


PROBE_HOOK = "_rope_extend_probe_hook"


def install(model: nn.Module, config, planned, scaling=None, rotary=()) -> None:
    """Give every planned module its plan and point the config at ``NAME``. Plans of a model that was on the
    meta device are completed by a probe at its first forward (which raises if the model is refused)."""
    config = text_config(config)
    if not is_registered_name(config._attn_implementation):
        config._rope_extend_inner = config._attn_implementation
    decoder = rope_layout.decoder_of(model)
    watch = slots.install(decoder)
    for module, plan in planned:
        plan.watch = watch
        module.__dict__[PLAN_ATTR] = plan
    mrope.install(model, config, scaling, list(rotary))
    mrope.attach(model, [module for module, _ in planned])
    name = config._attn_implementation = registered_name(config._rope_extend_inner)
    pending = any(plan.active and plan.layout is None for _, plan in planned)
    _keep_positions(decoder, planned)
    if pending and PROBE_HOOK not in decoder.__dict__:
        inner = config._rope_extend_inner
        for module in decoder.modules():  # an inner model's own (its post_init ran first: Llama 4's text model)
            earlier = module.__dict__.pop(PROBE_HOOK, None)  # is superseded: its probe would run inside this one's
            if earlier is not None:
                earlier.remove()

        def complete(_module, _args, kwargs):
            decoder.__dict__.pop(PROBE_HOOK).remove()
            config._attn_implementation = inner
            try:
                with naming(config, scaling.method.name):
                    probed = rope_layout.probe(model, config, list(rotary), scaling.pretraining_length)
                    final = _plan_modules(model, config, scaling, inner, probed)
            finally:
                config._attn_implementation = name
            for module, plan in final:
                plan.watch = watch
                module.__dict__[PLAN_ATTR] = plan
            mrope.attach(model, [module for module, _ in final])
            _keep_positions(decoder, final)
            keeper = decoder.__dict__.get(POSITIONS_HOOK)
            if keeper is not None:  # this forward's own position ids: its pre-hooks ran before this one's probe
                keeper[0](decoder, _args, kwargs)

        decoder.__dict__[PROBE_HOOK] = decoder.register_forward_pre_hook(complete, with_kwargs=True)


POSITIONS_HOOK = "_rope_extend_positions_hook"


class PositionKeeper:
    """The decoder's forward pre-hook that keeps the position ids of the forward under way, per thread, for
    the methods and log-n on layers whose attention function is not given them (Llama 4's decoder layers keep
    ``position_ids`` to themselves). The ids the decoder was called with (``generate`` gives left-padded rows their true
    positions); without them, what the decoder computes itself: ``cache_position``, else the cache's length
    onwards."""

    def __init__(self):
        self.local = threading.local()

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("position_ids")
        if ids is None:
            tokens = kwargs.get("input_ids", args[0] if args else None)
            tokens = tokens if tokens is not None else kwargs.get("inputs_embeds")
            ids = kwargs.get("cache_position")
            if ids is None and tokens is not None:
                cache = rope_layout.cache_argument(kwargs)
                past = int(cache.get_seq_length()) if cache is not None else 0
                ids = torch.arange(past, past + tokens.shape[1], device=tokens.device)
        self.local.ids = ids

    def of(self, query: torch.Tensor) -> torch.Tensor | None:
        """``[b, n]`` position ids of ``query``'s rows, or None when the forward under way gave none that fit."""
        ids = getattr(self.local, "ids", None)
        b, n = query.shape[0], query.shape[2]
        if ids is None or ids.dim() > 2 or ids.shape[-1] != n or (ids.dim() == 2 and ids.shape[0] not in (1, b)):
            return None
        return ids.reshape(-1, n).expand(b, -1)


def _keep_positions(decoder: nn.Module, planned) -> None:
    """Give the plans that need it (``keep_positions``) the decoder's ``PositionKeeper``, registered once."""
    wanting = [plan for _, plan in planned if plan.keep_positions]
    if not wanting:
        return
    if POSITIONS_HOOK not in decoder.__dict__:
        keeper = PositionKeeper()
        decoder.__dict__[POSITIONS_HOOK] = (keeper, decoder.register_forward_pre_hook(keeper, with_kwargs=True))
    for plan in wanting:
        plan.positions = decoder.__dict__[POSITIONS_HOOK][0]


def kernel(model: nn.Module, config, inner: str, modules) -> str:
    """What runs the patched layers' attention now: ``cpu_flash`` (aten's CPU flash attention with its
    log-sum-exp) for the method's passes on the CPU, ``torch_tiles`` (plain torch over key tiles) with logit
    softcapping or on another device; then the implementation the other layers keep (local layers; log-n alone
    scales the queries and keeps it), when there are any. For inference: a forward under autograd (training
    through the method) takes ``torch_tiles`` for its passes (``passes_kernel``)."""
    config = text_config(config)
    param = next(model.parameters(), None)
    device = param.device.type if param is not None else "cpu"
    passes = passes_kernel(device, getattr(config, "attn_logit_softcapping", None) is not None)

    def passes_run(module) -> bool:  # log-n alone scales the queries and keeps the model's implementation
        plan = module.__dict__.get(PLAN_ATTR)
        return plan is not None and plan.rules is not None

    every = list(dict.fromkeys([*modules, *attention_modules(model, config)]))
    ran = sum(map(passes_run, every))
    if not ran:
        return inner
    return passes if ran == len(every) else f"{passes}; other layers: {inner}"


def remove(model: nn.Module, config, inner: str, modules) -> None:
    config = text_config(config)
    for module in modules:
        plan = module.__dict__.pop(PLAN_ATTR, None)
        if plan is not None and plan.layout is not None:  # its frequency set's cos/sin tables and work space
            plan.layout.rotary.__dict__.pop(rope_layout.TABLES_ATTR, None)
            plan.layout.rotary.__dict__.pop(WORKSPACE_ATTR, None)
    decoder = rope_layout.decoder_of(model)
    hook = decoder.__dict__.pop(PROBE_HOOK, None)
    if hook is not None:
        hook.remove()
    slots.remove(decoder)
    keeper = decoder.__dict__.pop(POSITIONS_HOOK, None)
    if keeper is not None:
        keeper[1].remove()
    mrope.remove(model, modules)
    config._attn_implementation = inner
    config.__dict__.pop("_rope_extend_inner", None)


# ------------------------------------------------------------------------------------------ the function
def _inner(module: nn.Module, name: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name != "eager":
        return ALL_ATTENTION_FUNCTIONS[name]
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
    # on an M-RoPE model the positions its rotary turned the tokens by (``hf.mrope``), else the layer's
    position_ids = mrope.positions(module, kwargs.get("position_ids"), query.shape[2])
    if plan is None or plan.rules is None:
        if inner == "flex_attention" and plan is not None:
            _check_flex(plan, module)
        if plan is not None and plan.logn:
            query = _logn(query, _query_positions(position_ids, module, query, key, plan), plan)
        if inner == "eager":  # the SDPA mask leaves a plain causal mask out (None); eager needs it
            if attention_mask is None and getattr(module, "is_causal", True):
                rows = _query_slots(plan, module, query, key)[:, None]
                attention_mask = (torch.arange(key.shape[2], device=query.device)[None, :] <= rows)[None, None]
            attention_mask = _additive(attention_mask, query.dtype)
        extra = {"softcap": softcap} if softcap is not None else {}
        return _inner(module, inner)(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **extra, **kwargs
        )
    if position_ids is not kwargs.get("position_ids"):
        kwargs = {**kwargs, "position_ids": position_ids}
    return plan.runner(module, plan, query, key, value, attention_mask, dropout, scaling, softcap, kwargs)


def _method_attention(module, plan, query, key, value, attention_mask, dropout, scaling, softcap, kwargs):
    """A layer with a method's rules. Keys past the newest query's (a static cache's empty slots) are cut off
    first, so that the key in the last slot is the newest (``hf.slots``)."""
    if dropout and module.training:
        raise UnsupportedModelError(f"{NAME} attention has no dropout; call model.eval() or set attention_dropout=0")
    if scaling is None:
        scaling = module.head_dim**-0.5
    end = slots.filled(plan.watch, module, key)
    if end is not None:
        end = int(end)  # one host sync: a static layer's length is a tensor
    # on the mask as the layers share it (before the cut below makes a copy per layer): checked once per forward
    filled = key.shape[2] if end is None else end
    noncausal = causality.check(module, attention_mask, query.shape[2], filled, kwargs.get("is_causal"))
    if end is not None:
        key, value = key[:, :, :end], value[:, :, :end]
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
    sinks = kwargs.get("s_aux")  # GPT-OSS, Granite-SWA: one more logit per head, with value 0
    mask = Mask.of(attention_mask, query, key, plan.inner, kwargs.get("sliding_window"))
    position_ids = kwargs.get("position_ids")
    if position_ids is None and plan.positions is not None:  # the decoder's (``PositionKeeper``): left padding
        position_ids = plan.positions.of(query)
    out = _attend(module, plan, query, key, value, mask, scaling, softcap, position_ids, sinks)
    return out, None


def _check_flex(plan: AttentionPlan, module) -> None:
    """Refuse a layer that keeps transformers' FlexAttention over a full static cache layer: the ``BlockMask``
    transformers builds evaluates its causal rule inside the kernel with the cache's length as a tensor, which the
    layer's own cache update has already advanced, so every query also sees the empty slots after it (decode steps
    off by about 1e-2 on a tiny Llama, with or without rope-extend). The method's own layers are exact there: they
    cut the keys at the newest one first."""
    if slots.static_full(plan.watch, module):
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


def _query_slots(plan: AttentionPlan | None, module, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The key slots of the query rows ``[n]``: the last ``n`` of the keys, or of a static layer's filled slots
    (a tensor offset: no host sync, so that torch.compile keeps it in the graph)."""
    n, m = query.shape[2], key.shape[2]
    end = slots.filled(plan.watch if plan is not None else None, module, key)
    return torch.arange(n, device=query.device) + ((m if end is None else end) - n)


class Mask:
    """The mask a method layer honours, as booleans (True: attend) over query rows ``0 .. n-1`` and key slots
    ``0 .. m-1``, whatever implementation built it:

    - ``dense``: the SDPA / eager 4D mask, sliced;
    - ``padding``: FlashAttention's padding mask ``[b, m]`` (None without padding), with the layer's
      ``sliding_window``, which FlashAttention's kernel applies itself;
    - ``flex``: FlexAttention's ``BlockMask``, whose ``mask_mod`` is evaluated on the indices of each block
      (transformers' mask functions are index-based and broadcast).

    ``block`` gives ``[b, 1|h, rows, cols]``, or None when it allows every pair."""

    def __init__(self, kind: str, data, n: int, m: int, device, window: int | None = None, index=None):
        self.kind, self.data, self.n, self.m, self.device = kind, data, n, m, device
        self.window, self.index = window, index

    @classmethod
    def of(cls, attention_mask, query: torch.Tensor, key: torch.Tensor, inner: str, window=None) -> Mask | None:
        n, m, device = query.shape[2], key.shape[2], query.device
        if inner == "flex_attention":
            return cls("flex", attention_mask, n, m, device) if attention_mask is not None else None
        if inner.startswith("flash"):
            if attention_mask is None and not window:
                return None
            if attention_mask is not None and attention_mask.shape[-1] != m:
                raise UnsupportedModelError(
                    f"{NAME} attention got a FlashAttention padding mask of {attention_mask.shape[-1]} keys for "
                    f"{m} keys, so it cannot tell which keys it masks; use a DynamicCache"
                )
            pad = None if attention_mask is None else attention_mask.bool()
            return cls("padding", pad, n, m, device, window)
        return cls("dense", _allowed(attention_mask), n, m, device) if attention_mask is not None else None

    def rows(self, index: torch.Tensor | None) -> Mask:
        """The mask of the batch rows ``index`` (None: all)."""
        if index is None:
            return self
        return Mask(self.kind, self.data, self.n, self.m, self.device, self.window, index)

    def _take(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.index is None or t.shape[0] == 1 else t.index_select(0, self.index)

    def block(self, rows: slice, cols: slice) -> torch.Tensor | None:
        if self.kind == "dense":
            return self._take(self.data)[:, :, rows, cols]
        r = torch.arange(rows.start, rows.stop, device=self.device)[None, None, :, None]
        c = torch.arange(cols.start, cols.stop, device=self.device)[None, None, None, :]
        if self.kind == "flex":
            batch = self.index
            if batch is None:
                batch = torch.arange(self.data.kv_indices.shape[0], device=self.device)
            head = torch.zeros((), dtype=torch.long, device=self.device)
            allow = self.data.mask_mod(batch[:, None, None, None], head, r, c)
            allow = allow.expand(batch.shape[0], 1, r.shape[2], c.shape[3])
        else:
            allow = None
            if self.data is not None:
                pad = self._take(self.data)[:, None, None, cols]
                allow = pad.expand(pad.shape[0], 1, r.shape[2], pad.shape[-1])
            if self.window:  # row r is at slot m - n + r; FlashAttention keeps keys less than the window behind
                inside = (self.m - self.n + r) - c < self.window
                allow = inside if allow is None else allow & inside
        return None if bool(allow.all()) else allow


def _query_positions(position_ids, module, query, key, plan: AttentionPlan | None = None) -> torch.Tensor:
    """``[b, n]`` positions of the query rows: the layer's ``position_ids``, else the decoder's (``PositionKeeper``),
    else the query rows' key slots (``_query_slots``: the last ``n`` keys, or a static layer's filled slots)."""
    if position_ids is not None:
        return position_ids.expand(query.shape[0], -1)
    kept = plan.positions.of(query) if plan is not None and plan.positions is not None else None
    if kept is not None:
        return kept
    return _query_slots(plan, module, query, key)[None].expand(query.shape[0], -1)


def _logn(query: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    scale = logn_scale(positions, plan.original_max_position_embeddings)  # [b, n]
    return (query.float() * scale[:, None, :, None]).to(query.dtype)


def _attend(module, plan, query, key, value, mask, scaling, softcap, position_ids, sinks=None) -> torch.Tensor:
    b, h, n, _ = query.shape
    m = key.shape[2]
    last = [m - 1] * b
    if position_ids is not None:
        pos = position_ids.expand(b, -1)
        if n == 1:
            last = pos[:, -1].tolist()  # one host sync per layer
        else:  # the query rows whose position id is not where consecutive positions put them
            off = pos != pos[:, -1:] - torch.arange(n - 1, -1, -1, device=pos.device)
            *last, any_off = torch.cat([pos[:, -1], off.any()[None]]).tolist()  # still one sync
            if any_off:
                _check_positions(off, mask, n, m)
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
            mask.rows(index) if mask is not None else None,
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


def _check_positions(off: torch.Tensor, mask: Mask | None, n: int, m: int) -> None:
    """Refuse position ids the positions rule above would get wrong, before anything is computed.

    The rows ``off`` (``[b, n]``) have a position id other than their consecutive one. That is exact only where
    they are padding: each such row sees no key, and no row sees its key (slot ``m - n + t``), so neither its
    output nor its position reaches a real token. Left padding masked by ``attention_mask`` passes (its ids are
    0 or 1, whatever the caller filled in); packed documents (ids restarting inside a row), PoSE's jumps and
    right padding with cumulative ids do not. Costs a pass over the mask's rows and columns of the off rows, and
    runs only when some row is off."""
    rows_off = off.any(0).nonzero().flatten().tolist()
    r0, r1 = rows_off[0], rows_off[-1] + 1

    def seen(rows: slice, cols: slice) -> torch.Tensor:  # [b | 1, rows, cols]: mask and causality by slot
        r = torch.arange(rows.start, rows.stop, device=off.device)[:, None]
        c = torch.arange(cols.start, cols.stop, device=off.device)[None, :]
        allow = (c <= m - n + r)[None, None]
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
    small = n <= REUSE_ROWS  # a decode step (or a few rows)
    # keys moved by a constant per run (Dual Chunk's chunks): a few queries turn once per run, no key turns
    by_query = small and rules.run_length is not None
    # autograd keeps what the passes read for the backward: then no rotated keys in reused memory
    reuse = small and not _autograd(query, key, value)
    rotated = _rotated_keys(rules, layout, keys, kpos, compute, reuse, by_query)
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
            turn = None  # how far the queries turn: None for a kind at true positions for both
            if rules.key_group(kind) is not None:
                turn = (rules.query_position(kind, i) - i).to(torch.float64)
            runs = _key_runs(rules, kind, j0, j1) if by_query and rules.moves_keys(kind) else [(j0, j1, 0)]
            for r0, r1, shift in runs:  # keys r0 .. r1-1 moved by ``shift`` (0: not moved, or already turned)
                qk = q if turn is None and not shift else layout.rotate(q, (0 if turn is None else turn) - shift)
                cols = slice(r0 - first, r1 - first)
                allow = None
                if not full:
                    j = kpos[cols]
                    allow = (rules.region(kind, i[:, None], j[None, :]) & (j[None, :] <= i[:, None]))[None, None]
                given = mask.block(rows, slice(r0 - k0, r1 - k0)) if mask is not None else None
                if given is not None:
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


def _key_runs(rules, kind: str, j0: int, j1: int) -> list[tuple[int, int, int]]:
    """The keys ``j0 .. j1-1`` cut at multiples of ``rules.run_length``, each run with the constant
    ``key_position(j) - j`` of its keys: ``(first, last + 1, shift)``."""
    s, out = rules.run_length, []
    while j0 < j1:
        end = min(j1, (j0 // s + 1) * s)
        out.append((j0, end, int(rules.key_position(kind, torch.tensor([j0]))[0]) - j0))
        j0 = end
    return out


def _rotated_keys(rules, layout, keys, kpos, compute, reuse: bool = False, by_query: bool = False) -> dict:
    """``{pass kind: the keys rotated to that pass's key positions}``, in ``compute``: every key once per key
    group, so O(m) memory per group. A kind that keeps its keys at their true positions (no key group, STRING's
    far keys), or every kind with ``by_query`` (its queries turn per run of keys instead), gets them unturned."""
    rotated, groups, plain = {}, {}, None
    for kind in rules.kinds:
        group = rules.key_group(kind)
        if by_query or not rules.moves_keys(kind):
            plain = rotated[kind] = plain if plain is not None else keys.to(compute)
        elif group in groups:
            rotated[kind] = groups[group]
        else:
            delta = rules.key_position(kind, kpos) - kpos
            rotated[kind] = groups[group] = _rotate(layout, keys, delta, compute, group if reuse else None)
    return rotated


def _rotate(layout, keys, delta, compute, group: str | None) -> torch.Tensor:
    """``layout.rotate`` in float32, ``ROTATE`` keys at a time, written into a tensor of dtype ``compute`` (no
    float32 copy of all the keys), with cos and sin from ``layout.cos_sin`` (the same values ``rotate`` computes).

    With a ``group`` (a decode step, no autograd saving the result) the keys are written into that group's work
    space, kept on the rotary module for the next layer and step (``_workspace``), and cos and sin of whole
    positions come from the shared table, so a step computes no angles and touches no fresh memory. With None
    (prefill, where O(n^2) attention dwarfs both; or autograd) nothing is kept: fresh memory, angles computed, so
    a long prefill's peak holds no table or work space of its length."""
    cos, sin = layout.cos_sin(delta, torch.float32, table=group is not None)
    if group is None:  # prefill or autograd (out= writes are not differentiable either)
        out = torch.empty(keys.shape, dtype=compute, device=keys.device)
        for c in range(0, keys.shape[2], ROTATE):
            piece = slice(c, c + ROTATE)
            out[:, :, piece] = layout.apply(keys[:, :, piece].float(), cos[piece], sin[piece]).to(compute)
        return out
    out = _workspace(layout.rotary, group, keys.shape, compute, keys.device)
    b, h, m, _ = keys.shape
    scratch = _workspace(layout.rotary, None, (2, b, h, min(m, ROTATE), layout.dim // 2), torch.float32, keys.device)
    for c in range(0, m, ROTATE):
        piece = slice(c, c + ROTATE)
        part = scratch[:, :, :, : min(m - c, ROTATE)]
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
    return space[:numel].view(shape)


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


def passes_kernel(device_type: str, softcap: bool, autograd: bool = False) -> str:
    """The kernel the method's passes run on: ``cpu_flash`` on the CPU without logit softcapping, else
    ``torch_tiles``; ``_partial`` dispatches by it and ``kernel`` reports it. Under autograd (training through
    an attention method) always ``torch_tiles``: the passes are merged by their log-sum-exp, and aten's flash
    kernels give no gradient through it, so their gradients would be silently wrong."""
    return "cpu_flash" if device_type == "cpu" and not softcap and not autograd else "torch_tiles"


def _autograd(*tensors: torch.Tensor) -> bool:
    """Whether autograd records operations on these tensors."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _partial_padded(q, k, v, allow, scaling: float, softcap: float | None):
    if passes_kernel(q.device.type, softcap is not None, _autograd(q, k, v)) == "cpu_flash":
        return _partial_cpu(q, k, v, allow, scaling)
    return _partial_torch(q, k, v, allow, scaling, softcap)


def _partial_cpu(q, k, v, allow, scaling: float):
    """The CPU flash kernel. A masked pass is cut where its mask allows: a causal square at its end (the diagonal
    block) runs with the kernel's own causal skipping, and so does the mirror square at its start (row ``t`` sees
    columns ``t ..``, the start of a band: rows and columns reversed make it causal); the columns every row sees
    run with no mask, and only the rest with an additive mask (a band pass then costs about its allowed area)."""
    if allow is None or allow.shape[-1] < 2 * SPLIT:
        return _flash_cpu(q, k, v, allow, scaling)
    rows, start, end = allow.shape[-2], 0, allow.shape[-1]
    squares = rows >= SPLIT  # a few rows (a decode step) take the columns they all see in one call
    pieces = []  # (first column, last + 1, mask or None, causal, mirrored)
    if squares and end >= rows and bool((allow[..., end - rows :] == _tril(rows)).all()):  # every batch row, head
        pieces.append((end - rows, end, None, True, False))
        end -= rows
    if squares and end >= rows and bool((allow[..., :rows] == _tril(rows).T).all()):
        pieces.append((0, rows, None, True, True))
        start = rows
    if end > start:
        seen = allow[..., start:end].all(dim=-2).reshape(-1, end - start).all(0)  # columns every row sees
        cols = (seen.nonzero().flatten() + start).tolist()  # one host sync, on the CPU
        masked = [(start, end)]
        if len(cols) >= SPLIT and cols[-1] - cols[0] + 1 == len(cols):
            pieces.append((cols[0], cols[-1] + 1, None, False, False))
            masked = [(start, cols[0]), (cols[-1] + 1, end)]
        pieces += [(c0, c1, allow[..., c0:c1], False, False) for c0, c1 in masked if c1 > c0]
    acc = lse = None
    for c0, c1, mask, causal, mirrored in pieces:
        if mirrored:
            out, out_lse = _flash_cpu(q.flip(2), k[:, :, c0:c1].flip(2), v[:, :, c0:c1].flip(2), None, scaling, True)
            out, out_lse = out.flip(2), out_lse.flip(2)
        else:
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
