"""Issue 64 prototype: accelerate's own sequence-parallel path (ParallelismConfig sp_size + DeepSpeed) on the CPU.

    cd eval/reports/i64-prototype && OMP_NUM_THREADS=1 PYTHONPATH=../../..:. ACCELERATE_USE_DEEPSPEED=true \
        /work/venvs/ds/bin/python -m torch.distributed.run --nproc_per_node 2 accel_sp.py [--zero 0|1|2|3]

What it does: builds an Accelerator with a DeepSpeedPlugin and ParallelismConfig(sp_size=2, sp_backend="deepspeed"),
prepares (model, optimizer, dataloader): accelerate calls UlyssesSPAttentionHF.register_with_transformers
and wraps the dataloader in UlyssesSPDataLoaderAdapter (which shifts labels before sharding), then runs one
step and compares the loss and LoRA gradients with a 1-process reference computed on the same rank.
Prints what worked and what refused.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch
import torch.distributed as tdist

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--method", default="yarn")
    ap.add_argument("--gloo", action="store_true", help="InitProcessGroupKwargs(backend='gloo'): accelerate's world right")
    ap.add_argument("--from-env", action="store_true", help="plugin and ParallelismConfig from the launcher config")
    ap.add_argument("--no-dl", action="store_true", help="prepare(model, optimizer) only, as rope-extend's loop does")
    ap.add_argument("--set-mbs", action="store_true", help="with --no-dl: set train_micro_batch_size_per_gpu first")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedPlugin, DeepSpeedSequenceParallelConfig

    from proto_common import install_global_length, global_length, lora_grads, make_batch, tiny_model
    from rope_extend.training.loss import model_loss

    report = {"zero": args.zero, "method": args.method}
    t0 = time.perf_counter()
    ds = DeepSpeedPlugin(zero_stage=args.zero, gradient_accumulation_steps=1, gradient_clipping=0.0)
    pc = ParallelismConfig(
        sp_size=2,
        sp_backend="deepspeed",
        sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa", sp_seq_length_is_variable=True),
    )
    from accelerate.utils import InitProcessGroupKwargs

    handlers = [InitProcessGroupKwargs(backend="gloo")] if args.gloo else None
    if args.from_env:
        acc = Accelerator(kwargs_handlers=handlers)
        pc = acc.parallelism_config
    else:
        acc = Accelerator(deepspeed_plugin=ds, parallelism_config=pc, kwargs_handlers=handlers)
    report["parallelism"] = f"sp_size={pc.sp_size if pc else None} sp_backend={pc.sp_backend if pc else None}"
    report["accelerator"] = (
        f"{acc.distributed_type} device={acc.device} num_processes={acc.num_processes} "
        f"process_index={acc.process_index} torch_world={tdist.get_world_size()} rank={tdist.get_rank()}"
    )

    T = 64
    batch = make_batch(T, seed=0)
    total = int((batch["targets"] != -100).sum())
    # 1-process reference, on this rank, before anything is registered
    ref = tiny_model(args.method)
    loss_ref, _ = model_loss(ref, batch, 16)
    (loss_ref / total).backward()
    ref_grads = lora_grads(ref)

    model = tiny_model(args.method)
    if model.config._attn_implementation != "sdpa":
        report["note"] = f"model attn {model.config._attn_implementation}: accelerate's handler allows only sdpa/fa2/fa3"
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    rows = [{"input_ids": batch["input_ids"][0], "position_ids": batch["position_ids"][0],
             "labels": batch["input_ids"][0]}]  # the adapter shifts labels itself (shift_labels) before sharding
    dl = torch.utils.data.DataLoader(rows, batch_size=1)
    if args.set_mbs:
        acc.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
    try:
        if args.no_dl:
            model, opt = acc.prepare(model, opt)
        else:
            model, opt, dl = acc.prepare(model, opt, dl)
    except Exception as exc:
        report["prepare_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        if acc.is_main_process:
            print(json.dumps(report))
        return
    report["prepared"] = f"{type(model).__name__}, {type(dl).__name__}, {time.perf_counter() - t0:.1f}s"
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

    group = mpu.get_sequence_parallel_group()
    if args.no_dl:  # rope-extend's way: the rank slices its shard of the (already shifted) window itself
        from proto_common import shard

        b = shard(batch, mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_world_size())
        b.pop("attention_mask", None)
        report["local_len"] = int(b["input_ids"].shape[1])
    else:
        local = next(iter(dl))
        report["local_keys"] = sorted(local)
        report["local_len"] = int(local["input_ids"].shape[1])
        targets = local["shift_labels"]
        b = {"input_ids": local["input_ids"], "position_ids": local["position_ids"], "targets": targets}
    install_global_length()
    with global_length(group):
        loss_sum, _ = model_loss(model, b, 16)
    # DeepSpeed's engine sums gradients over the SP ranks and averages over data-parallel replicas only
    # (world / sp): scale by that, not by accelerate's num_processes (measured: num_processes gives 2x gradients)
    dp = acc.num_processes // pc.sp_size
    report["backward_scale"] = f"loss_sum * {dp} / tokens"
    # engine.backward, not acc.backward: accelerate's wrapper also steps the engine, which zeroes the gradients
    model.backward(loss_sum * dp / total)
    grads = {}
    for n, p in model.module.named_parameters() if hasattr(model, "module") else model.named_parameters():
        if p.requires_grad:
            g = p.grad
            if g is None:
                from deepspeed.utils import safe_get_full_grad

                g = safe_get_full_grad(p)
            grads[n] = None if g is None else g.detach().clone()
    missing = [n for n, g in grads.items() if g is None]
    report["grads_missing"] = len(missing)
    if not missing:
        gd = max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads)
        report["grad_maxdiff_vs_1p"] = gd
    ls = loss_sum.detach().clone()
    tdist.all_reduce(ls, group=group)
    report["loss_1p"] = float(loss_ref) / total
    report["loss_sp"] = float(ls) / total
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
