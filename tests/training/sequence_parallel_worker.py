"""One LoRA forward and backward in 1 process against the same batch sharded over the processes of a Ulysses group.

    python -m torch.distributed.run --nproc_per_node 2 -m tests.training.sequence_parallel_worker OUT.json

Launched by ``tests/training/test_sequence_parallel.py`` (2 gloo processes). Every rank first computes the 1-process
reference on the whole batch itself (no collective), then the same model (same seed) on its shard through the
package's own path: ``training.parallel.shard`` / ``sharded`` (padding to a multiple of N, slicing, the whole
sequence's span), ``hf.ulysses.head_split`` / ``install`` (DeepSpeed's ``UlyssesSPAttentionHF`` under the model's
key) and ``training.loss.model_loss``. The shards' loss sums and LoRA gradients are summed over the group (what DDP's
all-reduce adds up) and compared with the reference; rank 0 writes one row per case. The cases come from the
method registry (every method and plain RoPE) x {plain, PoSE for frequency methods, packed with EOS, unpacked
padded batch of 2, a length N does not divide}, plus log-n on the first attention and the first static frequency
method. Loss = summed token loss / the whole batch's targets, as the loop divides it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as tdist

VOCAB, HIDDEN, HEADS, KV, LAYERS, L, T = 256, 64, 4, 2, 2, 32, 64
# the attention methods' parameters (tests/test_attention.py's): every special position falls inside T tokens
ATTENTION = {
    "self_extend": {"group_size": 4, "window": 8},
    "dual_chunk": {"chunk_size": 24, "local_window": 4},
    "rerope": {"window": 8},
    "leaky_rerope": {"window": 8, "k": 4.0},
    "string": {"shifted_offset": 12, "local_window": 4},
}


def patch_kwargs(method: str, logn: bool) -> dict:
    from rope_extend.methods import registry

    # a new attention method needs its parameters here (a KeyError says so)
    out = dict(ATTENTION[method]) if registry.get(method).attention else {"factor": 4}
    if method == "longrope":
        half = HIDDEN // HEADS // 2
        out |= {"short_factor": [1.0] * half, "long_factor": [1.0 + 3.0 * i / half for i in range(half)]}
    if logn:
        out["logn"] = True
    return out


def tiny_model(method: str, logn: bool, kv: int = KV):
    """A random tiny Llama (float32, max_position_embeddings L < T so the scaling acts), patched, with LoRA on
    q/k/v/o whose B is drawn non-zero (at init it is zero, and A's gradient with it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    import rope_extend

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=kv,
        max_position_embeddings=L,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    if method != "none":
        rope_extend.patch(model, method, **patch_kwargs(method, logn))
    model.config.use_cache = False
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    return model.train()


def batch(variant: str) -> dict[str, torch.Tensor]:
    """One micro-batch as the loop gets it (``data.pack`` / ``pad_documents`` and ``Batches.get``)."""
    from rope_extend.training.data import Batches, pack, pad_documents

    g = torch.Generator().manual_seed(7)
    width = 61 if variant == "odd" else T
    if variant == "unpacked":  # two documents, right-padded to the window, a batch of 2
        docs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (39, 80)]
        packed, rows = pad_documents(docs, 2, 0, width), 2
    else:  # packed: documents joined by EOS inside the window, positions running on
        docs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (20, 25, 60)]
        packed, rows = pack(docs, 2, width, "eos"), 1
    pose = 4 * L if variant == "pose" else None
    return Batches(packed, seed=3, batch_size=rows, accumulation=1, num_processes=1, pose_target_length=pose).get(
        0, 0, 0
    )


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def run_case(method: str, variant: str, logn: bool, where, group) -> dict:
    from rope_extend.hf import ulysses
    from rope_extend.training import parallel
    from rope_extend.training.loss import model_loss

    whole = batch(variant)
    tokens = int((whole["targets"] != -100).sum())
    kv = 1 if variant == "kv1" else KV  # 1 key-value head: Ulysses replicates it over the 2 processes
    reference = tiny_model(method, logn, kv)
    ref_loss, _ = model_loss(reference, whole, 16)
    (ref_loss / tokens).backward()
    expected = grads(reference)

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = tiny_model(method, logn, kv)
    before = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    groups = [m.num_key_value_groups for m in model.modules() if hasattr(m, "num_key_value_groups")]
    installed = ulysses.install(model, ulysses.head_split(model, where.degree, whole["input_ids"].shape[0]), group)
    start = time.perf_counter()
    try:
        with parallel.sharded(None, whole, where) as local:
            loss, _ = model_loss(model, local, 16)
            (loss / tokens).backward()
        during = [m.num_key_value_groups for m in model.modules() if hasattr(m, "num_key_value_groups")]
    finally:
        ulysses.remove(installed)
    assert ALL_ATTENTION_FUNCTIONS._local_mapping == before  # transformers as it was
    # and the model: DeepSpeed lowers num_key_value_groups when it replicates key-value heads
    assert groups == [m.num_key_value_groups for m in model.modules() if hasattr(m, "num_key_value_groups")]
    seconds = time.perf_counter() - start
    loss = loss.detach()
    tdist.all_reduce(loss, group=group)
    got = grads(model)
    for g in got.values():
        tdist.all_reduce(g, group=group)
    assert got.keys() == expected.keys() and got, (sorted(got), sorted(expected))
    return {
        "method": method,
        "variant": variant + ("+logn" if logn else ""),
        "tokens": tokens,
        "loss": float(ref_loss) / tokens,
        "loss_diff": abs(float(ref_loss) - float(loss)) / tokens,
        "grad_diff": max(float((got[k] - expected[k]).abs().max()) for k in got),
        "grad_max": max(float(expected[k].abs().max()) for k in got),
        "seconds": round(seconds, 3),
        "kv_groups": [groups[0], during[0]],  # before, and while Ulysses ran
    }


def cases() -> list[tuple[str, str, bool]]:
    import rope_extend
    from rope_extend.methods import registry

    names = rope_extend.method_names()
    out = []
    for method in ["none", *names]:
        frequency = method != "none" and not registry.get(method).attention
        for variant in ("plain", "pose", "packed", "unpacked", "odd"):
            if variant != "pose" or frequency:
                out.append((method, variant, False))
    first_attention = next(n for n in names if registry.get(n).attention)
    first_static = next(n for n in names if not registry.get(n).attention and not registry.get(n).dynamic)
    out += [(first_attention, "plain", True), (first_static, "plain", True), (first_attention, "odd", True)]
    out += [(first_static, "kv1", False), (first_attention, "kv1", False)]
    return out


def main(path: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as dist

    from rope_extend.training.parallel import Layout

    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(world)))
    where = Layout(world, world, rank, "sequence")
    start = time.perf_counter()
    rows = [run_case(method, variant, logn, where, group) for method, variant, logn in cases()]
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"world": world, "seconds": round(time.perf_counter() - start, 1), "rows": rows}, f, indent=1)
    tdist.barrier()
    tdist.destroy_process_group()
    # the results are written and every collective is done: leave without the interpreter's shutdown, where gloo's
    # and DeepSpeed's shared-memory destructors once aborted a rank (SIGABRT, 1 run in 13) after a clean run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
