"""Attention sinks: a KV cache that keeps the first tokens and a recent window, for generation of unbounded length
at constant memory (Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks"; StreamingLLM).

    cache = rope_extend.SinkCache(model, sink_tokens=4, window=1020)
    model.generate(ids, cache=cache, max_new_tokens=100_000)  # past_key_values=cache before transformers 5.24

The cache holds at most ``sink_tokens + window`` tokens: the first ``sink_tokens`` of the sequence (the "sinks"
that softmax attention leans on) and the ``window`` most recent ones. Positions are assigned inside the cache,
as StreamingLLM does: the token in slot ``t`` is at position ``t``, so no relative position ever exceeds the
cache size, however long the generation runs.

How it is kept exact: ``SinkKeeper`` is a forward pre-hook on the decoder (the module that receives the cache,
as ``cache`` or ``past_key_values``: ``hf.cache_name``). Before a forward that would overflow the cache by ``e``
tokens, it drops the ``e`` oldest tokens after the sinks from every layer, turns the keys that remain after them
back by ``e`` positions (they move down ``e`` slots; RoPE rotations compose, so this is one more rotation by
``-e theta``, in each layer's own convention as ``hf.layout.probe`` measured it: pairing, which dimensions, which
frequency set; NoPE layers are left as they are), and gives the new tokens the positions that follow
(``cache_position`` and ``position_ids`` rewritten). The new tokens' queries and keys are then rotated by the
model itself at in-cache positions. For a one-layer model the logits of every step equal an uncached forward of the kept tokens at positions
``0 .. n-1``; in a deeper model the kept keys and values were computed when the dropped tokens were still
visible, which is StreamingLLM's design.

Counting: between forwards, ``get_seq_length()`` is the number of tokens the cache has seen, evicted ones
included (``held`` is the number it holds), as transformers' own sliding-window layers count. ``generate`` slices
a continued input at it (``generate(torch.cat([out, new], 1), cache=cache)`` feeds only the tokens after the last
one the cache has seen), and positions a caller computes from it are the sequence's own. During the decoder's
forward (from the hook to the decoder's return) it is ``held``: the model computes in the cache's own slots, so
the masks (transformers takes the query offset from it), and any position a layer derives from it (Llama 4's
temperature on its NoPE layers), are those of an uncached forward of the kept tokens. The hook checks each
forward against the count seen: position ids that do not start at it, or a 2D attention mask that does not
cover it plus the new tokens, mean the input repeats or skips tokens the cache has seen, and are refused.

Limits, each refused with a message: a forward that brings more new tokens than the window (a prompt longer than
``window``: feed it in pieces, which ``generate(..., prefill_chunk_size=window)`` does), padded batches (the sinks
would be padding), a batch of another size than the cache holds (a beam search's cache continued with one row),
dynamic and attention-level methods (they assign positions themselves), log-n (it scales a query by its position in
the sequence, which an in-cache slot is not), models whose cache holds a recurrent or convolution state (hybrid
linear-attention, Mamba and convolution layers, as ``families.ask("state_layers")`` finds them in the config: a
state sums up every token seen, so none can be evicted), caches of keys of another size than the attention sees
(MLA's compressed cache), layers whose rotation the probe cannot reproduce, cropping (assisted and speculative
decoding crop the cache to undo rejected tokens: a sink cache cannot undo an eviction), and the Phi-3 family when
its config has ``original_max_position_embeddings``: its ``generate`` replaces any cache by a fresh one when the
sequence first passes that length. Static frequency methods (``yarn``, ``ntk``, ...) compose: the keys
carry their frequencies and attention scale, and the turn uses the same frequencies.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import CacheLayerMixin, DynamicCache

from ..errors import RopeExtendError, UnsupportedModelError
from . import attention, cache_name, families, rotary
from . import layout as rope_layout
from .installed import installed
from .reading import attn_implementation, original_length, text_config
from .rotate_keys import KeyRotator, shift_angles, turned


class SinkCache(DynamicCache):
    """A ``DynamicCache`` of at most ``sink_tokens + window`` tokens (see the module docstring).

    ``model`` is the model it will be used with: constructing the cache checks the model, finds how its layers
    rotate (``hf.layout.probe``, once per model) and installs the decoder hook that keeps it (once per decoder;
    the hook does nothing for other caches). ``get_seq_length()`` counts the tokens seen, ``held`` those kept."""

    is_croppable = False  # generate's deferred stop check (MPS) must not roll it back: eviction cannot be undone

    def __init__(self, model: nn.Module, sink_tokens: int = 4, window: int = 1020):
        for name, value, minimum in (("sink_tokens", sink_tokens, 0), ("window", window, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise RopeExtendError(f"{name} must be an integer >= {minimum}, got {value!r}")
        super().__init__()  # no config: a DynamicLayer for every layer, sliding ones included (the mask windows them)
        self.sink_tokens = sink_tokens
        self.window = window
        self.evicted = 0  # tokens dropped so far
        self.in_forward = False  # set by the keeper from its pre-hook to the decoder's return (get_seq_length)
        self.keeper = install(model)

    @property
    def capacity(self) -> int:
        return self.sink_tokens + self.window

    @property
    def held(self) -> int:
        """Tokens in the cache now (at most ``capacity``)."""
        return super().get_seq_length()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Between forwards, the tokens seen, evicted ones included: where the next token is in the sequence
        (``generate`` slices a continued input here, as for transformers' sliding-window layers, which count the
        same way). During the decoder's forward, the tokens held: the slot of the first new token."""
        held = super().get_seq_length(layer_idx)
        return held if self.in_forward else held + self.evicted

    def crop(self, max_length: int) -> None:
        raise RopeExtendError(
            "SinkCache cannot be cropped: it has evicted tokens a crop would need back (assisted and speculative "
            "decoding crop the cache to undo rejected tokens); generate without an assistant or prompt lookup"
        )

    def nbytes(self) -> int:
        """Bytes held by the cached keys and values."""
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
            if t is not None
        )


class SinkKeeper:
    """The decoder's forward pre-hook that applies a ``SinkCache``'s policy (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.rotary = [m for _, m in rotary.rotary_modules(model)]  # found once: the check runs before every forward
        # how each layer rotates its cached keys (hf.rotate_keys, shared with the dynamic methods' cache keeper)
        self.rotator = KeyRotator(model, text_config(model.config), self.rotary)
        self.active: SinkCache | None = None  # the cache of the forward under way

    def check(self) -> None:
        """Refuse the methods that assign positions themselves (the patch may change between forwards)."""
        state = families.ask("state_layers", text_config(self.model.config))
        if state:
            raise UnsupportedModelError(
                f"SinkCache: {type(self.model).__name__}'s {families.recurrent.describe(state)} keep a recurrent "
                "or convolution state in the cache, which sums up every token seen, so no token can be evicted "
                "from it; use a DynamicCache (generate's default)"
            )
        patch = installed(self.model)
        scaling = patch.plan.scaling if patch is not None else None
        if scaling is not None and (scaling.method.attention or scaling.method.dynamic):
            kind = "an attention-level method" if scaling.method.attention else "a dynamic method"
            raise UnsupportedModelError(
                f"attention sinks assign positions inside the cache, and {scaling.method.name} is {kind} that "
                "assigns them itself; use a static frequency method (yarn, ntk, linear, llama3) or none with SinkCache"
            )
        if scaling is not None and scaling.logn:
            raise UnsupportedModelError(
                f"attention sinks assign positions inside the cache, and log-n ({scaling.method.name} with "
                "logn=True) scales each query by its position in the sequence, which the cache's slots no longer "
                "are; use a static frequency method (yarn, ntk, linear, llama3) without logn, or none, with SinkCache"
            )
        for module in self.rotary:
            runtime = module.__dict__.get("forward")
            if isinstance(runtime, rotary.RotaryRuntime) and any(e.dynamic for e in runtime.entries.values()):
                raise UnsupportedModelError(
                    "attention sinks assign positions inside the cache, and this model's rotary frequencies are "
                    "dynamic (a dynamic rope_type in its config); use a static method with SinkCache"
                )
        swaps = families.ask("generate_swaps_cache", self.model.config) if hasattr(self.model, "generate") else None
        if swaps:
            raise UnsupportedModelError(
                f"SinkCache: {type(self.model).__name__}.generate {swaps}, and would go on without the sinks; use a "
                "DynamicCache"
            )
        if attention.is_registered_name(attn_implementation(text_config(self.model.config))):
            raise UnsupportedModelError(
                "attention sinks assign positions inside the cache, and this model runs a rope-extend attention "
                "method (its config names one); use a static method with SinkCache"
            )

    def probe(self) -> None:
        """How each layer rotates and what it caches (``KeyRotator.probe``, strict), found once, when the first
        ``SinkCache`` of the model is made (``install``); a layer whose cached keys could not be turned is refused
        then, before any forward runs, not at the first eviction."""
        self.rotator.probe(original_length(self.rotator.config))
        self.rotator.check(_refusal)

    def __call__(self, module, args, kwargs):
        cache = cache_name.passed(kwargs)
        if not isinstance(cache, SinkCache):
            return None
        if cache_name.ignored(kwargs):
            raise RopeExtendError(
                "SinkCache: this transformers names the cache argument past_key_values (cache= came with 5.24) and "
                "would run without it; pass past_key_values=cache, or **rope_extend.cache_kwargs(cache)"
            )
        self.check()
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None:
            return None
        batch, n = tokens.shape[0], tokens.shape[1]
        held, seen = cache.held, cache.get_seq_length()
        self._check_input(cache, kwargs, batch, n, held, seen)
        drop = max(0, held + n - cache.capacity)
        if drop:
            self._evict(cache, drop, tokens.device)
            held -= drop
        positions = torch.arange(held, held + n, device=tokens.device)
        kwargs["cache_position"] = positions
        kwargs["position_ids"] = positions.unsqueeze(0).expand(batch, -1)
        if kwargs.get("attention_mask") is not None:
            kwargs["attention_mask"] = None  # no padding: the decoder's own causal mask over the kept tokens
        cache.in_forward, self.active = True, cache
        return args, kwargs

    def done(self, module, args, kwargs, output) -> None:
        """The decoder's forward hook (always called, errors included): the cache counts the tokens seen again."""
        if self.active is not None:
            self.active.in_forward, self.active = False, None

    @staticmethod
    def _check_input(cache: SinkCache, kwargs: dict, batch: int, n: int, held: int, seen: int) -> None:
        """Refuse a forward the cache cannot take exactly: padding, another batch, more than the window, or
        an input that does not continue the ``seen`` tokens (by its position ids or the length of its mask)."""
        rows = next((keys.shape[0] for _, _, keys, _ in _holding(cache)), 0)
        if held and rows and rows != batch:
            raise RopeExtendError(
                f"SinkCache: the cache holds {rows} rows and this forward brings {batch} (a beam search's cache "
                "continued with fewer rows?); continue with the same rows, or start a new SinkCache"
            )
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise RopeExtendError("SinkCache: give a 2D attention mask (or none); it rebuilds the causal mask itself")
        if mask is not None and not bool(mask.all()):
            raise RopeExtendError(
                "SinkCache: the attention mask has padding; the sinks are the first tokens of every row, so rows must "
                "not be padded (generate one sequence, or rows of the same length)"
            )
        if mask is not None and mask.shape[-1] != seen + n:
            raise RopeExtendError(
                f"SinkCache: the attention mask covers {mask.shape[-1]} tokens, but the cache has seen {seen} and this "
                f"forward brings {n}; give a mask of all {seen + n} tokens (or none), and only tokens it has not seen"
            )
        positions = kwargs.get("position_ids")
        if positions is not None and positions.numel() and bool((positions[..., 0] != seen).any()):
            first = int(positions[..., 0].min())
            raise RopeExtendError(
                f"SinkCache: this forward's positions start at {first}, but the cache has seen {seen} tokens, so the "
                "input repeats or skips some; give only the tokens after them (positions from cache.get_seq_length(), "
                "or none: the cache assigns them)"
            )
        if n > cache.window:
            raise RopeExtendError(
                f"SinkCache: {n} new tokens in one forward, more than the window of {cache.window}; feed a long prompt "
                f"in pieces of at most {cache.window} tokens (generate(..., prefill_chunk_size={cache.window}) does; "
                "its first forward is otherwise the whole prompt)"
            )

    def _evict(self, cache: SinkCache, drop: int, device) -> None:
        """Drop ``drop`` tokens after the sinks from every layer; turn the keys after them back ``drop`` positions."""
        s = cache.sink_tokens
        layouts = [
            (layer, keys, values, self.rotator.layout(i, keys.shape[-1], _refusal) if keys.numel() else None)
            for i, layer, keys, values in _holding(cache)
        ]  # refuse first
        for layer, keys, values, layout in layouts:
            if keys.numel() == 0:
                continue
            kept = keys[:, :, s + drop :]
            if layout is not None and kept.shape[-2]:  # they move down ``drop`` slots: turned by -drop theta
                delta = torch.full((kept.shape[-2],), -float(drop), dtype=torch.float64, device=device)
                kept = turned(kept, layout, shift_angles(layout, delta, kept.device))
            layer.keys = torch.cat([keys[:, :, :s], kept], dim=2)
            layer.values = torch.cat([values[:, :, :s], values[:, :, s + drop :]], dim=2)
        cache.evicted += drop


def _holding(cache: DynamicCache) -> list[tuple[int, CacheLayerMixin, torch.Tensor, torch.Tensor]]:
    """``(index, layer, keys, values)`` for the cache's layers that hold keys: not the linear-attention, state and
    dummy layers, nor a layer before its first update (transformers types them all in ``cache.layers``)."""
    return [
        (i, layer, layer.keys, layer.values)
        for i, layer in enumerate(cache.layers)
        if isinstance(layer, CacheLayerMixin) and layer.keys is not None and layer.values is not None
    ]


def _refusal(why: str) -> str:
    """The refusal ``KeyRotator`` raises for a layer whose kept keys cannot be turned."""
    return f"attention sinks turn the cached keys they keep, and {why}"


def install(model: nn.Module) -> SinkKeeper:
    """The ``SinkKeeper`` of ``model``'s decoder, registered once (a forward pre-hook with kwargs, and a forward
    hook that ends the forward's in-cache counting)."""
    decoder = rope_layout.decoder_of(model)
    for hook in decoder._forward_pre_hooks.values():
        if isinstance(hook, SinkKeeper):
            hook.check()
            return hook
    keeper = SinkKeeper(model)
    keeper.check()
    keeper.probe()  # how each layer rotates, found now: a model it cannot turn is refused before generating
    decoder.register_forward_pre_hook(keeper, with_kwargs=True)
    decoder.register_forward_hook(keeper.done, with_kwargs=True, always_call=True)
    return keeper
