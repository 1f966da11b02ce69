"""What the benchmarks share: the timing and peak-memory loop, memory readings, and one variant per subprocess.

Each benchmark runs every variant in a fresh subprocess (``spawn``), so one variant's allocations cannot
hide in another's peak. Inside it, ``measure`` times ``repeats`` calls of a function and reads the peak
memory over them: on CUDA the allocator's peak after a reset, on the CPU the process's peak RSS
(``ru_maxrss``). ``base_mb`` is the reading before the first timed call (after the caller's warm-up), and
``increase_mb`` what the calls added to it; the ratios the benchmarks print use the increase.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

# Llama-3-8B's architecture (32 layers, 4096 hidden, GQA 32/8 heads of 128, 14336 MLP, 128256 vocabulary,
# theta 500000), the GPU benchmarks' shape; each adds its own max_position_embeddings
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)


def peak_rss_mb() -> float:
    """The process's peak resident set size so far, in MiB (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    """The process's resident set size now, in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def fmt(value: Any, spec: str) -> str:
    """``value`` formatted with ``spec``, or ``-`` where it is missing (a variant that failed)."""
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def measure(fn: Callable[[], Any], *, repeats: int, device: str, baseline: str = "peak") -> dict:
    """Time ``repeats`` calls of ``fn`` and read the peak memory over them.

    Returns ``seconds`` (the fastest call; these machines are shared), ``times``, ``result`` (the last
    call's return value), ``error`` (an out-of-memory message, after which no call is tried) and
    ``base_mb`` / ``peak_mb`` / ``increase_mb``. A CUDA device also gives its name as ``gpu``.
    ``baseline`` is what ``base_mb`` reads before the first call: the peak so far ("peak", what a forward
    adds above model construction and warm-up) or the memory held now ("current", what a training step
    adds, its optimizer state included)."""
    import torch

    cuda = device.startswith("cuda")
    if baseline not in ("peak", "current"):
        raise ValueError(f"baseline={baseline!r}; allowed: 'peak', 'current'")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = (torch.cuda.max_memory_allocated() if baseline == "peak" else torch.cuda.memory_allocated()) / 2**20
    else:
        base = peak_rss_mb() if baseline == "peak" else rss_mb()
    times, result, error = [], None, None
    for _ in range(repeats):
        try:
            start = time.perf_counter()
            result = fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        except torch.cuda.OutOfMemoryError as exc:
            error = f"out of memory: {str(exc).splitlines()[0]}"
            break
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mb()
    out = {
        "seconds": min(times) if times else None,
        "times": times,
        "result": result,
        "error": error,
        "base_mb": base,
        "peak_mb": peak,
        "increase_mb": peak - base,
    }
    if cuda:
        out["gpu"] = torch.cuda.get_device_name()
    return out


# glibc's malloc with every block of 64 KiB or more mapped on its own and unmapped when freed, and freed memory
# trimmed at once: the process's RSS then follows the live tensors, not what the allocator keeps cached (whose
# share of a CPU peak varies by a quarter between identical runs). Slower (a page fault per fresh page), so the
# CPU benchmarks read memory from a run under it and time from a run without it.
LIVE_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def spawn(script: str, args: list[str], *, timeout: float | None = None, env: dict | None = None) -> dict:
    """Run ``python script *args`` in a fresh process (``env`` added to the environment) and read the JSON
    object on its last output line.

    A failed run gives ``{"error": [its last stderr line]}`` and ``"stderr"`` (its tail), and one that outruns
    ``timeout`` seconds is killed and gives ``{"error": [...]}``, so that a table can show it beside the variants
    that ran."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    try:
        proc = subprocess.run(
            [sys.executable, script, *args], check=False, capture_output=True, text=True, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": [f"stopped after {timeout} s (the time limit)"]}
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:], "stderr": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])
