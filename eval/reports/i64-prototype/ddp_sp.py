"""Issue 64 prototype: the path proposed for rope-extend's loop. accelerate's plain multi-process launcher (DDP over
gloo on the CPU, NCCL on GPUs), DeepSpeed's UlyssesSPAttentionHF put under the model's attention key by rope-extend,
rope-extend's own batches sharded by rank (targets shifted before sharding), the dynamic methods' global length,
and the loop's loss scaling ``loss_sum * num_processes / tokens`` (tokens = the global batch's targets).

    cd eval/reports/i64-prototype && OMP_NUM_THREADS=1 PYTHONPATH=../../..:. ACCELERATE_USE_CPU=1 \
        /work/venvs/ds/bin/python -m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1 \
        --mixed_precision no --dynamo_backend no ddp_sp.py

(``--multi_gpu`` with ACCELERATE_USE_CPU=1 is how accelerate 1.15 starts 2 CPU processes, as tests/training does.)
With ``--dp`` 4 processes run as 2 data-parallel groups x sequence 2.
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
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--methods", nargs="*", default=[None, "yarn", "dynamic", "self_extend", "string"])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # reuses torch.distributed's default group (already up)
    import deepspeed.comm as dist

    from proto_common import global_length, install_global_length, lora_grads, make_batch, shard, tiny_model, ulysses
    from rope_extend.training.loss import model_loss

    world, rank, sp = acc.num_processes, acc.process_index, args.sp
    dp = world // sp
    # SP groups: consecutive ranks (DeepSpeed's parallel_state_sp layout); one new_group call per group on every rank
    groups = [dist.new_group(list(range(g * sp, (g + 1) * sp))) for g in range(dp)]
    group, dp_rank, sp_rank = groups[rank // sp], rank // sp, rank % sp
    install_global_length()
    out = []
    for method in args.methods:
        method = None if method in (None, "none") else method
        T = 64
        # the global batch of a step: one window per data-parallel group (seed = step, dp rank)
        ref = tiny_model(method)
        model = tiny_model(method)
        opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        model, opt = acc.prepare(model, opt)
        impl = acc.unwrap_model(model).config._attn_implementation
        worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
        t_sp = 0.0
        for step in range(args.steps):
            batches = [make_batch(T, seed=100 * step + d) for d in range(dp)]
            tokens = sum(int((b["targets"] != -100).sum()) for b in batches)
            # reference: 1 process, every window of the step, summed loss / tokens
            ref_loss = sum(model_loss(ref, b, 16)[0] for b in batches)
            (ref_loss / tokens).backward()
            ref_grads = lora_grads(ref)
            opt_ref.step()
            opt_ref.zero_grad()
            # sequence parallel: this rank's shard of its group's window
            local = shard(batches[dp_rank], sp_rank, sp)
            t0 = time.perf_counter()
            with ulysses(acc.unwrap_model(model).config, impl, group), global_length(group):
                loss_sum, _ = model_loss(model, local, 16)
                acc.backward(loss_sum * world / tokens)  # DDP averages over all `world` processes
            t_sp += time.perf_counter() - t0
            grads = lora_grads(acc.unwrap_model(model))
            total = acc.reduce(loss_sum.detach().clone(), reduction="sum")
            worst["loss"] = max(worst["loss"], abs(float(total) - float(ref_loss)) / tokens)
            worst["grad"] = max(worst["grad"], max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads))
            opt.step()
            opt.zero_grad()
            params = {n: p for n, p in acc.unwrap_model(model).named_parameters() if p.requires_grad}
            worst["param"] = max(
                worst["param"],
                max(float((params[n] - p).abs().max()) for n, p in ref.named_parameters() if p.requires_grad),
            )
        row = {"method": method or "plain", "impl": impl, "world": world, "dp": dp, "sp": sp, "steps": args.steps,
               "max_loss_diff": worst["loss"], "max_grad_diff": worst["grad"], "max_param_diff": worst["param"],
               "s_per_step_sp": round(t_sp / args.steps, 3)}
        out.append(row)
        if acc.is_main_process:
            print(json.dumps(row), flush=True)
    acc.wait_for_everyone()


if __name__ == "__main__":
    main()
