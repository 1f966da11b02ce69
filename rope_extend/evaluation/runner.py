"""The one evaluation runner: what every harness (passkey, needle, perplexity, ...) shares.

A harness describes its work as *jobs* (``{"length": 4096, "trial": 3, ...}``, one record each) and a
``measure(job) -> fields`` function. The runner

- checks that the model can hold the longest length in memory before any work (``check_reachable``);
- applies the sliding-window policy (``hf.window``: by default a window every layer uses is widened to the
  longest length, so long context is really measured; interleaved local layers are kept), and puts the
  model back afterwards;
- identifies the run by its *setting* (model digest, scaling, harness options, window policy, versions) and
  appends every record to ``records.jsonl`` as it finishes; ``resume`` skips the jobs whose record is already there;
- shows a progress bar.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import RopeExtendError
from ..hf import window
from ..hf.reading import attn_implementation, text_config
from .engines import is_engine
from .identity import tokenizer_digest
from .records import RecordLog, run_info, setting_id


def _available_bytes(device) -> int | None:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            import psutil

            return int(psutil.virtual_memory().available)
        except ImportError:
            return None
    return None


def memory_needed(model, length: int, *, cache: bool) -> int:
    """A lower bound on the memory one forward of ``length`` tokens needs beyond the weights, in bytes: one
    layer's activations, eager attention's score matrix, and with ``cache`` the KV cache of every layer."""
    config = text_config(model.config)
    param = next(model.parameters())
    width = param.element_size()
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    inner = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    layers = int(getattr(config, "num_hidden_layers", 1) or 1)
    need = length * (4 * hidden + 2 * inner) * width
    if attn_implementation(config) == "eager":
        need += heads * length * length * 4
    if cache:
        need += 2 * layers * kv_heads * head_dim * length * width
    return need


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check_reachable(model, length: int, *, cache: bool, generated: int = 0) -> None:
    """Refuse a length whose forward cannot fit in the memory available now (fail fast, not after minutes).
    ``generated``: tokens decoded after a prompt of ``length`` (they join the KV cache). A model served by an
    engine checks its own context instead."""
    if is_engine(model):
        model.check_reachable(length, generated)
        return
    device = next(model.parameters()).device
    free = _available_bytes(device)
    need = memory_needed(model, length + generated, cache=cache)
    if free is not None and need > free:
        raise RopeExtendError(
            f"length {length} cannot be reached on {device}: one forward pass needs at least {_size(need)} beyond "
            f"the weights, and {_size(free)} are available; use shorter lengths"
        )


def run(
    model,
    *,
    task: str,
    setting: dict[str, Any],
    jobs: Sequence[dict[str, Any]],
    measure: Callable[[dict[str, Any]], dict[str, Any]],
    longest: int,
    records: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool = True,
    run: dict[str, Any] | None = None,
    sliding_window: str = "auto",
    cache: bool = False,
    generated: int = 0,
    unit: str = "trial",
    aliases: Sequence[dict[str, Any]] = (),
    version: int = 1,
    tokenizer=None,
) -> list[dict]:
    """Measure every job not already recorded; returns one record per job, in job order.

    A record is ``{"task", model and scaling fields, "setting", **job, **measure(job), "seconds",
    "cpu_seconds"}``: the wall time ``measure`` took for that job, and the process's CPU time over it (every
    thread; unlike the wall time, not inflated by other jobs on the cores or by the process being suspended).
    Records written before they were timed lack both. ``cache`` says
    whether the harness decodes with a KV cache, and ``generated`` how many tokens it adds to the longest
    prompt (for the memory check and the sliding-window policy). ``aliases`` are older forms of ``setting``
    whose records measure the same jobs (records written before a setting field was dropped); they are reused
    as if written under ``setting``. ``version`` is the harness's protocol version (``task_version`` in each
    record and its setting): a harness bumps it when a change to how it measures changes the numbers, so
    that records of the old protocol are measured again. ``tokenizer``: the one the prompts are made with (its
    digest joins the setting: a prompt made from text is the same prompt only for the same tokenizer).
    """
    from ..progress import bar as progress_bar

    window.check_sliding_window_mode(sliding_window)
    check_reachable(model, longest, cache=cache, generated=generated)
    extra = {"task_version": version, **(run or {})}
    if tokenizer is not None:
        extra["tokenizer_digest"] = tokenizer_digest(tokenizer)
    info = run_info(model, extra)  # the digest of the model as loaded
    # an engine runs the file as it is served (its own sliding-window rule): nothing to widen
    widening = (
        contextlib.nullcontext(False)
        if is_engine(model)
        else window.sliding_window_widened(model, longest + generated, sliding_window)
    )
    with widening as widened:

        def identity(options: dict[str, Any]) -> str:
            full = {**info, **options, "task": task}
            if widened:
                full["sliding_window"] = "widened"  # a different measurement: records must not be mixed
            return setting_id(full)

        sid = identity(setting)
        old = {identity(alias) for alias in aliases} - {sid}
        log = RecordLog(records, resume=resume)
        done: list[dict] = []
        bar = progress_bar(jobs, desc=f"{task} {info.get('label') or info['method']}", unit=unit, disable=not progress)
        for job in bar:
            bar.set_postfix(length=job.get("length"))  # at once on a terminal; in a log, with the bar's next line
            found = log.find({"setting": sid, **job}) or (log.find(job, settings=old) if old else None)
            if found is None:
                start, cpu = time.perf_counter(), time.process_time()
                got = measure(job)
                spent = {
                    "seconds": round(time.perf_counter() - start, 3),
                    "cpu_seconds": round(time.process_time() - cpu, 3),
                }
                found = log.add({"task": task, **info, "setting": sid, **job, **got, **spent})
            done.append(found)
    return done
