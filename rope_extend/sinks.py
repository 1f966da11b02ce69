"""Attention sinks: a KV cache that keeps the first tokens and a recent window, for generation of unbounded length
at constant memory (Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks"; StreamingLLM).

    cache = rope_extend.SinkCache(model, sink_tokens=4, window=1020)
    model.generate(ids, past_key_values=cache, max_new_tokens=100_000)

The cache holds at most ``sink_tokens + window`` tokens: the first ``sink_tokens`` of the sequence (the "sinks"
that softmax attention leans on) and the ``window`` most recent ones. Positions are assigned inside the cache,
as StreamingLLM does: the token in slot ``t`` is at position ``t``, so no relative position ever exceeds the
cache size, however long the generation runs.

How it is kept exact: ``SinkKeeper`` is a forward pre-hook on the decoder (the module that receives
``past_key_values``). Before a forward that would overflow the cache by ``e`` tokens, it drops the ``e`` oldest
tokens after the sinks from every layer, turns the keys that remain after them back by ``e`` positions (they move
down ``e`` slots; RoPE rotations compose, so this is one more rotation by ``-e theta``, in each layer's own
convention as ``hf.layout.probe`` measured it: pairing, which dimensions, which frequency set; NoPE layers are
left as they are), and gives the new tokens the positions that follow (``cache_position`` and ``position_ids``
rewritten). The new tokens' queries and keys are then rotated by the model itself at in-cache positions.
For a one-layer model the logits of every step equal an uncached forward of the kept tokens at positions
``0 .. n-1``; in a deeper model the kept keys and values were computed when the dropped tokens were still
visible, which is StreamingLLM's design.

Limits, each refused with a message: a forward that brings more new tokens than the window (a prompt longer than
``window``: feed it in pieces), padded batches (the sinks would be padding), dynamic and attention-level methods
(they assign positions themselves), caches of keys of another size than the attention sees (MLA's compressed
cache), and layers whose rotation the probe cannot reproduce. Static frequency methods (``yarn``, ``ntk``, ...)
compose: the keys carry their frequencies and attention scale, and the turn uses the same frequencies.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from .errors import RopeExtendError, UnsupportedModelError
from .hf import attention, rotary
from .hf import layout as rope_layout
from .hf.config import attn_implementation, original_length, text_config
from .patch import patched


class SinkCache(DynamicCache):
    """A ``DynamicCache`` of at most ``sink_tokens + window`` tokens (see the module docstring).

    ``model`` is the model it will be used with: constructing the cache checks the model, finds how its layers
    rotate (``hf.layout.probe``, once per model) and installs the decoder hook that keeps it (once per decoder;
    the hook does nothing for other caches)."""

    def __init__(self, model: nn.Module, sink_tokens: int = 4, window: int = 1020):
        for name, value, minimum in (("sink_tokens", sink_tokens, 0), ("window", window, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise RopeExtendError(f"{name} must be an integer >= {minimum}, got {value!r}")
        super().__init__()  # no config: a DynamicLayer for every layer, sliding ones included (the mask windows them)
        self.sink_tokens = sink_tokens
        self.window = window
        self.evicted = 0  # tokens dropped so far
        self.keeper = install(model)

    @property
    def capacity(self) -> int:
        return self.sink_tokens + self.window

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
        self.layouts: dict[int, rope_layout.LayerProbe] | None = None

    def check(self) -> None:
        """Refuse the methods that assign positions themselves (the patch may change between forwards)."""
        scaling = patched(self.model)
        if scaling is not None and (scaling.method.attention or scaling.method.dynamic or scaling.logn):
            kind = "an attention-level method" if scaling.method.attention or scaling.logn else "a dynamic method"
            raise UnsupportedModelError(
                f"attention sinks assign positions inside the cache, and {scaling.method.name} is {kind} that "
                "assigns them itself; use a static frequency method (yarn, ntk, linear, llama3) or none with SinkCache"
            )
        for module in self.rotary:
            runtime = module.__dict__.get("forward")
            if isinstance(runtime, rotary.RotaryRuntime) and any(e.dynamic for e in runtime.entries.values()):
                raise UnsupportedModelError(
                    "attention sinks assign positions inside the cache, and this model's rotary frequencies are "
                    "dynamic (a dynamic rope_type in its config); use a static method with SinkCache"
                )
        if attention.is_registered_name(attn_implementation(text_config(self.model.config))):
            raise UnsupportedModelError(
                "attention sinks assign positions inside the cache, and this model runs a rope-extend attention "
                "method (its config names one); use a static method with SinkCache"
            )

    def probe(self) -> None:
        """How each layer rotates (``hf.layout.probe``), found once."""
        if self.layouts is None:
            config = text_config(self.model.config)
            self.layouts = rope_layout.layer_probes(self.model, config, self.rotary, original_length(config))

    def _layout(self, index: int, layer) -> rope_layout.Layout | None:
        layout, why = rope_layout.cached_layout(self.layouts, index, layer.keys.shape[-1])
        if why is not None:
            raise UnsupportedModelError(f"attention sinks turn the cached keys they keep, and {why}")
        return layout

    def __call__(self, module, args, kwargs):
        cache = rope_layout.cache_argument(kwargs)
        if not isinstance(cache, SinkCache):
            return None
        self.check()
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None:
            return None
        batch, n = tokens.shape[0], tokens.shape[1]
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2 and not bool(mask.all()):
            raise RopeExtendError(
                "SinkCache: the attention mask has padding; the sinks are the first tokens of every row, so rows must "
                "not be padded (generate one sequence, or rows of the same length)"
            )
        if mask is not None and mask.dim() != 2:
            raise RopeExtendError("SinkCache: give a 2D attention mask (or none); it rebuilds the causal mask itself")
        if n > cache.window:
            raise RopeExtendError(
                f"SinkCache: {n} new tokens in one forward, more than the window of {cache.window}; feed a long prompt "
                f"in pieces of at most {cache.window} tokens (the first forward of generate is the whole prompt)"
            )
        past = cache.get_seq_length()
        drop = max(0, past + n - cache.capacity)
        if drop:
            self._evict(cache, drop, tokens.device)
            past -= drop
        positions = torch.arange(past, past + n, device=tokens.device)
        kwargs["cache_position"] = positions
        kwargs["position_ids"] = positions.unsqueeze(0).expand(batch, -1)
        if mask is not None:
            kwargs["attention_mask"] = None  # no padding: the decoder's own causal mask over the kept tokens
        return args, kwargs

    def _evict(self, cache: SinkCache, drop: int, device) -> None:
        """Drop ``drop`` tokens after the sinks from every layer; turn the keys after them back ``drop`` positions."""
        s = cache.sink_tokens
        layers = [(i, layer) for i, layer in enumerate(cache.layers) if getattr(layer, "keys", None) is not None]
        layouts = [
            (layer, self._layout(i, layer) if layer.keys.numel() else None) for i, layer in layers
        ]  # refuse first
        for layer, layout in layouts:
            keys, values = layer.keys, layer.values
            if keys.numel() == 0:
                continue
            kept = keys[:, :, s + drop :]
            if layout is not None and kept.shape[-2]:
                delta = torch.full((kept.shape[-2],), -float(drop), dtype=torch.float64, device=device)
                kept = layout.rotate(kept.float(), delta).to(keys.dtype)
            layer.keys = torch.cat([keys[:, :, :s], kept], dim=2)
            layer.values = torch.cat([values[:, :, :s], values[:, :, s + drop :]], dim=2)
        cache.evicted += drop


def install(model: nn.Module) -> SinkKeeper:
    """The ``SinkKeeper`` of ``model``'s decoder, registered once (a forward pre-hook with kwargs)."""
    decoder = rope_layout.decoder_of(model)
    for hook in decoder._forward_pre_hooks.values():
        if isinstance(hook, SinkKeeper):
            hook.check()
            return hook
    keeper = SinkKeeper(model)
    keeper.check()
    keeper.probe()  # how each layer rotates, found now: a model it cannot turn is refused before generating
    decoder.register_forward_pre_hook(keeper, with_kwargs=True)
    return keeper
