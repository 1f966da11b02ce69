"""Checkpoints in safetensors and JSON only: resuming a run never unpickles anything.

``output_dir/checkpoint-<step>/``:

- ``trainer_state.json``: the step (which fixes the data position), the loss history, the scheduler's and
  the fp16 grad scaler's state (plain numbers), the number of processes, the format;
- ``model.safetensors``: the trainable tensors by parameter name (LoRA: the adapter and modules_to_save;
  full fine-tuning: every parameter); with sharded parameters (FSDP2) one file per process,
  ``model-rank<r>.safetensors``, holding its shard;
- ``optimizer.json`` (hyper-parameters) and ``optimizer-rank<r>.safetensors`` (AdamW's moments and steps);
- ``rng-rank<r>.safetensors`` and ``rng-rank<r>.json``: the torch (CPU and CUDA), Python and NumPy
  generators of every process.

A checkpoint is written under a temporary name and renamed into place once every process has written
its part, so a folder named ``checkpoint-*`` is always complete; ``latest`` is the highest step.

DeepSpeed keeps its own partitioned state, which only accelerate's ``save_state`` can write, and that
pickles; such checkpoints (and those of earlier rope-extend versions) are resumed only with
``trust_pickled_checkpoint: true``, since unpickling a file can run any code. The loop's learning-rate schedule is
not prepared, so ``save_state`` does not hold it: its state goes into ``trainer_state.json`` beside them.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors.torch import load_file, save_file

from ..errors import shown
from ..io import atomic_path, claim_output_dir, finish_swap
from ..untrusted import read_object
from ..yaml_loader import read_yaml
from .args import RecipeError, TrainArgs, to_dict

PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"
RUN_FILE = "run_config.yaml"
FORMAT = "rope-extend-safetensors-1"
PICKLED = "accelerate-pickle"
MAX_STATE = 1 << 28  # bytes of a checkpoint's JSON: a loss history of a million steps is well under it
# recipe keys that may differ between a run and its resumption
RESUME_KEYS = ("resume_from_checkpoint", "overwrite_output_dir", "resume_allow_changes", "trust_pickled_checkpoint")


def checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest first."""
    out = Path(output_dir)
    found = [p for p in out.glob(f"{PREFIX}*") if p.is_dir() and re.fullmatch(rf"{PREFIX}\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def latest(output_dir: str | Path) -> Path | None:
    found = checkpoints(output_dir)
    return found[-1] if found else None


def owned(tracker_folder: str):
    """The entries a training run writes into its output folder (the rest is not rope-extend's to remove)."""
    names = {RUN_FILE, "loss.csv", "loss.png", "adapter", "merged", "model", tracker_folder}
    return lambda name: name in names or re.fullmatch(rf"{PREFIX}\d+", name) is not None


def _differences(saved: Any, now: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(now, dict):
        out = []
        for key in sorted(set(saved) | set(now), key=str):
            if not prefix and key in RESUME_KEYS:
                continue
            out += _differences(saved.get(key), now.get(key), f"{prefix}{key}.")
        return out
    return [] if saved == now else [f"{prefix.rstrip('.')} ({shown(saved, 80)} -> {shown(now, 80)})"]


def _saved_recipe(run_file: Path) -> dict:
    """The recipe a run saved (``RUN_FILE``), read as the one YAML reader reads (``yaml_loader.read_yaml``: a
    regular file of at most a few MiB, valid YAML, a mapping), never through a link: rope-extend wrote it there,
    so a link or anything else in its place is refused in one line, and the run is not resumed."""
    fix = (
        "rope-extend saves the recipe there when a run starts; put back the run's own file, or pass "
        "resume_allow_changes=true to resume with this recipe"
    )
    return read_yaml(run_file, what="the saved recipe", error=RecipeError, follow_links=False, fix=fix)


def read_state(path: Path, name: str = STATE_FILE) -> dict:
    """A JSON object from the checkpoint ``path`` (its ``trainer_state.json`` unless ``name``): a regular file of
    at most ``MAX_STATE`` bytes, UTF-8, JSON (``untrusted``), not a link (rope-extend wrote it; the checkpoint's
    folder itself may be reached through one). Damage is one ``RecipeError`` naming the file."""
    fix = "a checkpoint rope-extend wrote is not damaged; resume from another checkpoint, or start again"
    return read_object(path / name, limit=MAX_STATE, follow_links=False, fix=fix, error=RecipeError)


def resolve_output_dir(args: TrainArgs) -> Path | None:
    """Check ``output_dir`` against the overwrite/resume keys; return the checkpoint to resume, or None.

    Touches nothing (every process calls it before any work): a folder holding files rope-extend did not
    write is refused whatever the keys; an earlier run is kept unless ``resume_from_checkpoint`` or
    ``overwrite_output_dir`` says what to do; resuming with a changed recipe is refused, naming the keys
    that differ, unless ``resume_allow_changes``.
    """
    out = Path(args.output_dir)
    data = args.data.path if isinstance(args.data.path, list) else [args.data.path]
    for item in data:
        if isinstance(item, str) and Path(item).exists() and out.resolve() in Path(item).resolve().parents:
            raise RecipeError(
                f"data.path {item} is inside output_dir {out}: a run must not write where its data "
                "lives; give another output_dir"
            )
    resume = args.resume_from_checkpoint
    claim_output_dir(
        out,
        kind="train",
        owned=owned(out.name),
        resume=bool(resume),
        overwrite=args.overwrite_output_dir,
        what="output_dir",
        check_only=True,
        error=RecipeError,
        how="pass resume_from_checkpoint=true to continue it or overwrite_output_dir=true to replace it",
    )
    if not resume:
        return None
    if isinstance(resume, str):
        path = Path(resume)
        if not (path / STATE_FILE).is_file():
            raise RecipeError(f"resume_from_checkpoint: {path} is not a checkpoint folder (no {STATE_FILE})")
    else:
        found = latest(out)
        if found is None:
            raise RecipeError(f"resume_from_checkpoint: no {PREFIX}* folder in {out} to resume from")
        path = found
    run_file = path.parent / RUN_FILE
    if os.path.lexists(run_file) and not args.resume_allow_changes:
        changed = _differences(_saved_recipe(run_file), to_dict(args))
        if changed:
            raise RecipeError(
                f"resuming {path} with a changed recipe: {'; '.join(changed[:6])}"
                f"{'; ...' if len(changed) > 6 else ''}. Resume with the recipe the run started with, "
                "or pass resume_allow_changes=true to continue with the new one"
            )
    state = read_state(path)
    if state.get("format") != FORMAT and not args.trust_pickled_checkpoint:
        raise RecipeError(
            f"{path} was written by accelerate's save_state (pickle files), which can run code when "
            "loaded; resume it only if you trust its origin, with trust_pickled_checkpoint=true"
        )
    return path


def prepare_output_dir(args: TrainArgs, resume_from: Path | None) -> None:
    """Claim ``output_dir`` (main process, after every check passed): mark it, remove an overwritten run's
    entries and the temporaries of an interrupted checkpoint write, record the recipe."""
    out = Path(args.output_dir)
    claim_output_dir(
        out,
        kind="train",
        owned=owned(out.name),
        resume=resume_from is not None,
        overwrite=args.overwrite_output_dir,
        what="output_dir",
    )
    for leftover in out.glob(f".{PREFIX}*"):
        if leftover.is_dir() and (leftover.name.endswith(".tmp") or ".old-" in leftover.name):
            finish_swap(leftover)  # a checkpoint replaced half-way is put in place before its temporary goes
            shutil.rmtree(leftover, ignore_errors=True)
    run_file = out / RUN_FILE
    if resume_from is not None and run_file.is_file():
        if not args.resume_allow_changes:
            return  # the run goes on with the recipe it started with
        shutil.copy2(run_file, out / f"run_config.before-step-{resume_from.name[len(PREFIX) :]}.yaml")
    with atomic_path(run_file) as tmp:
        tmp.write_text(yaml.safe_dump(to_dict(args), sort_keys=False), encoding="utf-8")


# ------------------------------------------------------------------------------------------ tensors
def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's own data: the local shard of a DTensor (FSDP2), on the CPU, contiguous."""
    local = getattr(t, "to_local", None)
    return (local() if callable(local) else t).detach().cpu().contiguous()


def _sharded(model) -> bool:
    return any(callable(getattr(p, "to_local", None)) for p in model.parameters())


def _trainable(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    version, state, gauss = random.getstate()
    legacy = np.random.get_state()  # the global RandomState is an MT19937: its legacy state is a tuple
    if not isinstance(legacy, tuple):
        raise RecipeError(f"numpy's global random state is not MT19937's tuple ({type(legacy).__name__})")
    name, keys, pos, has_gauss, cached = legacy
    return tensors, {"python": [version, list(state), gauss], "numpy": [name, keys.tolist(), pos, has_gauss, cached]}


def _set_rng_state(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    version, state, gauss = plain["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _scheduler_state(scheduler) -> dict[str, Any]:
    state = scheduler.state_dict()
    try:
        json.dumps(state)
    except TypeError:  # a scheduler with callable state: keep the step; it is rebuilt by stepping
        state = {"last_epoch": scheduler.last_epoch, "rebuild": True}
    return state


def _load_scheduler(scheduler, state: dict[str, Any]) -> None:
    if state.get("rebuild"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "step() before optimizer.step()": intended here
            while scheduler.last_epoch < state["last_epoch"]:
                scheduler.step()
    else:
        scheduler.load_state_dict(state)


# ------------------------------------------------------------------------------------------ save / load
def save(
    accelerator,
    run_state: dict[str, Any],
    *,
    output_dir: str | Path,
    step: int,
    model,
    optimizer,
    scheduler,
    limit: int | None,
) -> Path:
    """Write ``checkpoint-<step>`` atomically from every process; keep the newest ``limit``."""
    from accelerate.utils import DistributedType, broadcast_object_list

    final = Path(output_dir) / f"{PREFIX}{step}"
    rank = accelerator.process_index
    holder: list[str | None] = [None]
    with atomic_path(final) if accelerator.is_main_process else _nothing() as tmp:
        if accelerator.is_main_process:
            tmp.mkdir()
            holder = [str(tmp)]
        broadcast_object_list(holder)
        if holder[0] is None:  # broadcast_object_list fills it from the main process on every other one
            raise RecipeError(f"checkpoint {final}: the main process did not share its temporary folder")
        folder = Path(holder[0])
        state = {**run_state, "format": FORMAT, "processes": accelerator.num_processes}
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            accelerator.save_state(str(folder))
            state["format"] = PICKLED
            # the schedule is the loop's own (not prepared), so save_state does not hold it
            state["scheduler"] = _scheduler_state(scheduler)
        else:
            unwrapped = accelerator.unwrap_model(model)
            sharded = _sharded(unwrapped)
            if sharded or accelerator.is_main_process:
                tensors = {n: _local(p) for n, p in _trainable(unwrapped).items()}
                save_file(tensors, str(folder / (f"model-rank{rank}.safetensors" if sharded else "model.safetensors")))
            opt = optimizer.state_dict()
            save_file(
                {f"{i}.{k}": _local(v) for i, entry in opt["state"].items() for k, v in entry.items()},
                str(folder / f"optimizer-rank{rank}.safetensors"),
            )
            rng_tensors, rng_plain = _rng_state()
            save_file(rng_tensors, str(folder / f"rng-rank{rank}.safetensors"))
            (folder / f"rng-rank{rank}.json").write_text(json.dumps(rng_plain))
            if accelerator.is_main_process:
                (folder / "optimizer.json").write_text(json.dumps({"param_groups": opt["param_groups"]}, indent=1))
                state["scheduler"] = _scheduler_state(scheduler)
                scaler = getattr(accelerator, "scaler", None)
                state["grad_scaler"] = scaler.state_dict() if scaler is not None else None
                state["sharded"] = sharded
        if accelerator.is_main_process:
            (folder / STATE_FILE).write_text(json.dumps(state, indent=1, default=str))
        accelerator.wait_for_everyone()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and limit:
        for old in checkpoints(output_dir)[:-limit]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def load(accelerator, path: str | Path, *, model, optimizer, scheduler) -> dict[str, Any]:
    """Restore the trainable tensors, the optimizer, the schedule and every generator from ``path``; return
    the trainer state (step and history). Only safetensors and JSON are read, unless the checkpoint is a
    pickled one that ``resolve_output_dir`` let through (``trust_pickled_checkpoint``)."""
    path = Path(path)
    state = read_state(path)
    if state.get("format") != FORMAT:  # trusted by the user (trust_pickled_checkpoint)
        from accelerate.utils import DistributedType

        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            accelerator.load_state(str(path))  # the engine's own checkpoint (its load_checkpoint takes no strict)
        else:
            accelerator.load_state(str(path), strict=False)
        if isinstance(state.get("scheduler"), dict):  # written since the schedule is saved beside save_state's files
            _load_scheduler(scheduler, state["scheduler"])
        return state
    if state.get("processes") != accelerator.num_processes and state.get("sharded"):
        raise RecipeError(
            f"{path} holds shards of {state.get('processes')} processes; resume it with as many "
            f"(this run has {accelerator.num_processes})"
        )
    rank = accelerator.process_index if state.get("sharded") else 0
    unwrapped = accelerator.unwrap_model(model)
    saved = load_file(str(path / (f"model-rank{rank}.safetensors" if state.get("sharded") else "model.safetensors")))
    params = _trainable(unwrapped)
    if set(saved) != set(params):
        missing, extra = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
        raise RecipeError(
            f"{path} does not match this model's trainable parameters (missing {missing[:3]}, "
            f"unexpected {extra[:3]}): was it written by another recipe?"
        )
    with torch.no_grad():
        for name, param in params.items():
            to_local = getattr(param, "to_local", None)  # a DTensor (FSDP2) copies into its local shard
            target = to_local() if callable(to_local) else param
            target.copy_(saved[name].to(target.device, target.dtype))

    flat = load_file(str(_own_or_first(path, "optimizer-rank{}.safetensors", accelerator.process_index)))
    groups = read_state(path, "optimizer.json").get("param_groups")
    if not isinstance(groups, list) or not isinstance(state.get("scheduler"), dict):
        raise RecipeError(f"{path} is damaged (no optimizer param_groups, or no scheduler state): resume from another")
    order = [p for group in optimizer.param_groups for p in group["params"]]
    entries: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        index, name = key.split(".", 1)
        param = order[int(index)]
        if callable(getattr(param, "to_local", None)) and value.dim() > 0:  # a DTensor parameter's state
            from torch.distributed.tensor import DTensor

            value = DTensor.from_local(value.to(param.device), param.device_mesh, param.placements)
        entries.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": entries, "param_groups": groups})
    _load_scheduler(scheduler, state["scheduler"])
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None and state.get("grad_scaler"):
        scaler.load_state_dict(state["grad_scaler"])
    rng = _own_or_first(path, "rng-rank{}.safetensors", accelerator.process_index)
    _set_rng_state(load_file(str(rng)), read_state(path, rng.with_suffix(".json").name))
    return state


def _own_or_first(path: Path, pattern: str, rank: int) -> Path:
    """This process's file, or process 0's when the run had fewer processes (replicated state: DDP)."""
    own = path / pattern.format(rank)
    return own if own.is_file() else path / pattern.format(0)
