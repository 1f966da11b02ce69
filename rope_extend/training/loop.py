"""The training runner: ``setup`` builds everything a run needs, ``train`` is the one loop, ``finish`` saves.

    setup:  accelerator -> output folder -> documents -> model (+ rope patch, checkpointing, LoRA)
            -> windows and batches -> LM head (checked) -> AdamW + schedule -> accelerate.prepare -> [resume]
    train:  steps of G micro-batches -> clip -> step -> log -> checkpoint
    finish: the adapter and the merged model (LoRA), or the model (full), with the tokenizer

Loss normalization: every optimizer step averages the token loss over all target tokens of the global
batch (all micro-batches of all processes), counted before the step; each process backpropagates
``loss_sum * processes / tokens`` because DDP averages gradients over processes (DeepSpeed's engine: over the
processes ``engine.averaged`` names). So the update does not depend on how a global batch is split into processes
and accumulation steps, nor on the launcher (``engine``: DeepSpeed's batch, accumulation and clipping).
"""

from __future__ import annotations

import json
import logging
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..hf import checkpointing, tiling
from ..hf.head import LMHead, check, lm_head
from ..io import atomic_path
from ..patching import patched
from . import checkpoint as ckpt
from . import engine, parallel
from .args import RecipeError, TrainArgs, to_dict
from .data import Batches, pack, pad_documents, passkey_windows, read_documents, tokenize, with_passkey_windows
from .loss import model_loss
from .mixed import MixedBatches, mixed_batches, rope_for
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


@dataclass
class Run:
    """Everything ``setup`` builds for the loop."""

    args: TrainArgs
    accelerator: Any
    model: Any
    tokenizer: Any
    head: LMHead
    optimizer: Any
    scheduler: Any
    batches: Batches | MixedBatches
    out: Path
    layout: parallel.Layout  # processes that share a sequence (sequence or context parallelism) and this one's place
    tokens_per_step: int
    trackers: list[str]
    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    pending_loss: Any = None  # this process's loss sum since the last logged step (a tensor)
    pending_tokens: int = 0  # the global target tokens since the last logged step
    ulysses: Any = None  # the installed sequence-parallel attention (``parallel.install``), removed by ``finish``


# ------------------------------------------------------------------------------------------ setup
def _setup_accelerator(args: TrainArgs):
    from accelerate import Accelerator

    trackers = [] if args.report_to in ("none", [], ["none"]) else args.report_to
    accelerator = Accelerator(
        mixed_precision=engine.mixed_precision(args),  # the recipe's, refused where the launcher asks another
        log_with=trackers or None,
        project_dir=args.output_dir,
        kwargs_handlers=engine.backend_kwargs(),
        parallelism_config=engine.sequence_parallel_config(args),  # parallel.sequence under DeepSpeed: accelerate's
    )
    engine.configure(accelerator, args)  # DeepSpeed's batch, accumulation and clipping: the recipe's
    return accelerator, list(trackers) if isinstance(trackers, list) else [trackers]


def _setup_model(args: TrainArgs, texts: list[str]):
    """The model with its rope scaled (the patch writes it into model.config, so the saved and merged
    config.json carry it), activation checkpointing, and LoRA or full training."""
    model, tokenizer = build_model(args.model, texts, args.seed)
    with engine.gathered(model):  # ZeRO-3 built it partitioned; the attention methods run the decoder to patch
        args.rope.apply(model)
    scaling = patched(model)
    if args.gradient_checkpointing:
        checkpointing.enable(model)
    model.config.use_cache = False
    if args.lora is not None:
        from peft import LoraConfig, get_peft_model

        lora = args.lora
        tying = _weight_tying(model, lora.modules_to_save)
        with warnings.catch_warnings():
            # PEFT reads the old name `is_gradient_checkpointing`, which transformers 5 deprecates at every run;
            # checkpointing itself goes through hf.checkpointing under the new name
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = get_peft_model(
                model,
                LoraConfig(
                    r=lora.r,
                    lora_alpha=lora.lora_alpha,
                    lora_dropout=lora.lora_dropout,
                    bias=lora.bias,
                    # copies: PEFT appends to modules_to_save (ensure_weight_tying adds the tied head's name), and
                    # the recipe saved in run_config.yaml must stay what the user wrote, or resume sees a change
                    target_modules=_copy(lora.target_modules),
                    modules_to_save=_copy(lora.modules_to_save),
                    task_type="CAUSAL_LM",
                    **tying,
                ),
            )
        if tying and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            raise RecipeError(
                "lora.modules_to_save: the model ties its input and output embeddings, and PEFT did not keep the "
                "trained copy tied; leave embed_tokens out of modules_to_save or upgrade peft"
            )
    else:
        model.requires_grad_(True)
    return model, tokenizer, scaling


def _copy(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def _weight_tying(model, modules_to_save: list[str] | None) -> dict:
    """``{"ensure_weight_tying": True}`` when the model ties its input and output embeddings (SmolLM2, Gemma,
    Qwen small) and ``modules_to_save`` trains one of them: without it PEFT trains a copy of the input
    embedding while the head keeps the original, and the merged model is saved untied (a second vocabulary-
    sized matrix, and a head that never trained). Empty otherwise."""
    from peft import LoraConfig

    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if not tied or out is None or out.weight is not inp.weight or not modules_to_save:
        return {}
    names = {name for name, module in model.named_modules() if module is inp or module is out}
    if not any(name == key or name.endswith("." + key) for name in names for key in modules_to_save):
        return {}
    if "ensure_weight_tying" not in LoraConfig.__dataclass_fields__:
        import peft

        raise RecipeError(
            f"lora.modules_to_save: {modules_to_save} trains the embedding that this model ties to its output, "
            f"which needs LoraConfig(ensure_weight_tying=True); peft {peft.__version__} does not have it: "
            "upgrade peft, or leave embed_tokens out of modules_to_save"
        )
    return {"ensure_weight_tying": True}


def _setup_data(args: TrainArgs, texts: list[str], tokenizer, target: int, processes: int) -> Batches:
    """Windows of max_seq_length tokens (packed, or one padded document each); PoSE stretches their positions."""
    if args.data.packing:
        packed = pack(
            tokenize(texts, tokenizer), tokenizer.eos_token_id, args.data.max_seq_length, args.data.document_boundaries
        )
    else:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        packed = pad_documents(tokenize(texts, tokenizer), tokenizer.eos_token_id, pad_id, args.data.max_seq_length)
    share = args.data.passkey_share
    if share > 0:
        count = max(1, round(packed.input_ids.shape[0] * share / (1 - share)))
        rows = passkey_windows(tokenizer, texts, count, args.data.max_seq_length, args.seed)
        packed = with_passkey_windows(packed, rows)
    pose_target = (args.pose.target_length or target) if args.pose.enabled else None
    return Batches(
        packed,
        seed=args.seed,
        batch_size=args.per_device_train_batch_size,
        accumulation=args.gradient_accumulation_steps,
        num_processes=processes,
        pose_target_length=pose_target,
        pose_chunks=args.pose.num_chunks,
    )


def _setup_optimizer(args: TrainArgs, model):
    """AdamW (decay on matrices only) and the schedule, which is not prepared: accelerate would step a
    prepared scheduler once per process."""
    from transformers import get_scheduler

    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(
        groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon
    )
    scheduler = get_scheduler(
        args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=args.max_steps
    )
    return optimizer, scheduler


def setup(args: TrainArgs) -> Run:
    from accelerate.utils import set_seed

    accelerator, trackers = _setup_accelerator(args)
    # Context parallelism (accelerate ParallelismConfig cp_size, FSDP2) or sequence parallelism (parallel.sequence):
    # groups of processes share one batch and each holds a slice of its sequence
    pc = getattr(accelerator, "parallelism_config", None)
    cp = pc.cp_size if pc is not None and pc.cp_enabled else 1
    layout = parallel.layout(args, accelerator.num_processes, accelerator.process_index, cp)
    resume_from = ckpt.resolve_output_dir(args)  # checks only: nothing is written before everything is checked
    set_seed(args.seed)
    with accelerator.main_process_first():
        texts = read_documents(args.data)
    model, tokenizer, scaling = _setup_model(args, texts)
    target = model.config.get_text_config().max_position_embeddings

    processes = layout.data_parallel
    plain = _setup_data(args, texts, tokenizer, target, processes)
    # short micro-batches with the original rope (LongRoPE2), in the same steps
    batches: Batches | MixedBatches = mixed_batches(args, plain, model) if args.mixed.enabled else plain
    # The loss applies the LM head itself (chunked): it must compute the logits the model computes.
    with engine.gathered(model):  # ZeRO-3 built the model partitioned
        check(model, lm_head(model), batches.packed.input_ids[0].tolist())
    parallel.check(model, args, layout)  # a model sequence parallelism cannot serve is refused before any write
    engine.check_model(accelerator, model, args)
    if args.memory.tiled_mlp:  # after the check, which compares the model's own logits with the head's
        tiling.tile_mlps(model, args.memory.mlp_tiles, processes=engine.tiling_processes(accelerator))

    optimizer, scheduler = _setup_optimizer(args, model)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if accelerator.is_main_process:  # the data, the model and the rope settings all passed: now write
        ckpt.prepare_output_dir(args, resume_from)
    accelerator.wait_for_everyone()
    # accelerate's DeepSpeed sequence parallelism installs Ulysses in prepare: what it changes is recorded first
    expected = parallel.expect(model, args, layout) if engine.sequence_parallel(accelerator) else None
    model, optimizer = accelerator.prepare(model, optimizer)
    out = Path(args.output_dir)
    if trackers:
        accelerator.init_trackers(out.name, config={k: str(v) for k, v in to_dict(args).items()})
    T = args.data.max_seq_length
    run = Run(
        args,
        accelerator,
        model,
        tokenizer,
        lm_head(model),
        optimizer,
        scheduler,
        batches,
        out,
        layout=layout,
        trackers=trackers,
        tokens_per_step=args.per_device_train_batch_size * args.gradient_accumulation_steps * processes * T,
    )
    if resume_from is not None:
        state = ckpt.load(accelerator, resume_from, model=model, optimizer=optimizer, scheduler=scheduler)
        run.step, run.history = state["step"], state["history"]
        pending = state.get("pending") or {}
        if pending and accelerator.process_index == 0:  # the saved sum is over every process: one carries it
            run.pending_loss = torch.tensor(float(pending["loss"]), device=accelerator.device)
        run.pending_tokens = int(pending.get("tokens", 0))
        accelerator.print(f"resumed from {resume_from} at step {run.step}")
    accelerator.print(
        f"{scaling.describe() if scaling else 'rope as is'} (max_position_embeddings {target})"
        f" | {batches.windows} windows of {T} tokens | {run.tokens_per_step} tokens/step | "
        f"{n_trainable / 1e6:.2f}M trainable parameters | {processes} process(es)"
        + (f" x {layout.degree} per sequence (parallel.sequence)" if layout.kind == "sequence" else "")
    )
    # last, so that nothing in setup can fail with it installed: it changes transformers' attention registry for
    # the whole process until ``finish`` (or ``train``'s clean-up on an error) removes it
    run.ulysses = expected or parallel.install(model, args, layout)
    return run


# ------------------------------------------------------------------------------------------ the loop
def train(args: TrainArgs, *, on_step: Callable[[int], None] | None = None) -> TrainResult:
    """Run ``args`` to ``max_steps``. ``on_step(step)`` is called after every step (and its checkpoint)."""
    run = setup(args)
    try:
        return _train(run, on_step)
    finally:  # an error mid-run must not leave the process's attention registry wrapped (finish removes it too)
        parallel.remove(run.ulysses)
        run.ulysses = None


def _train(run: Run, on_step: Callable[[int], None] | None) -> TrainResult:
    from ..progress import bar as progress_bar

    args, acc, model = run.args, run.accelerator, run.model
    model.train()
    bar = progress_bar(
        total=args.max_steps, initial=run.step, disable=not acc.is_local_main_process, desc="train", dynamic_ncols=True
    )
    clock, clock_tokens = time.perf_counter(), 0
    # the logged loss is the token-weighted mean over the logging interval (one step's loss zig-zags): the sums
    # stay on the device, reduced over processes at logging time; a checkpoint inside an interval keeps them
    run.pending_loss = (run.pending_loss if run.pending_loss is not None else torch.zeros(())).to(acc.device)
    while run.step < args.max_steps:
        loss_sum, tokens, grad_norm, lr = _step(run)
        run.step += 1
        clock_tokens += run.tokens_per_step
        run.pending_loss += loss_sum
        run.pending_tokens += int(tokens)

        if run.step % args.logging_steps == 0 or run.step == args.max_steps:
            loss_value = float(acc.reduce(run.pending_loss, reduction="sum")) / max(run.pending_tokens, 1)
            run.pending_loss, run.pending_tokens = torch.zeros((), device=acc.device), 0
            elapsed = time.perf_counter() - clock
            row = {
                "step": run.step,
                "loss": loss_value,
                "learning_rate": lr,
                "grad_norm": float(grad_norm),
                "tokens": run.step * run.tokens_per_step,
                "tokens_per_s": clock_tokens / max(elapsed, 1e-9),
            }
            run.history.append(row)
            clock, clock_tokens = time.perf_counter(), 0
            # shown by the update below (a refresh here too would print every logged step twice in a log)
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", lr=f"{lr:.2e}", refresh=False)
            if run.trackers:
                acc.log({k: v for k, v in row.items() if k != "step"}, step=run.step)
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss is {loss_value} at step {run.step}; lower learning_rate or check data")
        bar.update(1)
        if run.step % args.save_steps == 0 or run.step == args.max_steps:
            pending = {
                "loss": float(acc.reduce(run.pending_loss.clone(), reduction="sum")),
                "tokens": run.pending_tokens,
            }
            ckpt.save(
                acc,
                {"step": run.step, "history": run.history, "pending": pending},
                output_dir=run.out,
                step=run.step,
                model=model,
                optimizer=run.optimizer,
                scheduler=run.scheduler,
                limit=args.save_total_limit,
            )
            if acc.is_main_process:
                write_loss_curve(run.history, run.out)
        if on_step is not None:
            on_step(run.step)
    bar.close()
    result = finish(run)
    if run.trackers:
        acc.end_training()
    return result


def _step(run: Run) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """One optimizer step over the global batch of step ``run.step``: ``(loss sum, target tokens, gradient
    norm, the learning rate it used)``; the loss sum stays on the device."""
    args, acc, model, G = run.args, run.accelerator, run.model, run.args.gradient_accumulation_steps
    micro = [run.batches.get(run.step, m, run.layout.rank) for m in range(G)]
    # the whole global batch's target tokens, counted first: each micro-batch's loss is divided by it
    local = torch.tensor(sum(int((b["targets"] != -100).sum()) for b in micro), device=acc.device)
    tokens = (acc.reduce(local, reduction="sum") // run.layout.degree).clamp_min(1)  # each shard counted the window
    loss_sum = torch.zeros((), device=acc.device)
    on_graph = engine.hooks_module_outputs(acc)
    for m, batch in enumerate(micro):
        batch = {k: v.to(acc.device) for k, v in batch.items()}
        # all-reduce once per step (under DeepSpeed: the engine steps after the last micro-batch)
        with (
            engine.micro_batch(acc, model, m == G - 1),
            rope_for(run.batches, batch),
            parallel.sharded(acc, batch, run.layout) as batch,
        ):
            loss, _ = model_loss(model, batch, args.loss_chunk_size, run.head, head_output_on_graph=on_graph)
            # DDP (and DeepSpeed) average gradients over processes, and each shard holds part of the loss sum
            scale = engine.averaged(acc, run.layout.degree) / tokens
            acc.backward(loss * scale, **(engine.BACKWARD if engine.active(acc) else {}))
        loss_sum += loss.detach()
    grad_norm = (
        acc.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        if args.max_grad_norm > 0
        else torch.tensor(float("nan"))
    )
    lr = run.scheduler.get_last_lr()[0]  # the rate this step used
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return loss_sum, tokens, grad_norm, lr


# ------------------------------------------------------------------------------------------ finish
def finish(run: Run) -> TrainResult:
    """Write the adapter and the merged model (LoRA) or the model (full), with the tokenizer."""
    args, accelerator, out = run.args, run.accelerator, run.out
    accelerator.wait_for_everyone()
    parallel.remove(run.ulysses)  # the saved and merged model runs in one process
    run.ulysses = None
    state_dict = accelerator.get_state_dict(run.model)  # gathers FSDP shards (every process must call it)
    unwrapped = accelerator.unwrap_model(run.model)
    tiling.untile(unwrapped)  # the returned and saved model runs its MLPs plainly
    result = TrainResult(model=unwrapped, tokenizer=run.tokenizer, history=run.history, output_dir=out)
    if not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return result
    if args.lora is not None:
        with atomic_path(out / "adapter") as tmp:
            unwrapped.save_pretrained(tmp, state_dict=state_dict)
            base = unwrapped.get_base_model().config.get_text_config()
            (tmp / "rope_parameters.json").write_text(
                json.dumps(
                    {  # the patched base's rope settings
                        "rope_parameters": base.rope_parameters,
                        "max_position_embeddings": base.max_position_embeddings,
                    },
                    indent=1,
                    default=str,
                )
            )
            run.tokenizer.save_pretrained(tmp)
        result.adapter_dir = out / "adapter"
        if args.merge_adapter:
            merged = unwrapped.merge_and_unload()
            _save_model(merged, run.tokenizer, out / "merged")
            result.model, result.final_dir = merged, out / "merged"
    else:
        _save_model(unwrapped, run.tokenizer, out / "model", state_dict)
        result.final_dir = out / "model"
    accelerator.wait_for_everyone()
    return result


def _save_model(model, tokenizer, path: Path, state_dict=None) -> None:
    model.eval()
    checkpointing.disable(model)
    model.config.use_cache = True
    with atomic_path(path) as tmp:
        kwargs = {"state_dict": state_dict} if state_dict is not None else {}
        model.save_pretrained(tmp, **kwargs)  # safetensors only (transformers 5 writes nothing else)
        tokenizer.save_pretrained(tmp)
        if any(p.suffix == ".bin" for p in tmp.iterdir()):
            raise RuntimeError(f"{path}: a .bin weight file was written; only safetensors are allowed")
