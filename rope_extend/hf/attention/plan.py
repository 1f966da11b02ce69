"""Planning and refusal: what every attention module of a model does under a scaling, decided before anything
is touched.

Which layers change: a method's position rules apply to every layer that rotates and is not local (a sliding
window or chunks, by ``config.layer_types``, in a model that also has global layers); local layers never see a
distance beyond their window, and NoPE layers have no rotation to move. log-n scales the queries of every layer
that is not local, NoPE layers included (the log-length temperature they need at long context; Llama 4 ships
one, ``attn_temperature_tuning``, and log-n on top of it is refused: ``hf.families``' ``own_temperature``). A patch
that would change no layer is refused before anything is touched (``_check_changes``): an attention method on a
NoPE hybrid whose RoPE layers are all local (Cohere 2, EXAONE 4, Llama 4, AFMoE), with the layers named.

The layers' rotation is measured on the model (``hf.layout.probe``): pairing, which dimensions, which frequency
set. A layer rope-extend cannot reproduce, one that does not call transformers' attention interface, one that is
not causal, or one that passes arguments this attention does not implement is refused.
"""

from __future__ import annotations

from torch import nn

from ...errors import UnsupportedModelError
from .. import causal as causality
from .. import families
from .. import layout as rope_layout
from ..families.context import LOCAL_LAYER_TYPES
from ..names import INNER_ATTR
from ..reading import text_config
from .forward import _runner
from .registration import is_registered_name
from .state import INNER, AttentionPlan, attention_modules


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
    first forward.

    Args:
        model: the model to patch.
        config: its config (the text config is taken from a multimodal one).
        scaling: the scaling (``methods.Scaling``): the method, its rules, log-n, the lengths.
        rotary: the model's rotary modules.
        defer: plan without probing (a model built from a config, weights not loaded yet).

    Returns:
        ``(attention module, AttentionPlan)`` for every attention module, for ``install``.

    Raises:
        UnsupportedModelError: the model's implementation, a layer's rotation or its attention cannot be
            changed exactly, or the patch would change no layer.
    """
    config = text_config(config)
    inner = config._attn_implementation
    if is_registered_name(inner):
        inner = getattr(config, INNER_ATTR, "sdpa")
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
    """``plans`` once the implementation is known, from the probe's ``{module: LayerProbe}`` (None: unprobed)."""
    modules = _modules(model, config, scaling, probed)
    rules = scaling.rules()
    types = list(getattr(config, "layer_types", None) or ())
    mixed = bool(types) and not all(t in LOCAL_LAYER_TYPES for t in types)
    common = dict(
        inner=inner,
        original_max_position_embeddings=scaling.original_max_position_embeddings,
        method=scaling.method.name,
    )
    out = []
    for module in modules:
        idx = getattr(module, "layer_idx", None)
        layer_type = types[idx] if isinstance(idx, int) and idx < len(types) else None
        seen = probed.get(module) if probed is not None else None
        local = mixed and layer_type in LOCAL_LAYER_TYPES
        plan = _layer_plan(config, scaling, module, seen, local=local, rules=rules, common=common)
        # the methods and log-n read the query positions; a layer whose attention function is not given them gets
        # the decoder's (``PositionKeeper``)
        moved = plan.logn or plan.rules is not None
        plan.keep_positions = moved and seen is not None and "position_ids" not in seen.kwargs
        out.append((module, plan))
    if probed is not None:
        _check_changes(config, scaling, out, probed, types if mixed else [])
    return out


def _modules(model, config, scaling, probed) -> list[nn.Module]:
    """The attention modules to plan: the model's (``attention_modules``) and, probed, every module the probe saw
    call transformers' attention interface; refused when one of the model's does not call it, or none does."""
    modules = attention_modules(model, config)
    if probed is not None:
        if not probed:
            state = families.ask("state_layers", config)
            raise _refuse(
                config,
                scaling,
                "its attention layers do not call transformers' attention interface, so rope-extend cannot change them"
                if modules or not state
                else f"it has no attention layer to change (its {families.recurrent.describe(state)} keep a recurrent "
                "or convolution state)",
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
    return modules


def _layer_plan(config, scaling, module: nn.Module, seen, *, local: bool, rules, common: dict) -> AttentionPlan:
    """One layer's plan: a local layer unchanged; a NoPE layer (``seen.kind == "nope"``) with log-n only; any
    other layer with the method's rules and log-n, refused where its rotation, causality or attention arguments
    are ones rope-extend cannot reproduce. ``seen``: the probe's ``LayerProbe`` (None: unprobed)."""
    idx = getattr(module, "layer_idx", None)
    if local:
        return AttentionPlan(**common, rules=None, logn=False)
    if seen is not None and seen.kind == "nope":  # no position to change; log-n scales its queries
        if scaling.logn and families.ask("own_temperature", module):
            raise _refuse(config, scaling, families.ask("own_temperature", module))
        return AttentionPlan(**common, rules=None, logn=scaling.logn)
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
    return AttentionPlan(
        **common,
        rules=rules,
        logn=scaling.logn,
        layout=seen.layout if seen else None,
        runner=_runner(scaling.method.name) if rules is not None else None,
    )


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
