"""DeepSpeed's engine under the loop: accelerate's DEEPSPEED launcher (``accelerate/deepspeed-zero3.yaml``, ZeRO 1-3).

The loop prepares no DataLoader (``Batches`` draws every window itself), so nothing tells DeepSpeed its batch; and
the engine, not the loop, owns accumulation, clipping and the optimizer step. What this module settles, before
``accelerator.prepare`` and around every micro-batch, so that a run under the engine computes what a plain run does:

- ``configure(accelerator, args)``: the engine's ``train_micro_batch_size_per_gpu`` is the recipe's
  ``per_device_train_batch_size``, its ``gradient_accumulation_steps`` the recipe's, its ``gradient_clipping`` the
  recipe's ``max_grad_norm`` (written into ``AcceleratorState().deepspeed_plugin.deepspeed_config``, as accelerate's
  own error message for a missing DataLoader says to). A launcher value of ``auto`` takes the recipe's; a number that
  differs from the recipe's is refused, naming both (one of the two keys would silently change nothing).
- ``micro_batch(accelerator, model, last)``: accelerate's ``accumulate`` (its documented way to accumulate under
  DeepSpeed): accelerate's backward then tells the engine where the accumulation boundary is and calls
  ``engine.step()`` once, after the last micro-batch. It checks that the boundary falls where the loop's does.
- ``BACKWARD``: ``scale_wrt_gas=False`` for the engine's backward: the loop already divides every micro-batch's loss
  by the global batch's target tokens (``loop`` docstring), so the engine must not divide by the accumulation again.
  ``averaged``: over how many processes the engine averages (every process, as DDP; see it for sequence parallelism).
- ``gathered(model)``: a model that ZeRO-3 partitioned while transformers built it (accelerate's DeepSpeed plugin makes
  transformers build under ``deepspeed.zero.Init`` whenever the stage is 3) has empty parameters outside the engine's
  forward; the rope patch and the LM-head check before ``prepare`` run with them gathered. ``hooks_module_outputs``:
  ZeRO-3 re-gathers a module for backward from a hook on its output, so the loss's head output joins the graph.
- ``sequence_parallel_config`` / ``sequence_parallel`` / ``check_model``: ``parallel.sequence`` under this launcher is
  accelerate's own DeepSpeed sequence parallelism (``ParallelismConfig(sp_size, sp_backend="deepspeed")``); the loop
  still slices each shard itself (``training.parallel``), and what accelerate cannot wrap is refused.
- ``tiling_processes``: the engine takes TiledMLP's tile-by-tile gradients, which DDP cannot.
- ``backend_kwargs()``: on a machine whose DeepSpeed accelerator is the CPU, accelerate finds no backend for the
  DeepSpeed launcher and counts every process as process 0 of 1 (all of them would write); gloo is named for it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from ..hf import ulysses
from ..hf.head import unwrap
from ..hf.reading import attn_implementation
from . import parallel
from .args import RecipeError, TrainArgs

BACKWARD = {"scale_wrt_gas": False}


def requested() -> bool:
    """Whether the process was launched for DeepSpeed (accelerate's launcher sets ``ACCELERATE_USE_DEEPSPEED``)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def active(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def mixed_precision(args: TrainArgs) -> str:
    """The precision to hand accelerate: the recipe's ``bf16``/``fp16`` keys, checked against the launcher's.

    ``Accelerator(mixed_precision=...)`` takes precedence over what ``accelerate launch`` set (its config file's
    ``mixed_precision`` or ``--mixed_precision``, passed on as ``ACCELERATE_MIXED_PRECISION``), so a launcher
    asking for bf16 beside a recipe without ``bf16: true`` trained in float32 without a word. A launcher that asks
    for a precision the recipe does not take is refused, naming both. ``no`` is accelerate's default when
    nothing is configured, so it is not taken as a request: the recipe's keys decide then.
    """
    recipe = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower() or "no"
    if launcher != "no" and launcher != recipe:
        fix = (
            f"set `{launcher}: true` in the recipe (or add {launcher}=true to the command)"
            if launcher in ("bf16", "fp16")
            else "the recipe trains in bf16, fp16 or float32 only"
        )
        raise RecipeError(
            f"the launcher asks for mixed_precision={launcher} but the recipe's bf16/fp16 keys give {recipe}: "
            f"{fix}, or launch with --mixed_precision {recipe}"
        )
    return recipe


def backend_kwargs() -> list[Any]:
    """accelerate's ``kwargs_handlers`` for a DeepSpeed launch on a CPU: gloo (see the module docstring)."""
    if not requested() or int(os.environ.get("LOCAL_RANK", "-1")) == -1:
        return []
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return []
    from accelerate.utils import InitProcessGroupKwargs

    return [InitProcessGroupKwargs(backend="gloo")]


def sequence_parallel_config(args: TrainArgs) -> Any:
    """accelerate's ``ParallelismConfig`` for ``parallel.sequence`` under the DeepSpeed launcher (None otherwise):
    DeepSpeed's Ulysses on the recipe's attention implementation, registered by accelerate in ``prepare``. A launcher
    whose own ``parallelism_config_sp_size`` says otherwise is refused (one of the two would be ignored)."""
    n = args.parallel.sequence
    launcher = os.environ.get("PARALLELISM_CONFIG_SP_SIZE") if _uses_parallelism_config() else None
    if not requested() or (n == 1 and launcher in (None, "1")):
        return None
    if launcher not in (None, "1", str(n)):
        raise RecipeError(
            f"parallel.sequence: got {n} in the recipe and parallelism_config_sp_size {launcher} in the launcher "
            f"config; expected the same, or no sp_size in the launcher (the recipe's parallel.sequence is used)"
        )
    parallel.require_deepspeed(n)
    backend = os.environ.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
    if backend != "deepspeed":
        raise RecipeError(f"parallel.sequence: the launcher's sp_backend is {backend!r}; expected deepspeed")
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

    handler = DeepSpeedSequenceParallelConfig(
        sp_seq_length_is_variable=True, sp_attn_implementation=args.model.attn_implementation
    )
    return ParallelismConfig(sp_size=n, sp_backend="deepspeed", sp_handler=handler)


def _uses_parallelism_config() -> bool:
    return os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true"


def sequence_parallel(accelerator) -> bool:
    """Whether accelerate runs DeepSpeed's sequence parallelism (``sequence_parallel_config``) for this run."""
    pc = getattr(accelerator, "parallelism_config", None)
    return active(accelerator) and pc is not None and pc.sp_size > 1 and pc.sp_backend == "deepspeed"


def check_model(accelerator, model, args: TrainArgs) -> None:
    """Refuse, before anything is written, what accelerate's sequence parallelism cannot make exact: it wraps only
    the recipe's attention implementation, and refuses any other key in ``prepare``; rope-extend's attention methods
    and log-n run under rope-extend's own key, which only rope-extend's Ulysses serves."""
    if not sequence_parallel(accelerator):
        return
    key = attn_implementation(unwrap(model).config)  # the one reader of transformers' private attribute
    if key != args.model.attn_implementation:
        raise RecipeError(
            f"parallel.sequence: rope method {args.rope.method!r}"
            f"{' with log-n' if args.rope.params.get('logn') else ''} runs rope-extend's attention "
            f"({key!r}), which accelerate's DeepSpeed sequence parallelism (the DeepSpeed launcher) cannot wrap: it "
            f"serves {', '.join(ulysses.SERVED)}; launch with rope-extend recipes accelerate/sequence-parallel.yaml "
            "(rope-extend's own Ulysses, exact for every method), or use a frequency method here"
        )


def hooks_module_outputs(accelerator) -> bool:
    """Whether the engine re-gathers a module's parameters in backward from a hook on the module's output (ZeRO-3):
    the loss's LM head must then return an output on the autograd graph (``loss.model_loss``)."""
    if not active(accelerator):
        return False
    return int(accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0)) == 3


def tiling_processes(accelerator) -> int:
    """The ``processes`` for ``hf.tiling.tile_mlps``: DDP's reducer cannot take a gradient that TiledMLP builds tile by
    tile, but DeepSpeed's engine (ZeRO 0-3) waits for the tile that marks it ready (``ds_grad_is_ready``): measured
    exact with LoRA on the MLP over 2 processes in ZeRO 1, 2 and 3 (``tests/training/test_deepspeed.py``)."""
    return 1 if active(accelerator) else accelerator.num_processes


def averaged(accelerator, processes_per_group: int) -> int:
    """Over how many processes the engine averages the gradients, for the loop's ``loss * averaged / tokens``.

    DDP and an engine without sequence parallelism average over every process. Under accelerate's DeepSpeed sequence
    parallelism the engine knows the groups, and DeepSpeed 0.19.8 divides by the data-parallel size only (it sums
    a group's shards) in ZeRO 0-2 and in ZeRO-3's contiguous all-reduce, but by every process in ZeRO-3's
    reduce-scatter (``zero_optimization.reduce_scatter``, on by default; measured: gradients 1/N of a plain run's
    with the data-parallel scale). ZeRO-3 without reduce-scatter picks between the two by bucket size, so
    ``configure`` refuses it with sequence parallelism."""
    if not sequence_parallel(accelerator):
        return accelerator.num_processes
    zero = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
    if int(zero.get("stage", 0)) == 3:
        return accelerator.num_processes
    return accelerator.num_processes // processes_per_group


def _setting(config: dict, key: str, recipe_key: str, value: Any, unset: tuple = ("auto", None)) -> None:
    """``config[key] = value`` where it is ``unset`` (``auto``, absent); a different number is refused."""
    given = config.get(key, "auto")
    if any(given == u and type(given) is type(u) for u in unset):
        config[key] = value
    elif float(given) != float(value):
        raise RecipeError(
            f"{recipe_key}: got {value} in the recipe and {key} {given} in the DeepSpeed launcher config; "
            f"expected the same value in both, or {key}: {'1' if key == 'gradient_accumulation_steps' else 'auto'} "
            "in the launcher (the recipe's value is then used)"
        )


def configure(accelerator, args: TrainArgs) -> None:
    """The engine's batch, accumulation and clipping from the recipe, and the refusals; nothing without DeepSpeed."""
    if not active(accelerator):
        return
    plugin = accelerator.state.deepspeed_plugin
    config = plugin.deepspeed_config
    _setting(config, "train_micro_batch_size_per_gpu", "per_device_train_batch_size", args.per_device_train_batch_size)
    # accelerate's launcher cannot pass ``auto`` for this one (its Accelerator reads the number from the environment):
    # its default 1 stands for "the recipe's"
    accumulation = args.gradient_accumulation_steps
    _setting(config, "gradient_accumulation_steps", "gradient_accumulation_steps", accumulation, ("auto", None, 1))
    _setting(config, "gradient_clipping", "max_grad_norm", args.max_grad_norm)
    # the loop counts the global batch itself; the engine checks micro x accumulation x data-parallel against it
    config.pop("train_batch_size", None)
    accelerator.gradient_accumulation_steps = args.gradient_accumulation_steps
    zero = config.get("zero_optimization", {})
    if int(zero.get("stage", 0)) == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") is not True:
        # else accelerate's get_state_dict raises when the run saves its adapter or model, after the last step
        raise RecipeError(
            "the DeepSpeed launcher config runs ZeRO-3 without zero3_save_16bit_model: true; the run saves its "
            "adapter and merged model from the gathered weights at the end, which needs it: set it true"
        )
    if args.parallel.sequence > 1 and int(zero.get("stage", 0)) == 3 and zero.get("reduce_scatter", True) is False:
        raise RecipeError(
            f"parallel.sequence: got {args.parallel.sequence} with ZeRO-3 and reduce_scatter false in the DeepSpeed "
            "config; DeepSpeed 0.19.8 then averages the gradients over the data-parallel groups or over every process "
            "depending on the bucket size; expected reduce_scatter true (the default), or ZeRO stage 0-2"
        )


@contextlib.contextmanager
def micro_batch(accelerator, model, last: bool) -> Iterator[None]:
    """The context of one micro-batch's forward and backward; ``last``: the step's last micro-batch."""
    if not active(accelerator):
        with contextlib.nullcontext() if last else accelerator.no_sync(model):  # all-reduce once per step
            yield
        return
    with accelerator.accumulate(model):
        if accelerator.sync_gradients != last:  # the engine would step at another micro-batch than the loop
            raise RuntimeError(
                f"DeepSpeed's accumulation boundary ({accelerator.sync_gradients}) is not the loop's ({last}): "
                f"accumulation {accelerator.gradient_accumulation_steps} against the recipe's"
            )
        yield


def gathered(model) -> contextlib.AbstractContextManager:
    """Every ZeRO-3-partitioned parameter of ``model`` whole for the ``with`` (read only); nothing otherwise."""
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned)
