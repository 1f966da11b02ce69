"""Everything that knows transformers internals, in layers (each module imports only those above it):

- ``hf.config``: reading and writing a config's rotary settings (``configure``, ``rope_parameters``);
- ``hf.rotary``: the ``*RotaryEmbedding`` module convention and the runtime rope-extend installs in it;
  ``hf.window``: sliding-window attention; ``hf.head``: the LM head and its logit quirks;
  ``hf.checkpointing``: activation checkpointing under both of transformers' names; ``hf.cache_arg``: the KV
  cache's argument name (``cache`` since transformers 5.24, ``past_key_values`` before); ``hf.causal``: whether
  a layer's attention is plain causal attention; ``hf.compiled``: what torch.compile runs outside its graphs;
  ``hf.generation``: ``generate``'s maximum-length reminder;
- ``hf.layout``: how each attention layer rotates its queries and keys, found by probing the model;
- ``hf.slots``: where the newest key sits in a layer's keys (dynamic and static caches); ``hf.mrope``: the
  attention methods on M-RoPE models (text positions, image tokens refused);
- ``hf.rotate_keys``: the one key rotator (probe once, turn cached keys) under ``hf.cache`` and ``sinks``;
- ``hf.cache``: cached keys turned when dynamic frequencies change (``CacheKeeper``); ``hf.attention`` (a
  package): rope-extend's attention function, the runtime of the attention methods and log-n (planning and
  refusal, install and remove, masks, the multi-pass kernel);
- ``hf.attach``: the one install path of a scaled rotary module (its checks, runtime, cache keeper, attention
  plans), shared by ``patch`` and by models built from a config;
- ``hf.unregister``: an unregistered method's rope types taken out of transformers again;
- ``hf.register``: registration of rope-extend's rope types and attention with transformers (arranged by
  ``import rope_extend``, which also starts ``hf.unregister``'s listener).

This package's ``__init__`` imports only ``hf.config``.
"""

from .config import configure, rope_parameters

__all__ = ["configure", "rope_parameters"]
