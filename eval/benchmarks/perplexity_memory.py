"""Peak memory and throughput of rope-extend's perplexity harness vs the naive ``model(ids, labels=ids)``.

    python eval/benchmarks/perplexity_memory.py                 # CPU: random Llama, 32k vocab, 8192 tokens
    python eval/benchmarks/perplexity_memory.py --gpu           # GPU: Llama-3-8B-shaped bf16, 32k/64k/128k
    python eval/benchmarks/perplexity_memory.py --model smollm2-135m --lengths 16384 --repeats 1   # a real model

Each variant runs in a fresh subprocess, so one variant's allocations cannot hide in the other's peak.
CPU memory is the process's peak RSS (``resource.getrusage(...).ru_maxrss``): the table shows the peak and
the increase over the peak after model construction and a short warm-up (what one window costs); the ratio
uses the increase. GPU memory is ``torch.cuda.max_memory_allocated`` after resetting the peak.
Throughput is scored tokens per second of the best of ``--repeats`` runs. The last line printed is JSON.

Why the naive loop is heavy: at L tokens and vocabulary V it holds the logits (L x V), their float32 copy
and log-softmax: 8192 x 32000 x 4 bytes = 1.05 GB each; the harness holds ``chunk x V`` at a time.
Targets (issue 3): memory ratio <= 0.3, throughput ratio >= 0.9.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from _measure import LLAMA3_8B, fmt, measure, spawn

SHAPES = {
    # small random Llama for CPU: the LM head (32k vocab) dominates the naive loop's memory
    "cpu": dict(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    ),
    "llama3-8b": LLAMA3_8B,
}


def worker(variant: str, length: int, shape: str, device: str, repeats: int, seed: int, name: str | None) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rope_extend.evaluation import perplexity

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if name:  # a real model by path or name (smollm2-135m), loaded the way rope-extend loads models
        from rope_extend.loading import load_model

        model = load_model(name, dtype=dtype, device=device)
        config = model.config
    else:
        config = LlamaConfig(**SHAPES[shape], max_position_embeddings=max(length, 8192))
        config._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
        torch.set_default_dtype(torch.float32)
    ids = torch.randint(3, config.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))

    class Ids:  # the harness's tokenizer interface, handing over fixed ids
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": ids[: int(text)].tolist()}

    def run(n: int) -> float:
        if variant == "naive":
            x = ids[:n][None].to(device)
            with torch.no_grad():
                return float(model(input_ids=x, labels=x).loss)
        return math.log(perplexity(model, Ids(), [str(n)], [n], progress=False).perplexity[n])

    run(256)  # warm-up: kernels, allocator pools
    got = measure(lambda: run(length), repeats=repeats, device=device)
    loss = got.pop("result")
    return {
        "variant": variant,
        "length": length,
        "shape": shape,
        "device": device,
        "loss": float("nan") if loss is None else loss,
        "tokens_per_s": (length - 1) / got["seconds"] if got["seconds"] else None,
        **got,
    }


def run_variant(variant: str, args) -> dict:
    cmd = ["--worker", variant, "--length", str(args.length_now), "--shape", args.shape, "--device", args.device]
    cmd += ["--repeats", str(args.repeats), "--seed", str(args.seed)] + (["--model", args.model] if args.model else [])
    return {"variant": variant, "length": args.length_now, **spawn(__file__, cmd)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", action="store_true", help="Llama-3-8B-shaped bf16 model on CUDA at 32k, 64k, 128k")
    p.add_argument("--lengths", help="comma-separated token counts (default 8192; with --gpu 32768,65536,131072)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="a model folder or name (smollm2-135m) instead of a random Llama")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    p.add_argument("--device", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(
            json.dumps(worker(args.worker, args.length, args.shape, args.device, args.repeats, args.seed, args.model))
        )
        return
    args.shape = args.model or args.shape or ("llama3-8b" if args.gpu else "cpu")
    args.device = args.device or ("cuda" if args.gpu else "cpu")
    lengths = [int(x) for x in (args.lengths or ("32768,65536,131072" if args.gpu else "8192")).split(",")]
    rows, ratios = [], {}
    for length in lengths:
        args.length_now = length
        pair = {v: run_variant(v, args) for v in ("harness", "naive")}
        rows += pair.values()
        h, n = pair["harness"], pair["naive"]
        ok = not h.get("error") and not n.get("error")
        ratios[str(length)] = {
            "memory_ratio": round(h["increase_mb"] / n["increase_mb"], 4) if ok else None,
            "peak_memory_ratio": round(h["peak_mb"] / n["peak_mb"], 4) if ok else None,
            "throughput_ratio": round(h["tokens_per_s"] / n["tokens_per_s"], 4) if ok else None,
            "loss_rel_diff": abs(h["loss"] - n["loss"]) / abs(n["loss"]) if ok else None,
            "naive_error": n.get("error"),
            "harness_error": h.get("error"),
        }
    print(f"{'variant':8} {'length':>7} {'peak MB':>9} {'+MB':>9} {'tokens/s':>10} {'loss':>9}  error")
    for r in rows:
        print(
            f"{r['variant']:8} {r['length']:>7} {fmt(r.get('peak_mb'), '9.0f')} {fmt(r.get('increase_mb'), '9.0f')} "
            f"{fmt(r.get('tokens_per_s'), '10.0f')} {fmt(r.get('loss'), '9.4f')}  {r.get('error') or ''}"
        )
    device = next((r.get("gpu") for r in rows if r.get("gpu")), None) or f"cpu ({os.cpu_count()} cores)"
    print(
        json.dumps(
            {
                "benchmark": "perplexity_memory",
                "device": device,
                "shape": args.shape,
                "targets": {"memory_ratio": "<= 0.3", "throughput_ratio": ">= 0.9"},
                "ratios": ratios,
            }
        )
    )


if __name__ == "__main__":
    main()
