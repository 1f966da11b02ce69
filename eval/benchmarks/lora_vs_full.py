"""LoRA against full fine-tuning on SmolLM2-135M (issue 26): time per step measured in one run, and the loss curves.

Runs the shipped recipes ``smollm2-135m-32k`` (LoRA r 16 on the attention projections, trainable embeddings and
norms) and ``smollm2-135m-32k-full`` (every weight) for ``--steps`` optimizer steps each, alternating ``--rounds``
times in fresh processes, into temporary folders. The same data, windows (2 x 2048 tokens a step) and PoSE
positions; the time per step is the median of the steps after the first of each run (the first is a warm-up).
Prints a table and one JSON line with the ratio full / LoRA of seconds per step.

With ``--curves LORA.csv FULL.csv --png OUT``, also draws the two recorded runs' loss curves against the step and
against the hours they would take at the measured seconds per step.

    rope-extend fetch smollm2-135m && rope-extend fetch canterbury
    python eval/benchmarks/lora_vs_full.py --steps 4 --rounds 2 \\
        --curves eval/reports/smollm2-32k/loss.csv eval/reports/smollm2-32k-full/loss.csv \\
        --png eval/reports/smollm2-32k-full/lora-vs-full.png
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rope_extend.io import atomic_path

RECIPES = {"lora": "smollm2-135m-32k", "full": "smollm2-135m-32k-full"}


def step_seconds(recipe: str, steps: int) -> list[float]:
    """Train ``recipe`` for ``steps`` steps in a fresh process; seconds of each step after the first."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [
            sys.executable, "-m", "rope_extend", "train", recipe,
            f"max_steps={steps}", "logging_steps=1", f"save_steps={steps + 1}", "merge_adapter=false",
            f"output_dir={out}",
        ]  # fmt: skip
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{recipe} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        rows = list(csv.DictReader((out / "loss.csv").open()))
    # tokens_per_s is over the logging interval (one step here): seconds = tokens in the step / rate
    tokens = [int(r["tokens"]) for r in rows]
    per_step = [t - p for t, p in zip(tokens, [0, *tokens[:-1]], strict=True)]
    return [n / float(r["tokens_per_s"]) for n, r in zip(per_step, rows, strict=True)][1:]


def draw(lora_csv: Path, full_csv: Path, seconds: dict[str, float], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {}
    for name, path in (("lora", lora_csv), ("full", full_csv)):
        rows = list(csv.DictReader(path.open()))
        curves[name] = ([int(r["step"]) for r in rows], [float(r["loss"]) for r in rows])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    labels = {"lora": "LoRA r16 + embeddings, norms (lr 1e-4)", "full": "full fine-tuning (lr 2e-5)"}
    for name, (steps, losses) in curves.items():
        axes[0].plot(steps, losses, label=labels[name], lw=1)
        hours = [s * seconds[name] / 3600 for s in steps]
        axes[1].plot(hours, losses, label=labels[name], lw=1)
    axes[0].set_xlabel("optimizer step (4096 tokens)")
    axes[1].set_xlabel("hours on 2 CPU cores (measured seconds per step)")
    axes[0].set_ylabel("training loss")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M, YaRN x4, PoSE 2048 -> 32k: LoRA against full fine-tuning")
    fig.tight_layout()
    with atomic_path(png) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps a run (the first is a warm-up; at least 2)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each recipe, alternating")
    parser.add_argument("--curves", nargs=2, type=Path, metavar=("LORA_CSV", "FULL_CSV"))
    parser.add_argument("--png", type=Path, help="where to draw the curves (with --curves)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (the first step is a warm-up), got {args.steps}")
    if (args.curves is None) != (args.png is None):
        parser.error("--curves and --png go together")
    for path in args.curves or []:  # before the minutes of timing, not after
        if not path.is_file():
            parser.error(f"--curves: {path} is not a file (a run's loss.csv)")
    measured: dict[str, list[float]] = {"lora": [], "full": []}
    start = time.perf_counter()
    for _ in range(args.rounds):
        for name, recipe in RECIPES.items():
            measured[name] += step_seconds(recipe, args.steps)
    median = {name: statistics.median(values) for name, values in measured.items()}
    print("| recipe | steps timed | seconds a step (median) | min | max |\n|---|---:|---:|---:|---:|")
    for name, values in measured.items():
        print(f"| {RECIPES[name]} | {len(values)} | {median[name]:.1f} | {min(values):.1f} | {max(values):.1f} |")
    if args.curves:
        draw(*args.curves, median, args.png)
    print(
        json.dumps(
            {
                "seconds_per_step": median,
                "full_over_lora": median["full"] / median["lora"],
                "wall_s": time.perf_counter() - start,
            }
        )
    )


if __name__ == "__main__":
    main()
