"""Issue 64 prototype: DeepSpeed's TiledMLP and TiledFusedLogitsLoss on the CPU vs rope-extend's chunked loss and the
HF baseline, one LoRA forward/backward; equality of loss and LoRA gradients, peak RSS increase and time.

    cd eval/reports/i64-prototype && PYTHONPATH=../../..:. /work/venvs/ds/bin/python tiling.py [--T 1024 2048] [--out tiling.json]

Each (variant, length) runs in a fresh subprocess (eval/benchmarks/_measure.spawn) under glibc settings that make
RSS follow live tensors (_measure.LIVE_MEMORY_ENV); "increase" = peak RSS over 2 steps minus the RSS just before
the first (the model, LoRA and the batch excluded). Time is the faster of the 2 steps, in that same (slower) run.

Variants (LoRA r=8 on q/k/v/o unless "+mlp_lora": also gate/up/down):
  hf            PEFT model(input_ids, labels=...) + activation checkpointing (the baseline ALST compares with)
  rope          rope-extend today: model_loss (ChunkedLinearCrossEntropy, 1024-token chunks) + checkpointing
  rope+mlp      + DeepSpeed TiledMLP on every decoder MLP (ceil(T / hidden) tiles, DeepSpeed's rule)
  ds_loss       DeepSpeed TiledFusedLogitsLoss in the head hook (ceil(T / 1024) shards) + checkpointing
  ds_loss+mlp   both of DeepSpeed's
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1792, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
CHUNK = 1024
VARIANTS = ("hf", "rope", "rope+mlp", "ds_loss", "ds_loss+mlp")


def tiled_mlp(model, tiles: int | None = None) -> int:
    """Swap every decoder MLP's forward (instance attribute) for DeepSpeed's TiledMLP over ceil(T / hidden) tiles
    (or ``tiles``)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    n = 0
    for module in model.modules():
        if type(module).__name__.endswith("MLP") and hasattr(module, "down_proj"):
            plain = type(module).forward

            def forward(x, _m=module, _plain=plain):
                shards = tiles or max(1, math.ceil(x.shape[-2] / x.shape[-1]))
                params = [p for p in _m.parameters() if p.requires_grad]
                return TiledMLP.apply(lambda self, xs: _plain(self, xs), _m, x, shards, params)

            module.forward = forward
            n += 1
    return n


def ds_model_loss(model, batch, chunk):
    """rope-extend's head hook (model_loss's idea) with DeepSpeed's TiledFusedLogitsLoss instead of the chunked loss."""
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    from rope_extend.hf.head import lm_head

    lm = lm_head(model)
    head = lm.output
    bound = head.forward
    slot = {}
    targets = batch["targets"]

    def loss_fn(self, x, y):
        logits = lm.transform(bound(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), ignore_index=-100, reduction="sum")

    def forward(hidden):
        shards = max(1, math.ceil(hidden.shape[1] / chunk))
        params = [p for p in head.parameters() if p.requires_grad]
        slot["loss"] = TiledFusedLogitsLoss.apply(loss_fn, head, hidden, targets, None, shards, params, "sum")
        return hidden.new_empty(*hidden.shape[:-1], 0)

    head.forward = forward
    try:
        model(**{k: v for k, v in batch.items() if k != "targets"}, use_cache=False)
    finally:
        del head.__dict__["forward"]
    return slot["loss"]


def one(variant: str, T: int, grads_path: str) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from _measure import measure
    from rope_extend.hf import checkpointing
    from rope_extend.training.loss import model_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation="sdpa")).float()
    model.config.use_cache = False
    checkpointing.enable(model)
    targets_mods = ["q_proj", "k_proj", "v_proj", "o_proj"]
    base = variant.replace("+mlp_lora", "")
    if variant.endswith("+mlp_lora"):
        targets_mods += ["gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets_mods,
                                             task_type="CAUSAL_LM"))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.02)
    model.train()
    tiles = tiled_mlp(model) if base.endswith("+mlp") else 0
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, MODEL["vocab_size"], (1, T), generator=g)
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    batch = {"input_ids": ids, "position_ids": torch.arange(T)[None], "attention_mask": torch.ones_like(ids),
             "targets": targets}
    n_tok = int((targets != -100).sum())
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        for p in params:
            p.grad = None
        if base == "hf":
            out = model(input_ids=ids, attention_mask=batch["attention_mask"], labels=ids, use_cache=False)
            loss = out.loss  # mean over T - 1 targets
            loss.backward()
            return float(loss)
        if base.startswith("ds_loss"):
            s = ds_model_loss(model, batch, CHUNK)
        else:
            s, _ = model_loss(model, batch, CHUNK)
        (s / n_tok).backward()
        return float(s) / n_tok

    r = measure(step, repeats=2, device="cpu", baseline="current")
    torch.save({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, grads_path)
    return {"variant": variant, "T": T, "loss": r["result"], "seconds": r["seconds"], "increase_mb": r["increase_mb"],
            "mlp_tiled_modules": tiles}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=3, metavar=("VARIANT", "T", "GRADS"))
    ap.add_argument("--T", nargs="*", type=int, default=[1024, 2048])
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.one[2])))
        return
    import torch

    from _measure import LIVE_MEMORY_ENV, spawn

    rows = []
    tmp = tempfile.mkdtemp(prefix="tiling-")
    for T in args.T:
        grads = {}
        for v in args.variants:
            path = os.path.join(tmp, f"{v}-{T}.pt")
            env = {**LIVE_MEMORY_ENV, "PYTHONPATH": f"{os.path.join(HERE, '..', '..', '..')}:{HERE}", "OMP_NUM_THREADS": "1"}
            row = spawn(os.path.abspath(__file__), ["--one", v, str(T), path], env=env, timeout=1800)
            row.setdefault("variant", v)
            row.setdefault("T", T)
            if "error" not in row:
                grads[v] = torch.load(path)
            else:
                print(json.dumps(row), flush=True)
            rows.append(row)
        for row in rows:
            v = row.get("variant")
            if row.get("T") != T or v not in grads:
                continue
            ref = "rope+mlp_lora" if v.endswith("+mlp_lora") else "rope"
            if ref in grads and v != ref:
                row["grad_maxdiff_vs_" + ref] = max(float((grads[v][k] - grads[ref][k]).abs().max()) for k in grads[ref])
            row["grad_max"] = max(float(t.abs().max()) for t in grads[v].values())
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": MODEL, "chunk": CHUNK, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
