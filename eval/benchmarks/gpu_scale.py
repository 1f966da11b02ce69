"""Everything issue 25 asks of a GPU, in one command, printed as one JSON document (random weights of real
shapes: nothing is downloaded).

    python eval/benchmarks/gpu_scale.py                       # CUDA: the Llama-3-8B shape in bf16
    python eval/benchmarks/gpu_scale.py --sections prefill --lengths 32768,65536
    python eval/benchmarks/gpu_scale.py --smoke               # any machine, tiny shapes: checks that it runs

Sections (``--sections``, default all), each against a baseline measured in the same run:

- ``prefill``: the Llama-3-8B shape (32 layers, 32/8 heads of 128, 4096 hidden, 14336 MLP, 128k vocabulary;
  ``--layers`` fewer to save time), one prefill of each length with a KV cache, then ``--decode`` cached
  decode steps. Variants: the model unpatched (``native``: its own attention implementation, SDPA or
  ``--attn flash_attention_2``), ``yarn`` x4 (a frequency method: should cost nothing), ``self_extend``,
  ``dual_chunk``, ``rerope`` and ``string`` (the attention methods, with L = 8192). Ratios over native: prefill
  time (target <= 1.3), peak memory (<= 1.1), median decode step (<= 1.2).
- ``perplexity``: ``perplexity_memory.py --gpu`` (the harness against ``model(labels=...)`` at 32k-128k).
- ``train``: ``train_memory.py --gpu`` (the longest context at which one LoRA step fits, with and without
  activation checkpointing).
- ``attention``: ``attention_methods.py --gpu`` (the attention methods' forward against SDPA).

Each variant and each section runs in a fresh subprocess, so one's allocations cannot hide in another's
peak; a variant that runs out of memory is reported as such, beside the others. GPU memory is
``torch.cuda.max_memory_allocated`` after a reset of the peak, so on CUDA one process measures a variant's
lengths one after another (its model built once; each length's cache freed before the next); on the CPU, whose
peak RSS cannot be reset, each length gets its own process. Times are the fastest of ``--repeats``. ``--out``
rewrites the report after every variant (to a temporary name, then renamed), so a run stopped by a time limit
keeps what it measured; ``--worker-timeout`` bounds each process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from _measure import LLAMA3_8B, fmt, measure, spawn

from rope_extend.io import write_text

HERE = os.path.dirname(os.path.abspath(__file__))
FULL_SHAPE = dict(LLAMA3_8B, max_position_embeddings=8192)  # L = 8192, as Llama 3
TINY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
VARIANTS = {
    "native": ("none", {}),
    "yarn": ("yarn", {"factor": 4}),
    "self_extend": ("self_extend", {}),
    "dual_chunk": ("dual_chunk", {}),
    "rerope": ("rerope", {}),
    "string": ("string", {}),
}
TARGETS = {"prefill_time": 1.3, "peak_memory": 1.1, "decode_step": 1.2}
SECTIONS = ("prefill", "perplexity", "train", "attention")
# what the other benchmarks run as this script's sections: on a GPU, and with --smoke on the CPU at small sizes
SUBSCRIPTS = {
    "perplexity": ("perplexity_memory.py", ["--gpu"], ["--lengths", "1024", "--repeats", "1"]),
    "train": ("train_memory.py", ["--gpu"], ["--tokens", "512", "--steps", "2", "--rounds", "1"]),
    "attention": ("attention_methods.py", ["--gpu"], ["--lengths", "1024", "--variants", "sdpa,self_extend"]),
}


def worker(variant: str, lengths: list[int], args) -> list[dict]:
    """One variant at each of ``lengths`` in this process (one model): prefill with a cache, then ``args.decode``
    decode steps."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import rope_extend

    device, dtype = args.device, getattr(torch, args.dtype)
    shape = dict(TINY if args.smoke else FULL_SHAPE)
    shape["num_hidden_layers"] = args.layers or shape["num_hidden_layers"]
    config = LlamaConfig(**shape)
    config._attn_implementation = args.attn
    torch.manual_seed(args.seed)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    method, params = VARIANTS[variant]
    if method != "none":
        rope_extend.patch(model, method, **params)
    return [{"variant": variant, **_one_length(model, config, length, args)} for length in lengths]


def _one_length(model, config, length: int, args) -> dict:
    """Prefill ``length`` random tokens with a cache, then decode ``args.decode`` more; every tensor it made is
    freed before it returns."""
    import torch
    from transformers import DynamicCache

    import rope_extend

    device = args.device
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(3, config.vocab_size, (1, length + args.decode), generator=generator).to(device)

    def prefill(n: int):
        cache = DynamicCache(config=config)
        with torch.no_grad():
            out = model(input_ids=ids[:, :n], **rope_extend.cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        return cache, out.logits

    prefill(min(length, 256))  # warm-up: kernels, allocator pools
    got = measure(lambda: prefill(length), repeats=args.repeats, device=device)
    result = got.pop("result")
    steps: list[float] = []
    finite = None
    if result is not None:
        cache, logits = result
        finite = bool(torch.isfinite(logits).all())
        for t in range(args.decode):
            token = ids[:, length + t : length + t + 1]
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                model(input_ids=token, **rope_extend.cache_kwargs(cache), use_cache=True)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            steps.append(time.perf_counter() - start)
        del cache, logits
    del result
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {
        "length": length,
        "finite": finite,
        "decode_step_s": statistics.median(steps[1:] or steps) if steps else None,  # the first step warms up
        **got,
    }


def prefill_section(args, save=None) -> dict:
    """Every variant at every length (``save(section)`` after each variant), and the ratios over native."""
    rows: list[dict] = []
    cuda = args.device.startswith("cuda")
    for variant in args.variants:
        for group in [args.lengths] if cuda else [[n] for n in args.lengths]:
            cmd = ["--worker", variant, "--length", ",".join(map(str, group))] + worker_flags(args)
            got = spawn(__file__, cmd, timeout=args.worker_timeout)
            found = got if isinstance(got, list) else [dict(got) for _ in group]  # an error: every length's
            rows += [{"variant": variant, "length": n, **row} for n, row in zip(group, found, strict=True)]
        if save:
            save(_prefill_summary(rows, args))
    return _prefill_summary(rows, args)


def _prefill_summary(rows: list[dict], args) -> dict:
    ratios: dict[str, dict] = {}
    for length in args.lengths:
        found = {r["variant"]: r for r in rows if r["length"] == length}
        base = found.get("native")
        for variant in args.variants[1:]:
            if base is not None and variant in found:
                ratios.setdefault(variant, {})[str(length)] = prefill_ratios(found[variant], base)
    met = {
        v: all(cell[k] is not None and cell[k] <= TARGETS[k] for cell in cells.values() for k in TARGETS)
        for v, cells in ratios.items()
    }
    return {"rows": rows, "ratios": ratios, "targets": {k: f"<= {t}" for k, t in TARGETS.items()}, "met": met}


def prefill_ratios(r: dict, base: dict) -> dict:
    """``r`` over ``base``: prefill time, peak memory and decode step (None where either failed)."""
    if r.get("error") or base.get("error"):
        return {k: None for k in TARGETS} | {"error": r.get("error") or base.get("error")}

    def over(key):
        return round(r[key] / base[key], 3) if r.get(key) and base.get(key) else None

    return {"prefill_time": over("seconds"), "peak_memory": over("peak_mb"), "decode_step": over("decode_step_s")}


def worker_flags(args) -> list[str]:
    flags = ["--device", args.device, "--dtype", args.dtype, "--attn", args.attn, "--decode", str(args.decode)]
    flags += ["--repeats", str(args.repeats), "--seed", str(args.seed)]
    flags += ["--layers", str(args.layers)] if args.layers else []
    return flags + (["--smoke"] if args.smoke else [])


def subscript_section(name: str, args) -> dict:
    script, gpu_flags, smoke_flags = SUBSCRIPTS[name]
    return spawn(os.path.join(HERE, script), smoke_flags if args.smoke else gpu_flags)


def environment(args) -> dict:
    import torch
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": args.device,
        "dtype": args.dtype,
        "attn_implementation": args.attn,
        "shape": "tiny (--smoke)" if args.smoke else "Llama-3-8B",
        "layers": args.layers or (TINY if args.smoke else FULL_SHAPE)["num_hidden_layers"],
    }
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return info


def parse_args() -> argparse.Namespace:
    """The command line, checked (``argparse`` exits with a usage line on a bad value)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, from: " + ", ".join(SECTIONS))
    p.add_argument("--lengths", help="prefill lengths (default 32768,65536,131072; with --smoke 512)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    p.add_argument("--layers", type=int, help="decoder layers of the prefill model (default: the shape's own)")
    p.add_argument("--decode", type=int, default=16, help="cached decode steps after each prefill")
    p.add_argument("--attn", default="sdpa", help="the model's attn_implementation (sdpa, flash_attention_2, ...)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks that every section runs")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help="also write the JSON report here, rewritten after each variant and section")
    p.add_argument("--worker-timeout", type=float, help="seconds each measuring process may run (default: no limit)")
    p.add_argument("--length", help=argparse.SUPPRESS)
    p.add_argument("--device", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.dtype = args.dtype or ("float32" if args.smoke else "bfloat16")
    if args.worker:
        return args
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            p.error("no CUDA device: this benchmark is for a GPU (--smoke runs it at tiny sizes on the CPU)")
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    bad_variants = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown or bad_variants:
        p.error(
            f"unknown {'sections ' + ', '.join(unknown) if unknown else 'variants ' + ', '.join(bad_variants)}; "
            f"allowed: {', '.join(SECTIONS if unknown else VARIANTS)}"
        )
    args.variants = ["native"] + [v for v in args.variants.split(",") if v != "native"]
    args.lengths = [int(x) for x in (args.lengths or ("512" if args.smoke else "32768,65536,131072")).split(",")]
    args.sections = sections
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, [int(n) for n in args.length.split(",")], args)))
        return
    report = {"environment": environment(args), "sections": {}}

    def save(section: str, got: dict) -> None:
        report["sections"][section] = got
        if args.out:
            write_text(args.out, json.dumps(report, default=str, indent=1))  # atomic: never half a report

    for section in args.sections:
        start = time.perf_counter()
        if section == "prefill":
            got = prefill_section(args, lambda partial: save("prefill", {**partial, "partial": True}))
        else:
            got = subscript_section(section, args)
        got["wall_s"] = round(time.perf_counter() - start, 1)
        save(section, got)
        print(f"{section}: {got['wall_s']} s", file=sys.stderr)
    prefill = report["sections"].get("prefill")
    if prefill:
        print(
            f"{'variant':12} {'length':>7} {'prefill s':>10} {'peak MB':>10} {'decode ms':>10}  error", file=sys.stderr
        )
        for r in prefill["rows"]:
            step = r.get("decode_step_s")
            print(
                f"{r['variant']:12} {r['length']:>7} {fmt(r.get('seconds'), '10.2f')} {fmt(r.get('peak_mb'), '10.0f')} "
                f"{fmt(step * 1000 if step else None, '10.1f')}  {r.get('error') or ''}",
                file=sys.stderr,
            )
    print(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
