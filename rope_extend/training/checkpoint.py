"""Checkpoints: accelerate's ``save_state``/``load_state`` plus the run's own state, written atomically.

``output_dir/checkpoint-<step>/`` holds what accelerate saves (model, optimizer, scheduler, RNG states of
every process) and ``trainer_state.json`` (the step, which fixes the data position, and the loss
history). It is written under a temporary name and renamed into place once every process has written
its part, so a folder named ``checkpoint-*`` is always complete; ``latest`` is the highest step.
With LoRA only the trainable tensors are stored (the frozen base is reloaded from its source).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from ..io import atomic_path
from .args import RecipeError, TrainArgs

PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"
RUN_FILE = "run_config.yaml"


def checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest first."""
    out = Path(output_dir)
    found = [p for p in out.glob(f"{PREFIX}*") if p.is_dir() and re.fullmatch(rf"{PREFIX}\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest(output_dir: str | Path) -> Path | None:
    found = checkpoints(output_dir)
    return found[-1] if found else None


def resolve_output_dir(args: TrainArgs) -> Path | None:
    """Check ``output_dir`` against the overwrite/resume keys; return the checkpoint to resume or None.

    A folder with anything in it is someone's run (or someone's files): refuse unless told to overwrite
    it or to resume from it. Called on every process before anything is written.
    """
    out = Path(args.output_dir)
    resume = args.resume_from_checkpoint
    if isinstance(resume, str):
        path = Path(resume)
        if not (path / STATE_FILE).is_file():
            raise RecipeError(f"resume_from_checkpoint: {path} is not a checkpoint folder (no {STATE_FILE})")
        return path
    if resume:
        found = latest(out)
        if found is None:
            raise RecipeError(f"resume_from_checkpoint: no {PREFIX}* folder in {out} to resume from")
        return found
    if out.exists() and any(out.iterdir()) and not args.overwrite_output_dir:
        names = sorted(p.name for p in out.iterdir())[:5]
        raise RecipeError(
            f"output_dir {out} is not empty (holds {', '.join(names)}...): it may be another run. Pass "
            "overwrite_output_dir=true to replace it, or resume_from_checkpoint=true to continue it")
    return None


def save(accelerator, output_dir: str | Path, step: int, state: dict[str, Any], limit: int | None) -> Path:
    """Write ``checkpoint-<step>`` atomically from every process; keep the newest ``limit``."""
    from accelerate.utils import broadcast_object_list

    final = Path(output_dir) / f"{PREFIX}{step}"
    holder = [None]
    with (atomic_path(final) if accelerator.is_main_process else _nothing()) as tmp:
        if accelerator.is_main_process:
            tmp.mkdir()
            holder = [str(tmp)]
        broadcast_object_list(holder)
        tmp_path = Path(holder[0])
        accelerator.save_state(str(tmp_path))
        if accelerator.is_main_process:
            (tmp_path / STATE_FILE).write_text(json.dumps(state, indent=1, default=str))
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


def load(accelerator, path: str | Path) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG from ``path``; return its trainer state."""
    accelerator.load_state(str(path), strict=False)  # LoRA checkpoints hold the trainable tensors only
    return json.loads((Path(path) / STATE_FILE).read_text())


def trainable_only_hook(trainable: set[str]):
    """A save-state pre-hook that keeps only the trainable tensors of the model state."""

    def hook(models, weights, output_dir):
        for i, weight in enumerate(weights):
            if isinstance(weight, dict):
                missing = trainable - set(weight)
                if missing:
                    raise RuntimeError(f"checkpoint: trainable tensors not in the state dict: {sorted(missing)[:3]}")
                weights[i] = {k: v for k, v in weight.items() if k in trainable}

    return hook
