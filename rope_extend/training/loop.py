"""The training loop: one function, accelerate for devices and processes, PEFT for LoRA.

    read documents -> tokenizer + model -> rope_extend.patch -> gradient checkpointing -> LoRA
    -> pack windows -> AdamW + schedule -> [resume] -> steps -> checkpoints -> adapter + merged model

Loss normalization: every optimizer step averages the token loss over all target tokens of the global
batch (all micro-batches of all processes), counted before the step; each process backpropagates
``loss_sum * processes / tokens`` because DDP averages gradients over processes. So the update does not
depend on how a global batch is split into processes and accumulation steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

import rope_extend

from . import checkpoint as ckpt
from .args import RecipeError, TrainArgs, to_dict
from .data import Batches, pack, pad_documents, read_documents, tokenize
from .loss import model_loss
from .model import build_model
from .report import write_loss_curve

logger = logging.getLogger("rope_extend.training")


@dataclass
class TrainResult:
    model: Any  # the merged model (LoRA), the trained model (full), or the PEFT model (merge_adapter=false)
    tokenizer: Any
    history: list[dict[str, float]] = field(default_factory=list)
    output_dir: Path | None = None
    final_dir: Path | None = None  # merged or full model folder
    adapter_dir: Path | None = None


def _trainable_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train(args: TrainArgs, *, on_step: Callable[[int], None] | None = None) -> TrainResult:
    """Run ``args`` to ``max_steps``. ``on_step(step)`` is called after every step (and its checkpoint)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    trackers = [] if args.report_to in ("none", [], ["none"]) else args.report_to
    accelerator = Accelerator(mixed_precision="bf16" if args.bf16 else "fp16" if args.fp16 else "no",
                              log_with=trackers or None, project_dir=args.output_dir)
    out = Path(args.output_dir)
    resume_from = ckpt.resolve_output_dir(args)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if args.overwrite_output_dir and out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / ckpt.RUN_FILE).write_text(yaml.safe_dump(to_dict(args), sort_keys=False))
    set_seed(args.seed)

    # Model: build, scale the rope, then wrap. The patch writes the scaling into model.config, so the
    # saved and merged config.json carry it.
    with accelerator.main_process_first():
        texts = read_documents(args.data)
    model, tokenizer = build_model(args.model, texts, args.seed)
    r = args.rope
    if r.method != "none":
        rope_extend.patch(model, r.method, factor=r.factor, target_length=r.target_length,
                          original_max_position_embeddings=r.original_max_position_embeddings, **r.params)
    scaling = rope_extend.patched(model)
    target = model.config.get_text_config().max_position_embeddings
    if args.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x name
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if args.lora is not None:
        from peft import LoraConfig, get_peft_model

        lora = args.lora
        model = get_peft_model(model, LoraConfig(
            r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout, bias=lora.bias,
            target_modules=lora.target_modules, modules_to_save=lora.modules_to_save, task_type="CAUSAL_LM"))
    else:
        model.requires_grad_(True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    # Data: windows of max_seq_length tokens; PoSE stretches their positions to the target length.
    # Context parallelism (accelerate ParallelismConfig cp_size, FSDP2): the cp_size processes of a group
    # share one batch and each holds a slice of its sequence; cp is the innermost mesh dimension.
    pc = getattr(accelerator, "parallelism_config", None)
    cp = pc.cp_size if pc is not None and pc.cp_enabled else 1
    if cp > 1 and args.pose.enabled:
        raise RecipeError("pose.enabled with context parallelism (cp_size > 1) is not supported: the sharded "
                          "PoSE position ids would be read as packed sequences")
    P, B, G, T = accelerator.num_processes // cp, args.per_device_train_batch_size, \
        args.gradient_accumulation_steps, args.data.max_seq_length
    rank = accelerator.process_index // cp
    if args.data.packing:
        packed = pack(tokenize(texts, tokenizer), tokenizer.eos_token_id, T, args.data.document_boundaries)
    else:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        packed = pad_documents(tokenize(texts, tokenizer), tokenizer.eos_token_id, pad_id, T)
    pose_target = (args.pose.target_length or target) if args.pose.enabled else None
    batches = Batches(packed, seed=args.seed, batch_size=B, accumulation=G, num_processes=P,
                      pose_target_length=pose_target, pose_chunks=args.pose.num_chunks)
    tokens_per_step = B * G * P * T  # e.g. 1 x 8 x 1 x 65536 = 524k tokens per step

    optimizer = torch.optim.AdamW(_trainable_groups(model, args.weight_decay), lr=args.learning_rate,
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    # Not prepared: accelerate would step a prepared scheduler once per process.
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                              num_training_steps=args.max_steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    if args.lora is not None:
        accelerator.register_save_state_pre_hook(ckpt.trainable_only_hook(trainable))
    if trackers:
        accelerator.init_trackers(out.name, config={k: str(v) for k, v in to_dict(args).items()})

    step, history = 0, []
    if resume_from is not None:
        state = ckpt.load(accelerator, resume_from)
        step, history = state["step"], state["history"]
        accelerator.print(f"resumed from {resume_from} at step {step}")
    accelerator.print(
        f"{scaling.describe() if scaling else 'rope as is'} (max_position_embeddings {target})"
        f" | {packed.input_ids.shape[0]} windows of {T} tokens | {tokens_per_step} tokens/step | "
        f"{n_trainable / 1e6:.2f}M trainable parameters | {P} process(es)")

    model.train()
    bar = tqdm(total=args.max_steps, initial=step, disable=not accelerator.is_local_main_process,
               desc="train", dynamic_ncols=True)
    clock, clock_tokens = time.perf_counter(), 0
    while step < args.max_steps:
        micro = [batches.get(step, m, rank) for m in range(G)]
        local = torch.tensor(sum(int((b["targets"] != -100).sum()) for b in micro), device=accelerator.device)
        tokens = (accelerator.reduce(local, reduction="sum") // cp).clamp_min(1)
        loss_sum = torch.zeros((), device=accelerator.device)
        for m, batch in enumerate(micro):
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            sync = contextlib.nullcontext() if m == G - 1 else accelerator.no_sync(model)
            with sync, _context_parallel(accelerator, batch, cp):
                loss, _ = model_loss(model, batch, args.loss_chunk_size)
                # gradients are averaged over all processes; each CP rank holds part of the loss sum
                accelerator.backward(loss * accelerator.num_processes / tokens)
            loss_sum += loss.detach()
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm) \
            if args.max_grad_norm > 0 else torch.tensor(float("nan"))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        clock_tokens += tokens_per_step

        if step % args.logging_steps == 0 or step == args.max_steps:
            loss_value = float(accelerator.reduce(loss_sum, reduction="sum") / tokens)
            elapsed = time.perf_counter() - clock
            row = {"step": step, "loss": loss_value, "learning_rate": lr, "grad_norm": float(grad_norm),
                   "tokens": step * tokens_per_step, "tokens_per_s": clock_tokens / max(elapsed, 1e-9)}
            history.append(row)
            clock, clock_tokens = time.perf_counter(), 0
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", lr=f"{lr:.2e}")
            if trackers:
                accelerator.log({k: v for k, v in row.items() if k != "step"}, step=step)
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss is {loss_value} at step {step}; lower learning_rate or check data")
        bar.update(1)
        if step % args.save_steps == 0 or step == args.max_steps:
            ckpt.save(accelerator, out, step, {"step": step, "history": history}, args.save_total_limit)
            if accelerator.is_main_process:
                write_loss_curve(history, out)
        if on_step is not None:
            on_step(step)
    bar.close()
    result = _finish(args, accelerator, model, tokenizer, history, out)
    if trackers:
        accelerator.end_training()
    return result


def _context_parallel(accelerator, batch: dict, cp: int):
    """Shard the sequence dimension over the CP group (no-op without context parallelism)."""
    if cp == 1:
        return contextlib.nullcontext()
    batch.pop("attention_mask", None)  # CP needs plain causal SDPA; positions run on (document_boundaries: eos)
    buffers = [batch["input_ids"], batch["position_ids"], batch["targets"]]
    return accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                              no_restore_buffers=set(buffers))


def _finish(args, accelerator, model, tokenizer, history, out: Path) -> TrainResult:
    """Write the adapter and the merged model (LoRA) or the model (full), with the tokenizer."""
    from ..io import atomic_path

    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)  # gathers FSDP shards (every process must call it)
    unwrapped = accelerator.unwrap_model(model)
    result = TrainResult(model=unwrapped, tokenizer=tokenizer, history=history, output_dir=out)
    if not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return result
    if args.lora is not None:
        with atomic_path(out / "adapter") as tmp:
            unwrapped.save_pretrained(tmp, state_dict=state_dict)
            base = unwrapped.get_base_model().config.get_text_config()
            (tmp / "rope_parameters.json").write_text(yaml.safe_dump({  # the patched base's rope settings
                "rope_parameters": base.rope_parameters, "max_position_embeddings": base.max_position_embeddings}))
            tokenizer.save_pretrained(tmp)
        result.adapter_dir = out / "adapter"
        if args.merge_adapter:
            merged = unwrapped.merge_and_unload()
            _save_model(merged, tokenizer, out / "merged")
            result.model, result.final_dir = merged, out / "merged"
    else:
        _save_model(unwrapped, tokenizer, out / "model", state_dict)
        result.final_dir = out / "model"
    accelerator.wait_for_everyone()
    return result


def _save_model(model, tokenizer, path: Path, state_dict=None) -> None:
    from ..io import atomic_path

    model.eval()
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    elif getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()
    model.config.use_cache = True
    with atomic_path(path) as tmp:
        kwargs = {"state_dict": state_dict} if state_dict is not None else {}
        model.save_pretrained(tmp, **kwargs)  # safetensors only (transformers 5 writes nothing else)
        tokenizer.save_pretrained(tmp)
        if any(p.suffix == ".bin" for p in tmp.iterdir()):
            raise RuntimeError(f"{path}: a .bin weight file was written; only safetensors are allowed")
