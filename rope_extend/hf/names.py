"""Every attribute and hook name rope-extend places on transformers objects (models, configs, modules, caches).

One list, so that a reader sees at once what a patched model carries and a name is spelled once: every module that
places or reads one of these imports it from here (``tests/test_structure.py`` fails on a name placed on an object
that does not come from this module, and on a ``rope_extend`` attribute name spelled anywhere else).
"""

from __future__ import annotations

# on a model
PATCH_STATE = "_rope_extend_state"  # the model ``patch`` patched: its ``hf.installed.Installed`` (undone by unpatch)
DIGEST = "_rope_extend_digest"  # evaluation.identity: (key, digest) of the weights, computed once per model
# shipped_switch: (the Installed patch it made, the scaling the config named before): a run of the config's own scaling
SHIPPED_SWITCH = "_rope_extend_shipped_switch"
# transformers' own GenerationMixin methods, shadowed on the instance by hf.generation (5.17 and 5.24): the one
# that builds MaxLengthCriteria, and the one generate calls before each forward
STOPPING_CRITERIA = "_get_stopping_criteria"
PREPARE_INPUTS = "prepare_inputs_for_generation"

# on a config
SHIPPED_ATTR = (
    "rope_extend_shipped_context"  # the context a config was written for (what a later configure counts from)
)
INNER_ATTR = "_rope_extend_inner"  # the attention implementation the model ran before an attention method

# on a rotary module
ROTARY_INSTALLED = ("forward", "_apply", "rope_init_fn")  # instance attributes the runtime sets (hf.rotary)
TABLES_ATTR = "rope_extend_cos_sin"  # {(buffer name, sign, device, dtype): _Table} (hf.layout)
WORKSPACE_ATTR = "rope_extend_workspace"  # {(thread, key group, dtype, device): flat tensor} (hf.attention)

# on an attention module
PLAN_ATTR = "rope_extend_attention"  # its AttentionPlan (hf.attention)
GUARD_ATTR = "rope_extend_mrope"  # on the text decoder and its attention modules: the model's M-RoPE Guard
KEPT_HOOK = "_rope_extend_kept_keys_hook"  # the handle of the pre-hook that checks kept keys (hf.attention.keys)

# on the decoder
CACHE_RECORDER_ATTR = "_rope_extend_cache_recorder"  # (CacheRecorder, pre-hook handle, hook handle) (hf.slots)
PROBE_HOOK = "_rope_extend_probe_hook"  # the forward pre-hook that probes a model planned unprobed (hf.attention)
POSITIONS_HOOK = "_rope_extend_positions_hook"  # (PositionKeeper, its hook handle) (hf.attention)

# on a KV cache
LENGTH_ATTR = "_rope_extend_mrope_length"  # (Guard, its length after the last forward it saw) (hf.mrope)
KEPT_ATTR = "_rope_extend_kept_keys"  # on a cache layer: the keys kept turned for decode steps (hf.attention.keys)

# on an MLP DeepSpeed's TiledMLP runs
TILES_ATTR = "rope_extend_tiles"  # the tiles asked for (None: DeepSpeed's rule); with the instance forward
