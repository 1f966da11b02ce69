"""Shared pieces of the issue-64 prototypes (not rope-extend code; a sketch of what the next session builds).

- ``tiny_model``: a random tiny Llama (from a config) with LoRA on q/k/v/o, optionally patched by rope-extend.
- ``make_batch``: one window as rope-extend's ``Batches.get`` makes it (targets shifted BEFORE any sharding).
- ``ulysses``: DeepSpeed's ``UlyssesSPAttentionHF`` put under one attention-implementation key of transformers'
  ``ALL_ATTENTION_FUNCTIONS`` for the duration of a ``with`` block (DeepSpeed's own
  ``register_with_transformers`` does the same but only once per process, with no undo).
- ``global_length``: the dynamic methods' fix: RotaryRuntime's (low, high) position reduced over the sequence
  group, so every rank picks the frequencies of the whole sequence.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as tdist

VOCAB, HIDDEN, HEADS, KV, LAYERS, L = 256, 64, 4, 2, 2, 32
ATTENTION_PARAMS = {  # tests/test_attention.py's METHODS: every special position inside 64 tokens
    "self_extend": dict(group_size=4, window=8),
    "dual_chunk": dict(chunk_size=24, local_window=4),
    "rerope": dict(window=8),
    "leaky_rerope": dict(window=8, k=4.0),
    "string": dict(shifted_offset=12, local_window=4),
}


def patch_kwargs(method: str, logn: bool = False) -> dict:
    from rope_extend.methods import registry

    if registry.get(method).attention:
        out = dict(ATTENTION_PARAMS.get(method, {}))
    else:
        out = {"factor": 4}
    if method == "longrope":
        half = (HIDDEN // HEADS) // 2
        out |= {"short_factor": [1.0] * half, "long_factor": [1.0 + 3.0 * i / half for i in range(half)]}
    if logn:
        out["logn"] = True
    return out


def tiny_model(method: str | None = None, *, logn: bool = False, heads=HEADS, kv=KV, hidden=HIDDEN, seed=0,
               lora=True, attn="sdpa", sliding_window: int | None = None):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    import rope_extend

    fields = dict(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=LAYERS,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=L,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation=attn,
    )
    config = MistralConfig(**fields, sliding_window=sliding_window) if sliding_window else LlamaConfig(**fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    if method is not None:
        rope_extend.patch(model, method, **patch_kwargs(method, logn))
    model.config.use_cache = False
    if lora:
        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                  "o_proj"], task_type="CAUSAL_LM"))
        torch.manual_seed(seed + 1)  # LoRA B is zero at init: give it values so every gradient path is non-zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0, 0.05)
    model.train()
    return model


def make_batch(T: int, *, pose: bool = False, packed: str | None = None, seed: int = 0, target: int = 128):
    """One row like ``Batches.get``: input_ids, position_ids, targets (shifted), attention_mask (all ones unless
    positions restart). ``packed``: None, "eos" (EOS inside, positions run on) or "mask" (positions restart)."""
    import numpy as np

    from rope_extend.training.data import _restart_positions, pose_position_ids

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, T), generator=g)
    if packed:
        for at in (T // 3, (2 * T) // 3 + 1):
            ids[0, at] = 2  # EOS
    if packed == "mask":
        pos = _restart_positions(ids, 2)
    elif pose:
        pos = pose_position_ids(T, target, 2, np.random.default_rng([seed, 1, 0]))[None]
    else:
        pos = torch.arange(T)[None]
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    batch = {"input_ids": ids, "position_ids": pos, "targets": targets}
    if packed == "mask":
        targets[:, :-1][pos[:, 1:] == 0] = -100
    else:
        batch["attention_mask"] = torch.ones_like(ids)
    return batch


def padded_documents(T: int, lengths=(40, 64), seed: int = 0) -> dict:
    """``data.packing: false`` as ``Batches.get`` makes it: one document per row, right-padded, positions 0..T-1,
    attention_mask 0 on padding, targets -100 on padding and after each document's last token."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, VOCAB, (n,), generator=g)
        ids[i, n - 1] = 2
        mask[i, :n] = 1
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    targets[mask == 0] = -100
    targets[:, :-1][mask[:, 1:] == 0] = -100
    return {"input_ids": ids, "position_ids": torch.arange(T).expand(B, -1).clone(), "targets": targets,
            "attention_mask": mask}


def pad_to(batch: dict, multiple: int, repeat: bool = False) -> dict:
    """End-pad a batch to a multiple of ``multiple``: positions run on (``repeat``: the last real position
    repeated), targets -100, mask 0 (causal attention means no real token sees a pad key)."""
    T = batch["input_ids"].shape[1]
    extra = (-T) % multiple
    if extra == 0:
        return batch
    out = {}
    B = batch["input_ids"].shape[0]
    last = batch["position_ids"][:, -1:]
    out["input_ids"] = torch.cat([batch["input_ids"], torch.zeros(B, extra, dtype=torch.long)], 1)
    pad_pos = last.expand(B, extra) if repeat else last + 1 + torch.arange(extra)[None]
    out["position_ids"] = torch.cat([batch["position_ids"], pad_pos], 1)
    out["targets"] = torch.cat([batch["targets"], torch.full((B, extra), -100)], 1)
    if "attention_mask" in batch:
        out["attention_mask"] = torch.cat([batch["attention_mask"], torch.zeros(B, extra, dtype=torch.long)], 1)
    return out


def shard(batch: dict, rank: int, world: int) -> dict:
    T = batch["input_ids"].shape[1]
    assert T % world == 0, (T, world)
    n = T // world
    return {k: v[:, rank * n:(rank + 1) * n] for k, v in batch.items()}


# ------------------------------------------------------------------------------------------ Ulysses
@contextlib.contextmanager
def ulysses(config, impl: str, group, batch_size: int = 1):
    """DeepSpeed's Ulysses attention under transformers' key ``impl`` (the model's ``_attn_implementation``:
    "sdpa", or rope-extend's registered name for the attention methods), restored on exit. The wrapper drops
    the attention mask as DeepSpeed's own ``register_with_transformers`` wrapper does (causality comes from
    ``is_causal``; the mask transformers built is for the shard's length)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    text = config.get_text_config()
    local = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    core = ALL_ATTENTION_FUNCTIONS[impl]
    uattn = UlyssesSPAttentionHF(
        attn=core,
        batch_size=batch_size,
        attn_head_count=text.num_attention_heads,
        attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        kv_head_count=text.num_key_value_heads,
        num_hidden_layers=text.num_hidden_layers,
        process_group=group,
        seq_length_is_variable=True,
    )
    uattn.core_attn_implementation = impl

    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        return uattn(module, query, key, value, None, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[impl] = wrapper
    try:
        yield uattn
    finally:
        ALL_ATTENTION_FUNCTIONS._local_mapping.clear()
        ALL_ATTENTION_FUNCTIONS._local_mapping.update(local)


# ------------------------------------------------------------------------------------------ dynamic fix
_GROUP = {"group": None, "span": None}


def install_global_length() -> None:
    """Make rope-extend's RotaryRuntime read (min, max) position over the sequence group (prototype of the fix)."""
    import rope_extend.hf.rotary as rotary

    if getattr(rotary.next_seen, "_global", False):
        return
    original = rotary.next_seen

    def next_seen(entry, low, high):
        group = _GROUP["group"]
        if _GROUP["span"] is not None:  # the caller knows the whole sequence's positions (no collective)
            low, high = _GROUP["span"]
        elif group is not None:
            t = torch.tensor([-low, high], dtype=torch.long)
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=group)
            low, high = -int(t[0]), int(t[1])
        return original(entry, low, high)

    next_seen._global = True
    rotary.next_seen = next_seen


@contextlib.contextmanager
def global_length(group, span: tuple[int, int] | None = None):
    """Dynamic frequencies from the whole sequence: ``span`` = (first, last real position) when the caller has the
    whole window (rope-extend's loop does: every rank slices its shard itself), else (min, max) all-reduced over
    ``group``."""
    _GROUP["group"], _GROUP["span"] = group, span
    try:
        yield
    finally:
        _GROUP["group"], _GROUP["span"] = None, None


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
