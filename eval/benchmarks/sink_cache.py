"""Attention sinks (``rope_extend.SinkCache``) against the full cache over a long generation: tokens/s and memory.

    python eval/benchmarks/sink_cache.py                          # bundled model, 100k tokens with sinks
    python eval/benchmarks/sink_cache.py --tokens 20000 --full-tokens 20000

Greedy decoding one token per forward (a plain loop, so an end-of-sequence token cannot stop it), after a
64-token prompt. Each variant runs in a fresh subprocess. At every checkpoint it records the bytes of cached
keys and values, the process's resident memory (``/proc/self/statm``, current, not peak) and the decoding speed
since the previous checkpoint. ``sinks``: ``SinkCache(sink_tokens=4, window=252)`` (the bundled model's trained
length, 256, in all); ``full``: transformers' ``DynamicCache``, which grows with every token (run for fewer tokens,
``--full-tokens``: its attention costs grow with the length). The last line printed is JSON.

Targets (issue 27): the sink cache never grows past sinks + window, and memory stays flat over 100k tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from _measure import rss_mb, spawn


def worker(variant: str, tokens: int, every: int, sinks: int, window: int) -> dict:
    import torch
    from transformers import DynamicCache

    import rope_extend

    torch.manual_seed(0)
    model, _ = rope_extend.load("bundled")
    cache = rope_extend.SinkCache(model, sinks, window) if variant == "sinks" else DynamicCache()
    ids = torch.randint(3, 1000, (1, 64))
    points = []
    with torch.inference_mode():
        out = model(ids, **rope_extend.cache_kwargs(cache), use_cache=True)
        start = last = time.perf_counter()
        for step in range(1, tokens + 1):
            token = out.logits[:, -1:].argmax(-1)
            out = model(token, **rope_extend.cache_kwargs(cache), use_cache=True)
            if step % every == 0 or step == tokens:
                now = time.perf_counter()
                held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
                points.append(
                    {
                        "tokens": step,
                        "cached_tokens": cache.held if variant == "sinks" else cache.get_seq_length(),
                        "cache_mb": round(held / 2**20, 3),
                        "rss_mb": round(rss_mb(), 1),
                        "tokens_per_s": round(every / (now - last), 1) if step % every == 0 else None,
                    }
                )
                last = now
                print(json.dumps({"variant": variant, **points[-1]}), file=sys.stderr, flush=True)
        total = time.perf_counter() - start
    return {"variant": variant, "tokens": tokens, "seconds": round(total, 1), "points": points}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000, help="tokens generated with the sink cache")
    parser.add_argument("--full-tokens", type=int, default=20_000, help="tokens generated with the full cache")
    parser.add_argument("--every", type=int, default=10_000, help="tokens between checkpoints")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=252)
    parser.add_argument("--worker", nargs=2, metavar=("VARIANT", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        variant, tokens = args.worker[0], int(args.worker[1])
        print(json.dumps(worker(variant, tokens, args.every, args.sinks, args.window)))
        return
    results = {}
    for variant, tokens in (("sinks", args.tokens), ("full", args.full_tokens)):
        if tokens <= 0:
            continue
        command = ["--worker", variant, str(tokens), "--every", str(args.every)]
        command += ["--sinks", str(args.sinks), "--window", str(args.window)]
        got = spawn(__file__, command)
        if got.get("error"):
            raise SystemExit(f"{variant} failed:\n{got['stderr']}")
        results[variant] = got
    print("| variant | tokens | cached tokens | cache MB | RSS MB | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for variant, result in results.items():
        for p in result["points"]:
            print(
                f"| {variant} | {p['tokens']} | {p['cached_tokens']} | {p['cache_mb']:.2f} | {p['rss_mb']:.0f} | "
                f"{p['tokens_per_s'] if p['tokens_per_s'] is not None else '-'} |"
            )
    sinks = results.get("sinks", {}).get("points", [])
    if sinks:
        flat = max(p["cached_tokens"] for p in sinks) <= args.sinks + args.window
        rss = [p["rss_mb"] for p in sinks]
        print(
            f"sinks: cache at most {max(p['cached_tokens'] for p in sinks)} tokens "
            f"({'met' if flat else 'NOT met'}); RSS {min(rss):.0f}-{max(rss):.0f} MB over {args.tokens} tokens"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
