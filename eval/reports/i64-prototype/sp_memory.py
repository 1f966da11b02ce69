"""Issue 64 prototype: per-process activation memory of one LoRA step, 1 process vs Ulysses over 2 (gloo, CPU).

    cd eval/reports/i64-prototype && MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0 OMP_NUM_THREADS=1 \
        PYTHONPATH=../../..:. /work/venvs/ds/bin/python -m torch.distributed.run --nproc_per_node N \
        sp_memory.py --T 4096 8192 [--mlp]

Model: tiling.MODEL (hidden 512, MLP 1792, 8/2 heads, 2 layers, 32k vocabulary), LoRA r=8 on q/k/v/o,
activation checkpointing, rope-extend's chunked loss (1024). Each (T) is measured in this same process one after
the other (peak RSS is a high-water mark: T ascending, so each reading is its own), the increase = peak RSS over
2 steps minus the RSS before them. Prints one JSON line per (T, rank).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
import torch.distributed as tdist

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", nargs="*", type=int, default=[4096, 8192])
    ap.add_argument("--mlp", action="store_true", help="DeepSpeed TiledMLP too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as dist
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from _measure import measure, rss_mb
    from proto_common import shard, ulysses
    from rope_extend.hf import checkpointing
    from rope_extend.training.loss import model_loss
    from tiling import MODEL, tiled_mlp

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation="sdpa")).float()
    model.config.use_cache = False
    checkpointing.enable(model)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                  "o_proj"], task_type="CAUSAL_LM"))
    if args.mlp:
        tiled_mlp(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    for T in sorted(args.T):
        g = torch.Generator().manual_seed(T)
        ids = torch.randint(3, MODEL["vocab_size"], (1, T), generator=g)
        targets = torch.full_like(ids, -100)
        targets[:, :-1] = ids[:, 1:]
        batch = {"input_ids": ids, "position_ids": torch.arange(T)[None], "targets": targets,
                 "attention_mask": torch.ones_like(ids)}
        tokens = int((targets != -100).sum())
        local = shard(batch, rank, world) if world > 1 else batch

        def step():
            for p in params:
                p.grad = None
            # the Ulysses attention must still be installed in backward: activation checkpointing recomputes the
            # layers there (outside it: CheckpointError, recomputed tensors of another shape)
            if world > 1:
                with ulysses(model.config, "sdpa", group):
                    s, _ = model_loss(model, local, 1024)
                    (s / tokens).backward()
            else:
                s, _ = model_loss(model, local, 1024)
                (s / tokens).backward()
            return float(s)

        r = measure(step, repeats=2, device="cpu", baseline="current")
        print(json.dumps({"world": world, "rank": rank, "T": T, "local_T": local["input_ids"].shape[1],
                          "tiled_mlp": args.mlp, "increase_mb": round(r["increase_mb"], 1),
                          "seconds": round(r["seconds"], 2), "rss_before_mb": round(r["base_mb"], 1),
                          "now_mb": round(rss_mb(), 1)}), flush=True)
        tdist.barrier()


if __name__ == "__main__":
    main()
