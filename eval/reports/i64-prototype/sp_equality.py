"""Issue 64 prototype: one LoRA forward/backward, 1 process vs Ulysses sequence parallelism over N gloo processes.

    cd eval/reports/i64-prototype && OMP_NUM_THREADS=1 PYTHONPATH=../../..:. \
        /work/venvs/ds/bin/torchrun --nproc_per_node 2 sp_equality.py [--only NAME ...] [--out results.json]

Every rank computes the 1-process reference on the whole batch itself (no collectives), then the same model
(same seed) on its shard under DeepSpeed's ``UlyssesSPAttentionHF`` (sdpa, or rope-extend's attention name for
the attention methods); the shard's summed loss and its LoRA gradients are all-reduced (sum) and compared with
the reference. Loss = sum over target tokens / the whole batch's target tokens, as rope-extend's loop divides.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import torch
import torch.distributed as tdist

warnings.filterwarnings("ignore")

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402

from proto_common import (  # noqa: E402
    global_length,
    install_global_length,
    lora_grads,
    make_batch,
    pad_to,
    padded_documents,
    shard,
    tiny_model,
    ulysses,
)


def one_step(model, batch, total_tokens, chunk=16):
    from rope_extend.training.loss import model_loss

    loss_sum, _ = model_loss(model, batch, chunk)
    (loss_sum / total_tokens).backward()
    return loss_sum.detach()


def run_case(case: dict, group, rank: int, world: int) -> dict:
    method, logn = case.get("method"), case.get("logn", False)
    T = case.get("T", 64)
    if case.get("unpacked"):
        batch = padded_documents(T)
    else:
        batch = make_batch(T, pose=case.get("pose", False), packed=case.get("packed"), seed=case.get("seed", 0))
    rows = batch["input_ids"].shape[0]
    total = int((batch["targets"] != -100).sum())
    kw = dict(heads=case.get("heads", 4), kv=case.get("kv", 2), hidden=case.get("hidden", 64),
              sliding_window=case.get("sliding_window"))

    ref = tiny_model(method, logn=logn, **kw)
    if case.get("ckpt"):
        from rope_extend.hf import checkpointing

        checkpointing.enable(ref)
    t0 = time.perf_counter()
    ref_loss = one_step(ref, batch, total)
    t_ref = time.perf_counter() - t0
    ref_grads = lora_grads(ref)

    model = tiny_model(method, logn=logn, **kw)
    if case.get("ckpt"):
        from rope_extend.hf import checkpointing

        checkpointing.enable(model)
    impl = model.config._attn_implementation
    sp_batch = pad_to(batch, world, repeat=case.get("pad") == "repeat") if T % world else batch
    local = shard(sp_batch, rank, world)
    if case.get("span"):  # the whole window's real positions, known before sharding (pads excluded)
        real = batch["position_ids"]
        fix = global_length(None, (int(real.min()), int(real.max())))
    else:
        fix = global_length(group) if case.get("fix", True) else global_length(None)
    t0 = time.perf_counter()
    try:
        with ulysses(model.config, impl, group, batch_size=rows), fix:
            loss = one_step(model, local, total)
    except Exception as exc:  # a refusal (rope-extend's or DeepSpeed's) is a result too
        return {"case": case["name"], "impl": impl, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    t_sp = time.perf_counter() - t0
    tdist.all_reduce(loss, group=group)
    grads = lora_grads(model)
    for g in grads.values():
        tdist.all_reduce(g, group=group)
    assert grads.keys() == ref_grads.keys()
    gdiff = max(float((grads[k] - ref_grads[k]).abs().max()) for k in grads)
    gscale = max(float(ref_grads[k].abs().max()) for k in grads)
    return {
        "case": case["name"],
        "impl": impl,
        "loss_1p": float(ref_loss) / total,
        "loss_sp": float(loss) / total,
        "loss_diff": abs(float(ref_loss) - float(loss)) / total,
        "grad_maxdiff": gdiff,
        "grad_max": gscale,
        "equal_1e-5": abs(float(ref_loss) - float(loss)) / total <= 1e-5 and gdiff <= 1e-5,
        "s_1p": round(t_ref, 3),
        "s_sp": round(t_sp, 3),
    }


def cases(world: int) -> list[dict]:
    import rope_extend

    out = [{"name": "plain-rope", "method": None}]
    for m in rope_extend.method_names():
        out.append({"name": m, "method": m})
    for m in ("dynamic", "dynamic_yarn", "longrope"):
        out.append({"name": f"{m}-NOFIX", "method": m, "fix": False})
    out += [
        {"name": "yarn-ckpt", "method": "yarn", "ckpt": True},
        {"name": "self_extend-ckpt", "method": "self_extend", "ckpt": True},
        {"name": "yarn-pose", "method": "yarn", "pose": True},
        {"name": "linear-pose", "method": "linear", "pose": True},
        {"name": "dynamic-pose", "method": "dynamic", "pose": True},
        {"name": "dynamic-pose-NOFIX", "method": "dynamic", "pose": True, "fix": False},
        {"name": "plain-packed-eos", "method": None, "packed": "eos"},
        {"name": "yarn-packed-eos", "method": "yarn", "packed": "eos"},
        {"name": "plain-packed-mask(sdpa)", "method": None, "packed": "mask"},
        {"name": "yarn-packed-mask(sdpa)", "method": "yarn", "packed": "mask"},
        {"name": "plain-unpacked-rightpad-B2", "method": None, "unpacked": True},
        {"name": "yarn-unpacked-rightpad-B2", "method": "yarn", "unpacked": True},
        {"name": "dynamic-unpacked-rightpad-B2", "method": "dynamic", "unpacked": True},
        {"name": "self_extend-unpacked-rightpad-B2", "method": "self_extend", "unpacked": True},
        {"name": "yarn+logn", "method": "yarn", "logn": True},
        {"name": "linear+logn", "method": "linear", "logn": True},
        {"name": "self_extend+logn", "method": "self_extend", "logn": True},
        {"name": "mistral-sliding16(sdpa)", "method": None, "sliding_window": 16},
        {"name": "mistral-sliding16-yarn(sdpa)", "method": "yarn", "sliding_window": 16},
        {"name": "yarn-T61-padded", "method": "yarn", "T": 61},
        {"name": "self_extend-T61-padded", "method": "self_extend", "T": 61},
        {"name": "dynamic-T61-padded", "method": "dynamic", "T": 61},
        {"name": "dynamic-T61-padded-repeatpos", "method": "dynamic", "T": 61, "pad": "repeat"},
        {"name": "dynamic-T61-padded-span", "method": "dynamic", "T": 61, "span": True},
        {"name": "dynamic_yarn-T61-padded-span", "method": "dynamic_yarn", "T": 61, "span": True},
        {"name": "longrope-T61-padded-span", "method": "longrope", "T": 61, "span": True},
        {"name": "dynamic-pose-span", "method": "dynamic", "pose": True, "span": True},
        {"name": "dual_chunk-T61-padded", "method": "dual_chunk", "T": 61},
        {"name": "string+logn-T61-padded", "method": "string", "T": 61, "logn": True},
    ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--out", default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--T", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    install_global_length()
    todo = cases(world)
    if args.only:
        todo = [c for c in todo if c["name"] in args.only]
    for c in todo:
        for k in ("heads", "kv", "hidden", "T"):
            if getattr(args, k) is not None:
                c[k] = getattr(args, k)
    results = []
    for c in todo:
        r = run_case(c, group, rank, world)
        results.append(r)
        if rank == 0:
            print(json.dumps(r), flush=True)
    if rank == 0:
        print(f"world={world} total {time.perf_counter() - t0:.1f}s", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"world": world, "results": results}, f, indent=1)
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
