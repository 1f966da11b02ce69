"""Forward latency of patched models, each against a baseline measured in the same run.

    python eval/benchmarks/patch_overhead.py [--layers 4 --hidden 512 --prefill 2048 --decode 128 --repeats 7]
    python eval/benchmarks/patch_overhead.py --dynamic [--dynamic-steps 1024]

1. Static patch (default): two copies of one small random Llama (same weights); one is patched with
   ``yarn`` (factor 4). For each repeat, both run a prefill of ``--prefill`` tokens and ``--decode`` cached
   decode steps, in alternating order so drift and noise hit both alike. Ratio: patched / unpatched,
   medians; target <= 1.02.
2. ``--dynamic``: cached decoding across the original length, where dynamic methods change their
   frequencies and re-rotate the cached keys (``rope_extend.hf.cache_keeper``): a prompt of ``L/2`` tokens, then
   ``--dynamic-steps`` decode steps up to ``4L`` (``L = steps / 3.5``), for static ``yarn`` and for
   ``dynamic``, ``dynamic_yarn`` and ``longrope`` (factor 4), interleaved per repeat. Ratio: mean decode-step
   time over yarn's (target <= 1.05), and the worst single step over yarn's median step.

The last line is JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import transformers as T

import rope_extend
from rope_extend.hf import cache_name


def build(args):
    config = T.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        max_position_embeddings=args.prefill // 4,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(config).eval().to(args.device)
    if args.dtype == "bf16":
        model.to(torch.bfloat16)
    return model


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def run(model, ids, decode_steps, device):
    sync(device)
    start = time.perf_counter()
    out = model(ids, use_cache=True)
    sync(device)
    prefill = time.perf_counter() - start
    cache = cache_name.returned(out)
    token = out.logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(decode_steps):
        out = model(token, **cache_name.cache_kwargs(cache), use_cache=True)
        cache = cache_name.returned(out)
        token = out.logits[:, -1:].argmax(-1)
    sync(device)
    return prefill, time.perf_counter() - start


@torch.no_grad()
def decode_steps(model, ids, steps, device) -> list[float]:
    """Per-step times of ``steps`` cached greedy decode steps after a prefill of ``ids``."""
    out = model(ids, use_cache=True)
    cache, token, times = cache_name.returned(out), out.logits[:, -1:].argmax(-1), []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        out = model(token, **cache_name.cache_kwargs(cache), use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        sync(device)
        times.append(time.perf_counter() - start)
        cache = cache_name.returned(out)
    return times


def dynamic(args) -> dict:
    original = round(args.dynamic_steps / 3.5)
    args.prefill = original * 4  # build() sets max_position_embeddings = prefill // 4 = L
    base = build(args)
    half = base.config.head_dim // 2
    longrope = {"short_factor": [1.0] * half, "long_factor": [1.0 + 3.0 * i / half for i in range(half)]}
    models = {
        name: rope_extend.patch(copy.deepcopy(base), name, factor=4, **(longrope if name == "longrope" else {}))
        for name in ("yarn", "dynamic", "dynamic_yarn", "longrope")
    }
    torch.manual_seed(1)
    ids = torch.randint(0, args.vocab, (1, original // 2), device=args.device)
    for model in models.values():
        decode_steps(model, ids, 8, args.device)  # warm-up
    steps: dict[str, list[list[float]]] = {name: [] for name in models}
    names = list(models)
    for i in range(args.repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate the order each repeat
            steps[name].append(decode_steps(models[name], ids, args.dynamic_steps, args.device))
    # per step, the median over repeats; then the mean over steps
    per_step = {
        name: [statistics.median(r[j] for r in runs) for j in range(args.dynamic_steps)] for name, runs in steps.items()
    }
    mean = {name: statistics.fmean(ts) for name, ts in per_step.items()}
    yarn_median = statistics.median(per_step["yarn"])
    print(
        f"device {args.device}, {args.layers} layers x {args.hidden} hidden, L={original}, decode "
        f"{original // 2} -> {original // 2 + args.dynamic_steps} tokens, median of {args.repeats} per step"
    )
    print(f"{'method':14}{'mean step (ms)':>16}{'ratio to yarn':>16}{'worst step / yarn median':>28}")
    result = {
        "benchmark": "patch_overhead_dynamic",
        "device": args.device,
        "original_length": original,
        "steps": args.dynamic_steps,
        "target": 1.05,
    }
    for name in names:
        ratio, worst = mean[name] / mean["yarn"], max(per_step[name]) / yarn_median
        print(f"{name:14}{mean[name] * 1e3:>16.2f}{ratio:>16.3f}{worst:>28.2f}")
        if name != "yarn":
            result[name] = {"ratio": round(ratio, 4), "worst_step": round(worst, 2)}
    result["pass"] = all(result[n]["ratio"] <= 1.05 for n in names if n != "yarn")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--dynamic", action="store_true", help="decode across L with the dynamic methods vs yarn")
    parser.add_argument("--dynamic-steps", type=int, default=1024)
    args = parser.parse_args()
    if args.dynamic:
        print(json.dumps(dynamic(args)))
        return

    plain = build(args)
    patched = rope_extend.patch(copy.deepcopy(plain), "yarn", factor=4)
    torch.manual_seed(1)
    ids = torch.randint(0, args.vocab, (1, args.prefill), device=args.device)
    run(plain, ids, 4, args.device)  # warm-up both
    run(patched, ids, 4, args.device)

    times = {"plain": [], "patched": []}
    for i in range(args.repeats):
        order = (("plain", plain), ("patched", patched)) if i % 2 == 0 else (("patched", patched), ("plain", plain))
        for name, model in order:
            times[name].append(run(model, ids, args.decode, args.device))

    med = {
        name: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)) for name, ts in times.items()
    }
    prefill_ratio = med["patched"][0] / med["plain"][0]
    decode_ratio = med["patched"][1] / med["plain"][1]
    print(
        f"device {args.device}, {args.layers} layers x {args.hidden} hidden, vocab {args.vocab}, "
        f"median of {args.repeats}"
    )
    print(f"{'':10}{'prefill ' + str(args.prefill) + ' (ms)':>22}{str(args.decode) + ' decode steps (ms)':>24}")
    for name in ("plain", "patched"):
        print(f"{name:10}{med[name][0] * 1e3:>22.1f}{med[name][1] * 1e3:>24.1f}")
    ratio = max(prefill_ratio, decode_ratio)
    print(
        json.dumps(
            {
                "benchmark": "patch_overhead",
                "device": args.device,
                "prefill_ratio": round(prefill_ratio, 4),
                "decode_ratio": round(decode_ratio, 4),
                "ratio": round(ratio, 4),
                "target": 1.02,
                "pass": ratio <= 1.02,
            }
        )
    )


if __name__ == "__main__":
    main()
