"""Processes that share one sequence: Ulysses sequence parallelism (``parallel.sequence``) and torch context
parallelism (accelerate's ``cp_size``), as the loop sees them.

- ``Layout``: which processes share a sequence. Groups of ``degree`` consecutive processes (DeepSpeed's layout);
  ``rank`` (the data-parallel rank, which ``Batches.get`` draws the windows for) is ``index // degree``, the shard
  ``index % degree``.
- ``shard(batch, layout)``: this process's slice of a window whose targets are already shifted (so no label is lost
  at a shard's edge), after padding the window to a multiple of ``degree`` exactly: pad positions run on past the
  last one, pad targets are -100 and pad mask 0; causal attention means no real token sees a pad. It also returns
  the whole window's first and last position (pads excluded), which the dynamic methods read
  (``hf.rotary.whole_sequence``): every rank picks the frequencies one process picks.
- ``sharded(accelerator, batch, layout)``: the context each micro-batch runs in (the slice under Ulysses, torch CP's
  own sharding under CP, the batch as it is otherwise).
- ``install`` / ``remove``: DeepSpeed's communication set up over accelerate's process group, one group per
  sequence, and ``hf.ulysses`` on the model, for the whole run (checkpointing recomputes under it). Under the
  DeepSpeed launcher accelerate installs Ulysses itself (``training.engine``): ``expect`` records what it changes.

The loss scale: every process of a group counts the whole window's targets, so the global token count is the
all-reduced count divided by ``degree``; each process backpropagates its shard's loss sum times ``num_processes /
tokens``: DDP averages gradients over all processes, and the shards' gradients add up to the window's (under
DeepSpeed's engine, the processes it averages over: ``engine.averaged``).
DeepSpeed is imported only here, and only when ``parallel.sequence`` > 1 (``pip install rope-extend[parallel]``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedModelError
from ..hf import rotary, ulysses
from .args import RecipeError, TrainArgs

IGNORE = -100


@dataclass(frozen=True)
class Layout:
    """``processes`` in all; groups of ``degree`` consecutive ones share a sequence (``kind``: ``"sequence"`` for
    Ulysses, ``"context"`` for torch CP, None when ``degree`` is 1); this is process ``index``."""

    processes: int
    degree: int
    index: int
    kind: str | None = None

    @property
    def rank(self) -> int:
        """The data-parallel rank: the windows this process's group trains on."""
        return self.index // self.degree

    @property
    def shard(self) -> int:
        """Which slice of the sequence this process holds."""
        return self.index % self.degree

    @property
    def data_parallel(self) -> int:
        """How many groups, each with its own windows."""
        return self.processes // self.degree


def layout(args: TrainArgs, processes: int, index: int, context: int = 1) -> Layout:
    """The layout for ``processes`` processes, ``parallel.sequence`` or torch CP's ``context`` size; refuses a degree
    that does not divide the processes, both at once, and PoSE under torch CP."""
    n = args.parallel.sequence
    if n > 1 and context > 1:
        raise RecipeError(
            f"parallel.sequence: got {n} with accelerate's context parallelism (cp_size {context}); expected one of "
            "them: 1, or a launcher without cp_size"
        )
    if n > 1 and processes % n:
        raise RecipeError(
            f"parallel.sequence: got {n} with {processes} process(es); expected a divisor of the number of processes "
            f"(launch a multiple of {n}, e.g. rope-extend recipes accelerate/sequence-parallel.yaml)"
        )
    if context > 1 and args.pose.enabled:
        raise RecipeError(
            "pose.enabled with context parallelism (cp_size > 1) is not supported: the sharded "
            "PoSE position ids would be read as packed sequences"
        )
    if n > 1:
        return Layout(processes, n, index, "sequence")
    return Layout(processes, context, index, "context" if context > 1 else None)


def shard(batch: dict[str, torch.Tensor], where: Layout) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
    """``(this process's slice of batch, (first, last position of the whole batch))``; see the module docstring."""
    positions = batch["position_ids"]
    span = (int(positions.min()), int(positions.max()))
    width = batch["input_ids"].shape[1]
    extra = -width % where.degree
    if extra:
        rows = batch["input_ids"].shape[0]
        after = positions[:, -1:] + 1 + torch.arange(extra, device=positions.device)
        fill = {"input_ids": 0, "targets": IGNORE, "attention_mask": 0}
        batch = {
            key: torch.cat([value, after if key == "position_ids" else value.new_full((rows, extra), fill[key])], 1)
            for key, value in batch.items()
        }
    n = (width + extra) // where.degree
    start = where.shard * n
    return {key: value[:, start : start + n] for key, value in batch.items()}, span


@contextlib.contextmanager
def sharded(accelerator, batch: dict[str, torch.Tensor], where: Layout) -> Iterator[dict[str, torch.Tensor]]:
    """The batch this process computes on, for a ``with`` around its forward and backward."""
    if where.kind is None:
        yield batch
    elif where.kind == "sequence":
        local, span = shard(batch, where)
        with rotary.whole_sequence(*span):
            yield local
    else:  # torch CP shards the buffers in place; the dynamic methods read the whole window's span all the same
        span = (int(batch["position_ids"].min()), int(batch["position_ids"].max()))
        batch.pop("attention_mask", None)  # CP needs plain causal SDPA; positions run on (document_boundaries: eos)
        buffers = [batch["input_ids"], batch["position_ids"], batch["targets"]]
        with (
            rotary.whole_sequence(*span),
            accelerator.maybe_context_parallel(
                buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)
            ),
        ):
            yield batch


def check(model, args: TrainArgs, where: Layout) -> None:
    """Refuse, naming ``parallel.sequence``, a model that sequence parallelism cannot serve (``hf.ulysses.head_split``);
    no collective, nothing installed: the loop calls it before anything is written."""
    if where.kind == "sequence":
        _head_split(model, args, where)


def _head_split(model, args: TrainArgs, where: Layout) -> Any:
    try:
        return ulysses.head_split(model, where.degree, args.per_device_train_batch_size)
    except UnsupportedModelError as exc:
        raise RecipeError(f"parallel.sequence: {exc}") from None


def install(model, args: TrainArgs, where: Layout) -> ulysses.Installed | None:
    """Ulysses on ``model`` over this process's group (None without sequence parallelism). Every process makes
    every group, in the same order, as ``torch.distributed.new_group`` requires. The model is checked first
    (``hf.ulysses.head_split``): a refusal names ``parallel.sequence`` and comes before any collective."""
    if where.kind != "sequence":
        return None
    split = _head_split(model, args, where)
    group = _groups(where)
    return ulysses.install(model, split, group)


def expect(model, args: TrainArgs, where: Layout) -> ulysses.Installed:
    """Under accelerate's DeepSpeed sequence parallelism (``training.engine``), which installs DeepSpeed's Ulysses
    itself in ``prepare``: the model checked as for ``install``, and what that installation changes recorded so
    that ``remove`` undoes it. Call it just before ``prepare``."""
    return ulysses.expect(model, _head_split(model, args, where))


def require_deepspeed(degree: int) -> Any:
    """The ``deepspeed`` module, at the version whose Ulysses was checked (0.19.8), or a refusal naming
    ``parallel.sequence``: both rope-extend's Ulysses and accelerate's call DeepSpeed's."""
    try:
        import deepspeed
    except ImportError:
        raise RecipeError(
            f"parallel.sequence: got {degree}; sequence parallelism needs DeepSpeed >= 0.19.8 "
            "(pip install 'rope-extend[parallel]'), or parallel.sequence 1"
        ) from None
    from packaging.version import Version

    if Version(deepspeed.__version__).release < (0, 19, 8):
        raise RecipeError(
            f"parallel.sequence: got {degree}; DeepSpeed {deepspeed.__version__} is installed, sequence "
            "parallelism needs >= 0.19.8 (pip install 'rope-extend[parallel]')"
        )
    return deepspeed


def _groups(where: Layout) -> Any:
    """This process's sequence group, through DeepSpeed's communication (its Ulysses calls ``deepspeed.comm``),
    which reuses the default process group accelerate started."""
    deepspeed = require_deepspeed(where.degree)
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
    groups = [dist.new_group(list(range(g * where.degree, (g + 1) * where.degree))) for g in range(where.data_parallel)]
    return groups[where.rank]


def remove(installed: ulysses.Installed | None) -> None:
    """Undo ``install`` (nothing when it installed nothing)."""
    if installed is not None:
        ulysses.remove(installed)
