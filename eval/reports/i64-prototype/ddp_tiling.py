"""Issue 64 prototype: DeepSpeed's tiled functions under DDP (accelerate, 2 gloo processes), where their weights train.

    cd eval/reports/i64-prototype && OMP_NUM_THREADS=1 PYTHONPATH=../../..:. ACCELERATE_USE_CPU=1 \
        /work/venvs/ds/bin/python -m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1 \
        --mixed_precision no --dynamo_backend no ddp_tiling.py

TiledMLP runs backward once per tile (torch.autograd.backward inside its backward), and TiledFusedLogitsLoss runs
backward inside its *forward*: DDP's reducer counts a parameter ready once per backward. Cases (plain DDP data
parallel, each process its own window; reference = the same two windows in this process without DDP):
  mlp_lora      TiledMLP on MLPs whose gate/up/down carry LoRA
  head          TiledFusedLogitsLoss with a trained lm_head (modules_to_save)
  head_chunked  rope-extend's ChunkedLinearCrossEntropy with the trained lm_head (control)
"""

from __future__ import annotations

import json
import warnings

import torch

warnings.filterwarnings("ignore")


def build(case: str):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         attn_implementation="sdpa", tie_word_embeddings=False)).float()
    model.config.use_cache = False
    mods = ["q_proj", "k_proj", "v_proj", "o_proj"] + (["gate_proj", "up_proj", "down_proj"] if "mlp_lora" in case else [])
    save = ["lm_head"] if case.startswith("head") else None
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=mods, modules_to_save=save,
                                             task_type="CAUSAL_LM"))
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.05)
    if case == "mlp_lora":
        from tiling import tiled_mlp

        tiled_mlp(model, tiles=4)  # 64 tokens in 4 tiles: 4 backward calls per MLP
    return model.train()


def loss_of(model, batch, case):
    from rope_extend.training.loss import model_loss
    from tiling import ds_model_loss

    if case == "head":
        return ds_model_loss(model, batch, 8)
    return model_loss(model, batch, 8)[0]


def main() -> None:
    torch.set_num_threads(1)
    from accelerate import Accelerator

    from proto_common import lora_grads, make_batch

    import os

    from accelerate.utils import DistributedDataParallelKwargs

    static = os.environ.get("STATIC_GRAPH") == "1"  # DDP(static_graph=True): does DDP then accept TiledMLP's tiles?
    acc = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(static_graph=True)] if static else None)
    cases = os.environ.get("CASES", "mlp_lora,head,head_chunked").split(",")
    for case in cases:
        batches = [make_batch(64, seed=s) for s in range(acc.num_processes)]
        tokens = sum(int((b["targets"] != -100).sum()) for b in batches)
        ref = build(case)
        (sum(loss_of(ref, b, case) for b in batches) / tokens).backward()
        want = lora_grads(ref)
        model = acc.prepare(build(case))
        row = {"case": case, "static_graph": static}
        try:
            loss = loss_of(model, batches[acc.process_index], case)
            acc.backward(loss * acc.num_processes / tokens)
            got = lora_grads(acc.unwrap_model(model))
            row["grad_maxdiff"] = max(float((got[k] - want[k]).abs().max()) for k in want)
            row["grad_max"] = max(float(v.abs().max()) for v in want.values())
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if acc.is_main_process:
            print(json.dumps(row), flush=True)
        acc.wait_for_everyone()


if __name__ == "__main__":
    main()
