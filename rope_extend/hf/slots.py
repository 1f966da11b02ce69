"""Where the newest key sits in the key tensor a layer's attention function receives.

transformers hands attention two layouts of cached keys:

- a dynamic cache (``DynamicCache``, full or sliding-window layers, ``offloaded``, quantized) returns the keys
  up to the newest token: the last query's own key is the last slot;
- a static cache (``StaticCache``: ``cache_implementation="static"`` / ``"offloaded_static"``, and the deprecated
  ``"sliding_window"`` / ``"hybrid_chunked"``) returns its whole preallocated tensor of ``max_cache_len`` slots,
  filled from slot 0 up to its cumulative length; the slots after it hold zeros or stale keys, which the mask
  hides. Its sliding-window layers (``StaticSlidingWindowLayer``) return their window tensor filled the same way
  until it is full, and keys ending at the newest token from then on.

The attention methods place each key by its distance from the last query, so they need the filled length. The
attention function never sees the cache (transformers 5.24 passes no ``cache_position``; 5.17 neither), so
``CacheRecorder``, a forward pre-hook on the decoder, records the cache each forward receives, and ``filled`` reads
the layer's length after its update: ``StaticLayer.cumulative_length``, a tensor (the cache keeps it on the device
so that compiled decoding does not recompile), which the caller reads on the host. One forward at a time per model:
like the cache keepers (``hf.cache_keeper``), the recorder holds the cache of the forward running now.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UnsupportedModelError
from .layout import cache_argument
from .names import CACHE_RECORDER_ATTR


class CacheRecorder:
    """Records the cache of the decoder's forward (``cache``, ``past_key_values`` before 5.24, or a positional
    ``Cache``) while it runs; cleared when it returns, so that no cache is kept alive after it."""

    def __init__(self):
        self.cache = None

    def __call__(self, module, args, kwargs):
        from transformers.cache_utils import Cache

        cache = cache_argument(kwargs)
        if cache is None:
            cache = next((a for a in args if isinstance(a, Cache)), None)
        self.cache = cache

    def clear(self, *_):
        self.cache = None


def install(decoder: nn.Module) -> CacheRecorder:
    """The decoder's ``CacheRecorder``, registered once."""
    found = decoder.__dict__.get(CACHE_RECORDER_ATTR)
    if found is not None:
        return found[0]
    recorder = CacheRecorder()
    pre = decoder.register_forward_pre_hook(recorder, with_kwargs=True)
    post = decoder.register_forward_hook(recorder.clear, always_call=True)
    decoder.__dict__[CACHE_RECORDER_ATTR] = (recorder, pre, post)
    return recorder


def remove(decoder: nn.Module) -> None:
    found = decoder.__dict__.pop(CACHE_RECORDER_ATTR, None)
    if found is not None:
        found[1].remove()
        found[2].remove()


def filled(recorder: CacheRecorder | None, module: nn.Module, key: torch.Tensor) -> int | torch.Tensor | None:
    """How many slots of ``key`` (``[b, h, m, d]``, what ``module``'s attention function received) hold keys, the
    newest query's last: None when all ``m`` do (a dynamic cache, or no cache); an int or a 0-d tensor (a static
    layer's cumulative length, read on the host by the caller) when the keys are a static layer's slots.
    Raises for a cache layer whose slots rope-extend does not know."""
    from transformers import cache_utils as cu

    layer = _layer(recorder, module)
    if layer is None:
        return None
    index = module.layer_idx
    if isinstance(layer, cu.StaticSlidingWindowLayer):
        # not yet full: the window tensor, filled up to the length; from full on: keys ending at the newest token
        length = layer.cumulative_length_int
        return length if length < key.shape[-2] else None
    if isinstance(layer, cu.StaticLayer):
        if key.shape[-2] != layer.max_cache_len:
            raise UnsupportedModelError(
                f"layer {index} attends over {key.shape[-2]} keys from a {type(layer).__name__} of "
                f"{layer.max_cache_len} slots, so rope-extend cannot tell which slot holds the newest key; "
                "use a DynamicCache (generate's default)"
            )
        return layer.cumulative_length
    if isinstance(layer, cu.DynamicLayer):  # full, sliding, offloaded, quantized: keys end at the newest token
        return None
    raise UnsupportedModelError(
        f"cache layers of type {type(layer).__name__} (layer {index}) keep their keys in slots rope-extend does not "
        "know, so it cannot place them; use a DynamicCache (generate's default) or a StaticCache"
    )


def static_full(recorder: CacheRecorder | None, module: nn.Module) -> bool:
    """Whether ``module``'s keys come from a full-attention static cache layer (not a sliding one)."""
    from transformers import cache_utils as cu

    layer = _layer(recorder, module)
    return isinstance(layer, cu.StaticLayer) and not isinstance(layer, cu.StaticSlidingWindowLayer)


def layer_of(recorder: CacheRecorder | None, module: nn.Module):
    """The cache layer of ``module`` in the running forward's cache, or None (the attention's kept keys read it)."""
    return _layer(recorder, module)


def _layer(recorder: CacheRecorder | None, module: nn.Module):
    """The cache layer of ``module`` in the running forward's cache, or None (no cache, or not a layered one)."""
    cache = recorder.cache if recorder is not None else None
    cache = getattr(cache, "self_attention_cache", cache)  # an encoder-decoder cache: the decoder's own
    layers = getattr(cache, "layers", None)
    index = getattr(module, "layer_idx", None)
    if layers is None or not isinstance(index, int) or index >= len(layers):
        return None
    return layers[index]
