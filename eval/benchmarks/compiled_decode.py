"""Compiled decoding, patched against unpatched (issue 70, item 4): tokens per second and greedy tokens.

    python eval/benchmarks/compiled_decode.py                  # CUDA: Llama-3-8B layers in bf16 (--layers of them)
    python eval/benchmarks/compiled_decode.py --smoke          # the CPU, a tiny shape: checks that it runs

Per variant, in a fresh process (a model compiled after another in the same process can meet the first one's
compiled frames and their guards: the 2026-11-27 lease ran two variants in one process, and the second compiled for
4 times as long and its two timed runs differed, which a run of its own did not repeat), one model (random weights
of the Llama-3-8B shape, L = 8192, ``--layers`` decoder layers), one prompt of ``--prompt`` tokens past L, ``--new``
greedy tokens with transformers' static cache: first eagerly (``generation_config.disable_compile``), then compiled
(generate's own path: the static cache with a ``CompileConfig``, which compiles the decoding step), the compiled run
once to compile and twice timed (the faster kept). Reported: the decoding rate of the timed eager and compiled runs
(new tokens over the generate call's time, prefill included, the same for both), the compile run's time, and whether
the compiled run's tokens equal the eager run's (the index of the first difference if not: in bf16 a fused kernel
rounds differently, and random weights leave small gaps between the top logits, so a difference late in the run is
rounding, not a wrong patch; the float32 check in tests/test_compiled.py is the exactness test). Variants:
``native``, ``yarn`` x4 (a frequency method: compiles whole) and ``self_extend`` (an attention method: its layers
run between graphs, ``hf.compiled``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _measure import spawn

from rope_extend.io import write_text

VARIANTS = {"native": ("none", {}), "yarn": ("yarn", {"factor": 4}), "self_extend": ("self_extend", {})}


def build(args):
    from _measure import LLAMA3_8B
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(LLAMA3_8B, max_position_embeddings=8192)
    if args.smoke:
        shape |= dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4)
        shape |= dict(num_key_value_heads=2, max_position_embeddings=256)
    shape["num_hidden_layers"] = args.layers
    torch.manual_seed(0)
    torch.set_default_dtype(args.dtype)
    with torch.device(args.device):
        model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    torch.set_default_dtype(torch.float32)
    return model


def generate(model, prompt, args, compiled: bool):
    from transformers import CompileConfig

    config = CompileConfig()
    config._compile_all_devices = args.smoke  # transformers compiles on the CPU only when told to
    extra = {"compile_config": config}
    if not compiled:
        extra = {"disable_compile": True}
    if args.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(
        prompt,
        max_new_tokens=args.new,
        min_new_tokens=args.new,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
        **extra,
    )
    if args.device == "cuda":
        torch.cuda.synchronize()
    return out[0, prompt.shape[1] :].cpu(), time.perf_counter() - start


def one(variant: str, args) -> dict:
    import rope_extend

    model = build(args)
    method, params = VARIANTS[variant]
    if method != "none":
        rope_extend.patch(model, method, **params)
    prompt = torch.randint(3, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(args.device)
    row: dict = {"variant": variant}
    try:
        generate(model, prompt, args, compiled=False)  # warm-up
        eager, eager_s = generate(model, prompt, args, compiled=False)
        _, compile_s = generate(model, prompt, args, compiled=True)
        compiled, compiled_s = generate(model, prompt, args, compiled=True)
        again, again_s = generate(model, prompt, args, compiled=True)  # a late recompile must not count
        compiled_s = min(compiled_s, again_s)
        same_again = bool(torch.equal(compiled, again))
    except Exception as exc:  # noqa: BLE001 (a variant that fails is reported beside the others)
        return row | {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
    same = bool(torch.equal(eager, compiled))
    first = None if same else int((eager != compiled).nonzero()[0, 0])
    return row | {
        "eager_tokens_per_s": round(args.new / eager_s, 2),
        "compiled_tokens_per_s": round(args.new / compiled_s, 2),
        "speedup": round(eager_s / compiled_s, 3),
        "compile_run_s": round(compile_s, 1),
        "tokens_equal": same,
        "compiled_runs_equal": same_again,
        "first_difference": first,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; --smoke 2)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 16384; --smoke 300)")
    p.add_argument("--new", type=int, default=None, help="new tokens (default 128; --smoke 8)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.device = "cpu" if args.smoke else "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device (--smoke runs it at tiny sizes on the CPU)")
    args.dtype = torch.float32 if args.smoke else torch.bfloat16
    args.layers = args.layers or (2 if args.smoke else 8)
    args.prompt = args.prompt or (300 if args.smoke else 16384)
    args.new = args.new or (8 if args.smoke else 128)
    bad = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if bad:
        p.error(f"unknown variants {', '.join(bad)}; allowed: {', '.join(VARIANTS)}")
    report = {
        "environment": {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "dtype": str(args.dtype),
            "layers": args.layers,
            "prompt": args.prompt,
            "new": args.new,
        },
        "rows": [],
    }
    if args.worker:
        print(json.dumps(one(args.worker, args)))
        return
    flags = ["--layers", str(args.layers), "--prompt", str(args.prompt), "--new", str(args.new)]
    flags += ["--smoke"] if args.smoke else []
    for variant in args.variants.split(","):
        got = spawn(__file__, ["--worker", variant, *flags])
        report["rows"].append({"variant": variant, **got} if "error" in got else got)
        print(json.dumps(report["rows"][-1]), flush=True)
        if args.out:
            write_text(args.out, json.dumps(report, indent=1))  # atomic: never half a report
    print(json.dumps(report))


if __name__ == "__main__":
    main()
