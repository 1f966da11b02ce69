"""Keys in the KV cache kept consistent when dynamic frequencies change.

Dynamic methods (``dynamic``, ``dynamic_yarn``, ``longrope``) change the rotary frequencies as the sequence
grows, but the keys already in a KV cache were rotated with the frequencies of an earlier length: cached
and uncached generation disagree (transformers issue 25104). RoPE rotations compose, so a cached key at
position ``p`` is brought to new frequencies by one more rotation by ``p (theta' - theta)`` (and scaled by
``m' / m`` when the attention scale changes with them).

Design: ``CacheKeeper`` is a forward pre-hook on the decoder (``hf.layout.decoder_of``: the module that runs the
layers on ids and receives ``cache``, ``past_key_values`` before transformers 5.24). Before each forward it works
out the longest position of the sequence, advances the dynamic frequency sets (``RotaryRuntime.advance``) and,
when a set's frequencies change, turns every cached key of the layers that use it by the angle differences
``p (theta' - theta)`` with ``hf.rotate_keys`` (the key rotator it shares with the attention sinks: float64
angles, float32 keys, each layer's own convention as ``hf.layout.probe`` measured it on the model: pairing, which
dimensions, direction; NoPE layers are left alone; a layer it cannot reproduce is refused), so the result is what
the uncached forward computes, up to float32 rounding. The probe runs once, when cached keys first need turning
(the frequency lengths in use are put back after it). Frequencies change only on a grid of lengths (``rotary.bucket``: about
23 times between ``L`` and ``4L``), which bounds both the work and the rounding that repeated in-place
rotations accumulate.

Batches: one length per batch, the longest position of any row (per-batch semantics): every row of a
batch uses the same frequencies, as a batched uncached forward does. The positions of the cached slots are
the position ids the keeper saw when they were added (left padding included).

Caches: transformers' ``DynamicCache`` (full and sliding-window layers) and ``StaticCache`` full layers.
Others (quantized, static sliding-window, offloaded-indexed layers) cannot be re-rotated and are refused
with an error naming the layer class, before anything is computed. Hybrid models (Qwen3-Next, Qwen3.5, LFM2,
Bamba, Granite 4.0-H, Falcon-H1, OLMo hybrid) cache a recurrent or convolution state for their linear-attention,
Mamba and convolution layers: a state holds no rotated key, so only the attention layers' keys are turned and
the states are left as they are. That is exact (the frozen reference's semantics: a token's hidden states are
those of the forward that fed it, so are the states built from them) where no position reaches the states:
the probe checks that nothing outside the attention layers reads positions (``hf.rotary_reads``), and a model
where something does is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UnsupportedModelError
from . import compiled, families, mrope
from . import layout as rope_layout
from .reading import family, nested_layer_types, text_config
from .rotary import RotaryRuntime, frequency_buffer, next_seen, scale_name
from .rotate_keys import KeyRotator, turn_layer


def _model_defined(layer) -> bool:
    """A model's own cache layer (DeepSeek-V4's compressor caches, MiniMax-M3's indexer keys, Unlimited-OCR's
    reference window): a subclass that keeps more than the keys it is given, often keys rotated by other rotary
    modules at other positions, which rope-extend cannot turn."""
    from transformers import cache_utils as cu

    return type(layer).__module__ != cu.__name__


def _state_only(layer) -> bool:
    """A cache layer that holds a recurrent or convolution state and no keys (transformers'
    ``LinearAttentionLayer``: linear attention, Mamba and short-convolution layers of hybrid models); a hybrid
    layer that holds keys beside its state (Falcon-H1's) is a ``DynamicLayer`` or ``StaticLayer`` too."""
    from transformers import cache_utils as cu

    mixin = getattr(cu, "LinearAttentionCacheLayerMixin", None)
    return mixin is not None and isinstance(layer, mixin) and not isinstance(layer, cu.CacheLayerMixin)


def _holds_state(layer, named: bool) -> bool:
    """A cache layer with a recurrent or convolution state: ``named`` so by the config (``state_layers``), or
    holding one already."""
    from transformers import cache_utils as cu

    mixin = getattr(cu, "LinearAttentionCacheLayerMixin", None)
    if mixin is None or not isinstance(layer, mixin):
        return False
    started = (
        getattr(layer, name, None) or {} for name in ("is_conv_states_initialized", "is_recurrent_states_initialized")
    )
    return named or any(any(flags.values()) for flags in started)


def _supported(layer) -> bool:
    return _supported_class(type(layer))


def _supported_class(cls: type) -> bool:
    """Whether the keeper can turn the keys of a cache layer of class ``cls``."""
    from transformers import cache_utils as cu

    sliding_static = getattr(cu, "StaticSlidingWindowLayer", None)
    kinds = tuple(k for k in (getattr(cu, "DynamicLayer", None), getattr(cu, "StaticLayer", None)) if k)
    unsupported = tuple(getattr(cu, n) for n in ("BaseQuantizedLayer", "QuantizedLayer") if hasattr(cu, n))
    if sliding_static is not None and issubclass(cls, sliding_static):
        return False
    if unsupported and issubclass(cls, unsupported):
        return False
    return issubclass(cls, kinds) and "Indexed" not in cls.__name__


def _alternatives(cache, layer_type) -> list[str]:
    """transformers' caches whose layer for ``layer_type`` (the config's type of the refused layer; None: full
    attention) the keeper could turn, other than the class of ``cache``: never advise the cache it was given (a
    StaticCache's sliding layers cannot turn, a DynamicCache's indexed layers neither)."""
    from transformers import cache_utils as cu

    out = []
    for name, mapping, words in (
        ("DynamicCache", "DYNAMIC_LAYER_TYPE_MAPPING", "a DynamicCache (generate's default)"),
        ("StaticCache", "STATIC_LAYER_TYPE_MAPPING", "a StaticCache"),
    ):
        layer = getattr(cu, mapping, {}).get(layer_type or "full_attention")
        if type(cache).__name__ != name and isinstance(layer, type) and _supported_class(layer):
            out.append(words)
    return out


class CacheKeeper:
    """The decoder's forward pre-hook (see the module docstring)."""

    def __init__(self, modules: list[nn.Module], config, model: nn.Module):
        self.modules = modules  # rotary modules; their runtime is looked up at each call (a patch replaces it)
        self.config = config = text_config(config)
        self.model = model
        nested = nested_layer_types(config)
        # which frequency set each decoder layer's keys were rotated with
        self.layer_sets = list(config.layer_types) if nested else None
        self.history: torch.Tensor | None = None  # position ids of the cached slots, [batch, slots]
        self.mixed = False  # whether they hold M-RoPE tokens with distinct positions per axis (images, video)
        self.rotator = KeyRotator(model, config, modules)  # how each layer rotates its cached keys, probed once
        self.turnable: set = set()  # frequency sets whose cached keys ``_check_turnable`` found turnable

    def _probe(self, device) -> None:
        """Find each layer's rotation once (``KeyRotator.probe``, lenient: a model that cannot be probed is refused
        only when its keys need turning), leaving the runtimes' lengths as they were before the probe's forward."""
        if self.rotator.layouts is not None:
            return
        runtimes = [r for r in (m.__dict__.get("forward") for m in self.modules) if isinstance(r, RotaryRuntime)]
        saved = [(r, lt, e.seen) for r in runtimes for lt, e in r.entries.items()]
        length = next(e.scaling.pretraining_length for r in runtimes for e in r.entries.values())
        try:
            self.rotator.probe(length, lenient=True)
        finally:
            for runtime, layer_type, seen in saved:
                if runtime.entries[layer_type].seen != seen:
                    runtime.advance(layer_type, seen, device)

    def _refusal(self, name: str):
        """The refusal ``KeyRotator`` raises when the keys of a layer cannot be turned, for method ``name``."""
        family_name = family(self.model.config)
        return lambda why: (
            f"{name} on {family_name} must re-rotate cached keys when its frequencies change, and {why}; use a "
            "static method (yarn, ntk, linear) or generate without the cache (use_cache=False)"
        )

    def _check_turnable(self, cache, layer_type, name: str, device) -> None:
        """Before a forward with ``cache`` runs: refuse when some layer's cached keys of ``layer_type`` could not be
        turned later (probed once, with a cache: ``hf.layout.probe(cached=True)``), rather than when the
        frequencies first change, after forwards have run. The answer depends on the probe alone: found once per
        frequency set."""
        if layer_type in self.turnable:
            return
        self._probe(device)
        self.rotator.check(self._refusal(name), lambda index: self._set_of(index) == layer_type)
        self.turnable.add(layer_type)

    def _check_states(self, cache, name: str) -> None:
        """Refuse a cache whose recurrent or convolution states (a hybrid's linear-attention, Mamba and
        convolution layers) might carry positions: they are left as they are when the keys turn, which is exact
        only where nothing outside the attention layers reads positions (``KeyRotator.outside``, from the probe
        ``_check_turnable`` ran)."""
        kinds = families.ask("state_layers", self.config) or {}
        # a state layer by the config's layer types, or one that holds a state (not 5.17's empty placeholders)
        held = [i for i, layer in enumerate(getattr(cache, "layers", [])) if _holds_state(layer, i in kinds)]
        if not held or self.rotator.outside is False:
            return
        state = families.recurrent.describe({i: kinds.get(i, "recurrent") for i in held})
        why = (
            "something outside its attention layers reads positions (the probe's rows differ at the decoder's "
            "output), so those states may hold them"
            if self.rotator.outside
            else "the probe could not run the decoder to see that no position reaches them"
        )
        raise UnsupportedModelError(
            f"{name} on {family(self.model.config)} must re-rotate cached keys when its frequencies change, and its "
            f"{state} cache a recurrent or convolution state, which cannot be turned; {why}; use a static method "
            "(yarn, ntk, linear), or generate without the cache (use_cache=False)"
        )

    def _set_of(self, index: int):
        """The frequency set decoder layer ``index`` rotates with (None: the model has one)."""
        return self.layer_sets[index] if self.layer_sets is not None and index < len(self.layer_sets) else None

    @compiled.run_eagerly(
        "rope-extend's dynamic methods (dynamic, dynamic_yarn, longrope) read the sequence length on the host before "
        "each forward to re-rotate the cached keys when their frequencies change, so torch.compile runs this hook "
        "outside the graph; compile with fullgraph=False (the default, and generate's)"
    )
    def __call__(self, module, args, kwargs):
        if self.rotator.probing:  # the probe's own forward
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        tokens = ids if ids is not None else embeds
        if tokens is None:
            return
        batch, n = tokens.shape[0], tokens.shape[1]
        cache = rope_layout.cache_argument(kwargs)
        past = int(cache.get_seq_length()) if cache is not None else 0
        positions = kwargs.get("position_ids")
        if positions is None:
            cache_position = kwargs.get("cache_position")
            if cache_position is None:
                cache_position = torch.arange(past, past + n, device=tokens.device)
            positions = cache_position.view(1, -1)
        axes = mrope.axes(positions, self.config) if positions.dim() == 3 else positions[None]
        positions = axes[0].expand(batch, -1)  # an M-RoPE text token is at one position on every axis
        low, high, mixed = (int(v) for v in torch.stack([axes.min(), axes.max(), (axes != axes[:1]).any()]).tolist())
        cached = self._cached_positions(cache, past, batch, kwargs.get("attention_mask"), positions.device)
        runtimes = [m.__dict__.get("forward") for m in self.modules]
        for runtime in (r for r in runtimes if isinstance(r, RotaryRuntime)):
            for layer_type, entry in runtime.entries.items():
                if not entry.dynamic:
                    continue
                name = entry.scaling.method.name
                layers = self._layers(cache, layer_type, name)
                if cache is not None:
                    self._check_turnable(cache, layer_type, name, positions.device)
                    self._check_states(cache, name)
                if cache is not None and (mixed or (self.mixed and cached is not None and low != 0)):
                    raise UnsupportedModelError(
                        f"{entry.scaling.method.name} on {family(self.model.config)} must re-rotate cached keys when "
                        "its frequencies change, and image or video tokens, which the cache would hold, have distinct "
                        "M-RoPE positions per axis "
                        "(rope-extend turns each key by one position); use a static method (yarn, ntk, linear), or "
                        "generate without the cache (use_cache=False)"
                    )
                seen = next_seen(entry, low, high)
                runtime.ready.add(layer_type)
                if not layers or cached is None or entry.length(seen) == entry.length(entry.seen):
                    runtime.advance(layer_type, seen, positions.device)
                    continue
                # refuses before any change
                refuse = self._refusal(name)
                layouts = [(layer, self.rotator.layout(index, layer.keys.shape[-1], refuse)) for index, layer in layers]
                old = _frequencies(runtime, layer_type)
                scale_old = float(getattr(runtime.module, scale_name(layer_type)))
                runtime.advance(layer_type, seen, positions.device)
                # keys carry the attention scale m of their frequencies: turn by p (theta' - theta), times m'/m
                angles = cached.to(torch.float64)[:, None, :, None] * (_frequencies(runtime, layer_type) - old)
                ratio = float(getattr(runtime.module, scale_name(layer_type))) / scale_old
                for layer, layout in layouts:
                    if layout is not None:
                        turn_layer(layer, layout, angles, ratio)
        self.history = positions if cached is None or low == 0 else torch.cat([cached, positions], dim=1)
        self.mixed = bool(mixed) or (self.mixed and cached is not None and low != 0)
        return

    def _cached_positions(self, cache, past: int, batch: int, mask, device) -> torch.Tensor | None:
        """Position ids of the ``past`` cached slots: as recorded, else from the attention mask (the
        convention of ``generate``), else ``0 .. past-1``."""
        if cache is None or past == 0:
            return None
        history = self.history
        if history is not None and history.shape == (batch, past):
            return history.to(device)
        if mask is not None and mask.dim() == 2 and mask.shape[1] >= past:
            positions = mask[:, :past].long().cumsum(-1) - 1
            return positions.masked_fill(mask[:, :past] == 0, 1).to(device)
        return torch.arange(past, device=device).expand(batch, -1)

    def _layers(self, cache, layer_type, name: str) -> list:
        """``(index, cache layer)`` for the layers whose keys use the frequency set ``layer_type``; refuses ones
        that cannot be re-rotated."""
        if cache is None:
            return []
        found = []
        for layer in getattr(cache, "layers", []):  # whichever frequency set they belong to
            if _model_defined(layer):
                raise UnsupportedModelError(
                    f"{name} on {family(self.model.config)} must re-rotate cached keys when its frequencies change, "
                    f"and its cache layers ({type(layer).__name__}, from {type(layer).__module__}) keep state of "
                    "their own (such as compressed keys) that rope-extend cannot re-rotate; use a static method "
                    "(yarn, ntk, linear), or run without a cache (use_cache=False)"
                )
        for index, layer in enumerate(getattr(cache, "layers", [])):
            if self._set_of(index) != layer_type or _state_only(layer):  # a state holds no key (_check_states)
                continue
            if not _supported(layer):
                types = getattr(self.config, "layer_types", None) or []
                other = " or ".join(_alternatives(cache, types[index] if index < len(types) else None))
                instead = (
                    f"use {other}, or a static method (yarn, ntk, linear)"
                    if other
                    else "use a static method (yarn, ntk, linear), or generate without the cache (use_cache=False)"
                )
                raise UnsupportedModelError(
                    f"{name} on {family(self.model.config)} must re-rotate cached keys when its frequencies change, "
                    f"and cache layers of type {type(layer).__name__} cannot be re-rotated; {instead}"
                )
            if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
                found.append((index, layer))
        if not found and cache is not None and not hasattr(cache, "layers"):
            raise UnsupportedModelError(
                f"{type(cache).__name__} is not a transformers Cache with layers: rope-extend cannot keep its keys "
                "consistent with dynamic frequencies"
            )
        return found


def _frequencies(runtime: RotaryRuntime, layer_type) -> torch.Tensor:
    """The frequency set ``layer_type`` in use, float64."""
    return frequency_buffer(runtime.module, layer_type).to(torch.float64)


def install(model: nn.Module, runtime: RotaryRuntime, config):
    """Register a ``CacheKeeper`` for ``runtime`` on the model's decoder (``hf.layout.decoder_of``: the module that
    receives the ids and the cache, as ``SinkKeeper``'s), when it has dynamic sets and none is there yet; returns
    ``(decoder, hook key)`` or None."""
    if not any(entry.dynamic for entry in runtime.entries.values()):
        return None
    decoder = rope_layout.decoder_of(model)
    if keepers(decoder):
        return None
    handle = decoder.register_forward_pre_hook(CacheKeeper([runtime.module], config, model), with_kwargs=True)
    return decoder, handle.id


def remove(decoder: nn.Module, key) -> None:
    """Take the keeper ``install`` registered under ``key`` off ``decoder`` (``unpatch``)."""
    decoder._forward_pre_hooks.pop(key, None)
    decoder._forward_pre_hooks_with_kwargs.pop(key, None)


def keepers(decoder: nn.Module) -> list[CacheKeeper]:
    """The cache keepers registered on ``decoder`` (at most one: ``install`` adds none beside it)."""
    return [h for h in decoder._forward_pre_hooks.values() if isinstance(h, CacheKeeper)]
