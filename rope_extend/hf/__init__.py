"""Everything that knows transformers internals, in layers (each module imports only those above it):

- ``hf.names``: every attribute and hook name rope-extend places on transformers objects;

- ``hf.families``: every family's quirks, one small rule each, asked by what they are about (``families.ask``);
- ``hf.rope_types``: rope types, rotary layouts and the keys of a rope dict; ``hf.reading``: reading a config's
  rotary settings; ``hf.config``: writing them (``configure``, ``rope_parameters``; ``edit``, one
  ``ConfigEdit`` computed and validated once);
- ``hf.rotary``: the ``*RotaryEmbedding`` module convention and the runtime rope-extend installs in it;
  ``hf.window``: sliding-window attention; ``hf.head``: the LM head and its logit quirks;
  ``hf.checkpointing``: activation checkpointing under both of transformers' names; ``hf.cache_name``: the KV
  cache's argument name (``cache`` since transformers 5.24, ``past_key_values`` before); ``hf.causal``: whether
  a layer's attention is plain causal attention; ``hf.compiled``: what torch.compile runs outside its graphs;
  ``hf.generation``: ``generate``'s maximum-length reminder;
- ``hf.layout``: how each attention layer rotates its queries and keys, found by probing the model;
  ``hf.rotary_reads``: whether anything outside the attention layers reads positions (the probe's rows), and a
  model none of whose layers reads the rotary embedding;
- ``hf.slots``: where the newest key sits in a layer's keys (dynamic and static caches); ``hf.mrope``: the
  attention methods on M-RoPE models (text positions, image tokens refused);
- ``hf.rotate_keys``: the one key rotator (probe once, turn cached keys) under ``hf.cache_keeper`` and ``hf.sinks``;
- ``hf.cache_keeper``: cached keys turned when dynamic frequencies change (``CacheKeeper``); ``hf.attention`` (a
  package): rope-extend's attention function, the runtime of the attention methods and log-n (planning and
  refusal, install and remove, masks, the multi-pass kernel);
- ``hf.attach``: the one install path of a scaled rotary module (its checks, runtime, cache keeper, attention
  plans), shared by ``patch`` and by models built from a config; ``hf.sinks``: ``SinkCache`` (StreamingLLM);
- ``hf.patch_plan``: everything ``patch`` will change, one ``PatchPlan`` planned before anything is touched;
  ``hf.installed``: the plan put into a model, and the handle whose ``undo`` is ``unpatch``;
- ``hf.register``: what rope-extend registers with transformers (rope init functions, validators, the
  ``post_init`` that attaches the runtime); ``hf.transformers_changes``: every change ``import rope_extend`` makes
  to transformers (an unregistered method's rope types taken out again included), with ``install`` and
  ``uninstall``.

This package's ``__init__`` imports nothing and exports nothing: each name is imported from the module that
defines it, so that ``import rope_extend`` reaches ``hf.transformers_changes`` without torch.
"""
