"""Activation memory per token of one LoRA step, the HF baseline against rope-extend with and without TiledMLP
(issue 64, part 3): the slope of the step's peak memory over several lengths, with seconds per step beside it.

    python eval/benchmarks/train_scale.py                         # CPU: Llama-3-8B layer shape, 2 layers, bf16
    python eval/benchmarks/train_scale.py --lengths 1024 2048 --variants rope rope+tiled_mlp
    python eval/benchmarks/train_scale.py --smollm2 --budget-gb 8 # SmolLM2-135M shape: longest step in a budget
    python eval/benchmarks/train_scale.py --gpu                   # CUDA: 32 layers, lengths doubling to OOM
    python eval/benchmarks/train_scale.py --smoke                 # tiny shape, seconds: checks that it runs

Variants (one LoRA r=8 step on q/k/v/o, activation checkpointing, AdamW; random weights of real shapes):
  hf              PEFT ``model(input_ids, labels=input_ids)``: the baseline ALST compares with (its loss upcasts the
                  whole sequence's logits to float32)
  rope            rope-extend's loss path today: ``training.loss.model_loss`` (the LM head and cross-entropy in
                  ``--chunk``-token blocks: logits never exist for the whole sequence)
  rope+tiled_mlp  the same with ``memory.tiled_mlp``: DeepSpeed's TiledMLP on every decoder MLP
                  (``hf.tiling.tile_mlps``) in tiles of ``--tile-tokens`` tokens (see below)
  sp2             2 processes of rope-extend's Ulysses sequence parallelism (``training.parallel``, as the loop runs
                  it: each process computes half of the window), per process (the larger of the two); refused in a
                  checkout without ``rope_extend.training.parallel``
  sp2+tiled_mlp   both

Each (variant, length) runs in a fresh subprocess under ``_measure.LIVE_MEMORY_ENV`` (glibc then returns freed
blocks at once, so RSS follows the live tensors); "step memory" is the peak RSS over the step minus the RSS just
before it (weights, LoRA and the batch excluded), seconds are that same step's (slower under that allocator
setting, and these cores are shared: read them as ratios). The **slope** between the two longest lengths is the
activation memory per token; at short lengths fixed terms (rope's loss blocks, ``--chunk`` x vocabulary x 4 B each)
hide it, so the lengths are chosen where the per-token term dominates. Targets (issue 64): rope+tiled_mlp <= 1/8 of
hf's bytes per token; sp2 per process <= 0.55 of one process at the same length.

The CPU shape (the default): Llama-3-8B's layers (hidden 4096, MLP 14336, 32/8 heads of 128, vocabulary 128256) with
2 layers, bf16 weights (this CPU's bf16 matmuls run at twice float32's speed; about 3 GB of weights), loss blocks of
256 tokens, lengths 1024 / 2048 / 4096, one step each: a step at 1024 tokens takes about 30 s on one of these 2
shared cores, at 4096 two minutes, and the default run about 20 minutes. MLP tiles of 256 tokens: DeepSpeed's rule
(``memory.mlp_tiles: null``, ceil(tokens / hidden_size)) gives ONE tile up to 4096 tokens at hidden 4096, so at
lengths a CPU can step it saves nothing; its point is the lengths of a GPU (128 tiles of ~4096 tokens at 500k), where
a tile is a small fixed part of the step, as 256-token tiles are here (``--tile-tokens 0`` measures the rule).
``--gpu``: the same variants on CUDA (``torch.cuda.max_memory_allocated``), 32 layers, bf16, DeepSpeed's tile rule,
lengths doubling from 8192 until a step runs out of memory (measured on an H200: eval/reports/gpu/).

Prints a markdown table and, as its last line, the JSON (also written to ``--out``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys

from _measure import LIVE_MEMORY_ENV, LLAMA3_8B, fmt, measure, spawn

from rope_extend.errors import RopeExtendError
from rope_extend.io import check_writable, write_text

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
VARIANTS = ("hf", "rope", "rope+tiled_mlp", "sp2", "sp2+tiled_mlp")
SHAPES = {
    "llama3-8b": dict(LLAMA3_8B, num_hidden_layers=2, max_position_embeddings=131072),
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    "tiny": dict(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=224,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    ),
}
TARGETS = {"tiled_slope_ratio": 1 / 8, "sp2_per_process_ratio": 0.55}


def sp2_refusal() -> str | None:
    """Why ``sp2`` cannot run in this checkout, or None when it can."""
    if importlib.util.find_spec("rope_extend.training.parallel") is None:
        return (
            "sp2: needs rope-extend's Ulysses sequence parallelism (rope_extend.training.parallel, issue 64 part 2), "
            "which this checkout does not have; run the other variants"
        )
    return None


def build(variant: str, tokens: int, args):
    """The LoRA model of ``args.shape`` with checkpointing (and tiles for ``rope+tiled_mlp``), its AdamW, one batch."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from rope_extend.hf import checkpointing
    from rope_extend.hf.tiling import tile_mlps

    torch.manual_seed(0)
    fields = dict(SHAPES[args.shape])
    if args.layers:
        fields["num_hidden_layers"] = args.layers
    config = LlamaConfig(**fields, attn_implementation="sdpa")
    dtype = torch.float32 if args.shape == "tiny" else torch.bfloat16
    with torch.device(args.device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    model.config.use_cache = False
    checkpointing.enable(model)
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    model.train()
    tiles = None
    if variant.endswith("+tiled_mlp"):
        local = tokens // 2 if variant.startswith("sp2") else tokens  # the tokens each process's MLPs see
        tiles = math.ceil(local / args.tile_tokens) if args.tile_tokens else None
        tile_mlps(model, tiles, processes=2 if variant.startswith("sp2") else 1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (1, tokens), generator=g).to(args.device)
    batch = {
        "input_ids": ids,
        "position_ids": torch.arange(tokens, device=args.device)[None],
        "targets": torch.cat([ids[:, 1:], torch.full((1, 1), -100, device=args.device)], 1),
    }
    return model, opt, batch, tiles


def row(variant: str, tokens: int, got: dict, tiles) -> dict:
    if got["error"]:
        import torch

        raise torch.cuda.OutOfMemoryError(got["error"])  # the caller reads an out-of-memory exit as "does not fit"
    return {
        "variant": variant,
        "tokens": tokens,
        "step_mb": got["increase_mb"],
        "before_step_mb": got["base_mb"],
        "peak_mb": got["peak_mb"],
        "seconds": got["seconds"],
        "loss": got["result"],
        "mlp_tiles": tiles,
        **({"gpu": got["gpu"]} if "gpu" in got else {}),
    }


def one(variant: str, tokens: int, args) -> dict:
    """Build the model, run one LoRA step, report its memory and time."""
    from rope_extend.training.loss import model_loss

    model, opt, batch, tiles = build(variant, tokens, args)
    ids = batch["input_ids"]

    def step() -> float:
        if variant == "hf":
            loss = model(input_ids=ids, labels=ids).loss  # the mean over tokens - 1 targets
            loss.backward()
            value = float(loss)
        else:
            total, n = model_loss(model, batch, args.chunk)
            (total / n).backward()
            value = float(total) / n
        opt.step()
        opt.zero_grad(set_to_none=True)
        return value

    return row(variant, tokens, measure(step, repeats=1, device=args.device, baseline="current"), tiles)


def sp_worker(variant: str, tokens: int, args) -> dict:
    """One of ``sp2``'s 2 processes (under ``torch.distributed.run``): rope-extend's sequence parallelism as the loop
    runs it (``training.parallel``: Ulysses on the model, this process's shard of the window), one LoRA step."""
    import torch
    import torch.distributed as dist

    from rope_extend.training import load_args, parallel
    from rope_extend.training.loss import model_loss

    dist.init_process_group("gloo")
    where = parallel.Layout(dist.get_world_size(), 2, dist.get_rank(), "sequence")
    model, opt, batch, tiles = build(variant, tokens, args)
    recipe = {
        "model": {"config": {"model_type": "llama"}},
        "rope": {"method": "none"},
        "data": {"path": "unused"},
        "parallel": {"sequence": 2},
    }
    installed = parallel.install(model, load_args(recipe), where)
    tokens_all = int((batch["targets"] != -100).sum())

    def step() -> float:
        with parallel.sharded(None, batch, where) as local:
            total, _ = model_loss(model, local, args.chunk)
            (total / tokens_all).backward()  # this shard's part of the window's mean (no DDP: nothing to average)
        opt.step()
        opt.zero_grad(set_to_none=True)
        whole = total.detach().clone()
        dist.all_reduce(whole)
        return float(whole) / tokens_all

    got = measure(step, repeats=1, device=args.device, baseline="current")
    parallel.remove(installed)
    out = row(variant, tokens, got, tiles)
    out["rank"] = dist.get_rank()
    torch.distributed.destroy_process_group()
    return out


def run_one(variant: str, tokens: int, args) -> dict:
    """``one`` in a fresh subprocess; an error row (``oom`` true for an out-of-memory exit) when it fails."""
    cmd = ["--one", variant, "--tokens", str(tokens), "--shape", args.shape, "--device", args.device]
    cmd += ["--chunk", str(args.chunk), "--tile-tokens", str(args.tile_tokens or 0)]
    cmd += ["--layers", str(args.layers)] if args.layers else []
    env = {
        **({} if args.timing else LIVE_MEMORY_ENV),
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    }
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    if variant.startswith("sp2"):
        return run_sp(variant, tokens, cmd, env, args)
    got = spawn(os.path.abspath(__file__), cmd, env=env, timeout=args.timeout)
    if got.get("error"):
        tail = got.get("stderr", "")
        oom = "out of memory" in tail.lower() or "OutOfMemoryError" in tail or "Killed" in tail
        return {"variant": variant, "tokens": tokens, "error": got["error"], "oom": oom}
    print(json.dumps(got), file=sys.stderr, flush=True)
    return got


def run_sp(variant: str, tokens: int, cmd: list[str], env: dict, args) -> dict:
    """``sp2``: 2 processes under ``torch.distributed.run``; the row is the process with the larger step memory (its
    peers' in ``ranks``)."""
    import subprocess

    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533"]
    proc = subprocess.run(
        [*launcher, os.path.abspath(__file__), *cmd],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **env},
        timeout=args.timeout,
    )
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"variant"')]
    if proc.returncode != 0 or len(ranks) != 2:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line][:1] or proc.stderr.splitlines()[-1:]
        tail = proc.stderr[-3000:]
        return {"variant": variant, "tokens": tokens, "error": errors, "oom": "out of memory" in tail}
    worst = dict(max(ranks, key=lambda r: r["step_mb"]))
    worst["ranks"] = ranks
    print(json.dumps(worst), file=sys.stderr, flush=True)
    return worst


def slope(rows: list[dict]) -> float | None:
    """KiB of step memory per token between the two longest lengths that ran (None with fewer than two)."""
    ok = sorted((r for r in rows if "error" not in r), key=lambda r: r["tokens"])
    if len(ok) < 2:
        return None
    a, b = ok[-2], ok[-1]
    return (b["step_mb"] - a["step_mb"]) * 1024 / (b["tokens"] - a["tokens"])


def summarize(rows: list[dict], variants: list[str]) -> dict:
    by = {v: [r for r in rows if r["variant"] == v] for v in variants}
    slopes = {v: slope(by[v]) for v in variants}
    out: dict = {"slopes_kib_per_token": slopes}
    base = slopes.get("hf")
    # at lengths too short for the per-token term the step's peak is within RSS noise and a slope can come out
    # zero or negative: no ratio is made from it (the run says why rather than printing a meaningless one)
    if base is not None and base <= 0:
        out["no_ratio"] = f"the hf slope is {base:.3f} KiB/token: use longer --lengths, where activations dominate"
    elif base is not None:
        out["slope_ratio_vs_hf"] = {v: (s / base if s is not None else None) for v, s in slopes.items()}
        tiled = out["slope_ratio_vs_hf"].get("rope+tiled_mlp")
        out["tiled_target_met"] = tiled is not None and tiled <= TARGETS["tiled_slope_ratio"]
    for sp, one_process in (("sp2", "rope"), ("sp2+tiled_mlp", "rope+tiled_mlp")):
        pairs = {
            a["tokens"]: a["step_mb"] / b["step_mb"]
            for a in by.get(sp, [])
            for b in by.get(one_process, [])
            if a["tokens"] == b["tokens"] and "error" not in a and "error" not in b
        }
        if pairs:  # per process against one process at the same length (issue 64: <= 0.55)
            out.setdefault("per_process_ratio", {})[sp] = pairs
    return out


def table(rows: list[dict], variants: list[str], summary: dict) -> str:
    lengths = sorted({r["tokens"] for r in rows})
    head = "| variant | " + " | ".join(f"{t} tokens: MiB (s)" for t in lengths) + " | slope KiB/token | vs hf |"
    lines = [head, "|" + "---|" * (len(lengths) + 3)]
    ratios = summary.get("slope_ratio_vs_hf", {})
    for v in variants:
        cells = []
        for t in lengths:
            r = next((r for r in rows if r["variant"] == v and r["tokens"] == t), None)
            if r is None:
                cells.append("")
            elif "error" in r:
                cells.append("out of memory" if r.get("oom") else "failed")
            else:
                cells.append(f"{r['step_mb']:.0f} ({r['seconds']:.1f} s)")
        s = summary["slopes_kib_per_token"].get(v)
        lines.append(f"| {v} | " + " | ".join(cells) + f" | {fmt(s, '.1f')} | {fmt(ratios.get(v), '.3f')} |")
    return "\n".join(lines)


def cpu_main(args) -> dict:
    rows = []
    for tokens in args.lengths:  # variants alternate at each length, so a busy spell hits all of them
        for v in args.variants:
            rows.append(run_one(v, tokens, args))
    summary = summarize(rows, args.variants)
    return {"rows": rows, **summary}


def gpu_main(args) -> dict:
    """Lengths doubling from ``--lengths[0]`` until a variant's step runs out of memory (each in a subprocess)."""
    rows = []
    longest = {}
    for v in args.variants:
        n, fit = args.lengths[0], 0
        while n <= args.max_tokens:
            row = run_one(v, n, args)
            rows.append(row)
            if "error" in row:
                break
            fit, n = n, n * 2
        longest[v] = fit
    return {"rows": rows, "longest_tokens": longest, **summarize(rows, args.variants)}


def smollm2_main(args) -> dict:
    """The longest SmolLM2-135M-shaped LoRA step within ``--budget-gb`` of peak RSS, per variant: extrapolated from
    the slope over ``--lengths`` and confirmed by one run at the predicted length (rounded down to 1024)."""
    rows, predicted = [], {}
    for v in args.variants:
        got = [run_one(v, t, args) for t in args.lengths]
        rows += got
        ok = [r for r in got if "error" not in r]
        s = slope(got)
        if not ok or not s:
            continue
        last = max(ok, key=lambda r: r["tokens"])
        room_mb = args.budget_gb * 1024 - last["peak_mb"]
        predicted[v] = int((last["tokens"] + room_mb * 1024 / s) // 1024 * 1024)
    confirmed = {}
    for v, t in predicted.items():
        if args.confirm and t <= args.max_tokens:
            row = run_one(v, t, args)
            rows.append(row)
            confirmed[v] = {
                "tokens": t,
                "peak_mb": row.get("peak_mb"),
                "fits": row.get("peak_mb", math.inf) <= args.budget_gb * 1024,
            }
    return {
        "rows": rows,
        "budget_gb": args.budget_gb,
        "predicted_tokens": predicted,
        "confirmed": confirmed,
        **summarize(rows, args.variants),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["hf", "rope", "rope+tiled_mlp"])
    parser.add_argument("--lengths", nargs="+", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--chunk", type=int, default=256, help="rope-extend's loss_chunk_size")
    parser.add_argument(
        "--tile-tokens",
        type=int,
        default=None,
        help="rope+tiled_mlp: tokens per MLP tile (mlp_tiles = ceil(tokens / this)); 0: DeepSpeed's rule "
        "ceil(tokens / hidden_size) (default: 256 on the CPU, the rule with --gpu)",
    )
    parser.add_argument(
        "--timing",
        action="store_true",
        help="run without _measure.LIVE_MEMORY_ENV: faster steps, memory readings that include glibc's caches",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (0: torch's default)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per (variant, length) process")
    parser.add_argument("--gpu", action="store_true", help="CUDA: 32 layers, lengths doubling to out of memory")
    parser.add_argument("--max-tokens", type=int, default=1 << 20)
    parser.add_argument("--smollm2", action="store_true", help="SmolLM2-135M shape: the longest step in a budget")
    parser.add_argument("--budget-gb", type=float, default=8.0)
    parser.add_argument("--confirm", action="store_true", help="--smollm2: run once at each predicted length")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape at short lengths (seconds)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--device", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    _check_args(parser, args)
    if args.one:
        work = sp_worker if args.one.startswith("sp2") else one
        print(json.dumps(work(args.one, args.tokens, args)))
        return
    if any(v.startswith("sp2") for v in args.variants) and (why := sp2_refusal()):
        print(why, file=sys.stderr)
        raise SystemExit(2)
    args.device = "cuda" if args.gpu else "cpu"
    args.shape = "tiny" if args.smoke else "smollm2-135m" if args.smollm2 else "llama3-8b"
    if args.gpu:
        args.layers = args.layers or 32
    if args.tile_tokens is None:
        args.tile_tokens = 0 if args.gpu else 64 if args.smoke else 256
    if args.lengths is None:
        args.lengths = (
            [256, 512, 1024]
            if args.smoke
            else [8192]
            if args.gpu
            else [2048, 4096]
            if args.smollm2
            else [1024, 2048, 4096]
        )
    result = gpu_main(args) if args.gpu else smollm2_main(args) if args.smollm2 else cpu_main(args)
    result = {
        "benchmark": "train_scale",
        "device": args.device,
        "shape": args.shape,
        "model": dict(SHAPES[args.shape], num_hidden_layers=args.layers or SHAPES[args.shape]["num_hidden_layers"]),
        "dtype": "float32" if args.smoke else "bfloat16",
        "chunk": args.chunk,
        "tile_tokens": args.tile_tokens or "ceil(tokens / hidden_size)",
        "threads": args.threads,
        "targets": TARGETS,
        **result,
    }
    print(table(result["rows"], args.variants, result))
    if args.out:
        write_text(args.out, json.dumps(result, indent=1))  # atomic: an interrupted write leaves no half a report
    print(json.dumps(result))


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One usage error (exit 2) for a value no run can use, and for an ``--out`` that cannot be written, before any
    step is measured (a run takes minutes to hours)."""
    bounds = {  # option: (value, the least allowed, what it is)
        "--lengths": (min(args.lengths or [2]), 2, "token counts of at least 2"),
        "--layers": (args.layers if args.layers is not None else 1, 1, "a positive number of layers"),
        "--chunk": (args.chunk, 1, "a positive loss_chunk_size"),
        "--tile-tokens": (args.tile_tokens if args.tile_tokens is not None else 0, 0, ">= 0 (0: DeepSpeed's rule)"),
        "--threads": (args.threads, 0, ">= 0 (0: torch's default)"),
        "--max-tokens": (args.max_tokens, 2, "at least 2 tokens"),
    }
    for option, (value, least, allowed) in bounds.items():
        if value < least:
            parser.error(f"{option}: got {value}; expected {allowed}")
    for option, value in (("--timeout", args.timeout), ("--budget-gb", args.budget_gb)):
        if not value > 0 or value == float("inf"):
            parser.error(f"{option}: got {value}; expected a positive finite number")
    if args.out:
        try:
            check_writable(args.out)
        except RopeExtendError as exc:
            parser.error(str(exc))


if __name__ == "__main__":
    main()
