"""Everything that knows transformers internals, in four layers (each imports only those above it):

- ``hf.config``: reading and writing a config's rotary settings (``configure``, ``rope_parameters``);
- ``hf.rotary``: the ``*RotaryEmbedding`` module convention and the runtime rope-extend installs in it;
  ``hf.window``: sliding-window attention; ``hf.head``: the LM head and its logit quirks;
  ``hf.checkpointing``: activation checkpointing under both of transformers' names; ``hf.cache_arg``: the KV
  cache's argument name (``cache`` since transformers 5.24, ``past_key_values`` before);
- ``hf.register``: registration of rope-extend's rope types with transformers (arranged by ``import rope_extend``).

This package's ``__init__`` imports only ``hf.config``.
"""

from .config import configure, rope_parameters

__all__ = ["configure", "rope_parameters"]
