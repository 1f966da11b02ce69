"""Forward latency of a model patched with yarn vs the same model unpatched, measured in one run.

    python eval/benchmarks/patch_overhead.py [--layers 4 --hidden 512 --prefill 2048 --decode 128 --repeats 7]

Two copies of one small random Llama (same weights); one is patched with ``yarn`` (factor 4). For each
repeat, both run a prefill of ``--prefill`` tokens and ``--decode`` cached decode steps, in alternating
order so drift and noise hit both alike. Reports medians; the last line is JSON with the ratios
(patched / unpatched; target <= 1.02).
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
    cache = out.past_key_values
    token = out.logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(decode_steps):
        out = model(token, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
    sync(device)
    return prefill, time.perf_counter() - start


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
    args = parser.parse_args()

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
