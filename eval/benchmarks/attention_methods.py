"""Peak memory and time of the attention methods (self_extend, dual_chunk, rerope) vs plain SDPA.

    python eval/benchmarks/attention_methods.py                  # CPU: random Llama, L=4096, 8192 and 16384 tokens
    python eval/benchmarks/attention_methods.py --gpu            # GPU: the same shape in bf16 at 16k and 32k
    python eval/benchmarks/attention_methods.py --model bundled --lengths 4096   # a real model
    python eval/benchmarks/attention_methods.py --dtype bfloat16 # CPU bf16: passes in bf16 vs float32 passes

One forward (no cache, ``logits_to_keep=1``) over the whole sequence. Each variant runs in a fresh
subprocess, so one variant's allocations cannot hide in another's peak. CPU memory is the process's peak RSS
(``ru_maxrss``) in a second run of the variant under ``_measure.LIVE_MEMORY_ENV`` (glibc maps and frees every
large block on its own, so RSS follows the live tensors; with the default allocator the same forward's reading
varies by a quarter between runs, printed as ``cached_increase_mb``); the ratio uses the increase over the peak
after model construction and a warm-up forward (what the long forward costs). Time comes from the first run.
GPU memory is ``torch.cuda.max_memory_allocated`` after resetting the peak. Time is the best of ``--repeats``
forwards. The random model is shaped for attention to dominate: head dimension 128 as in Llama 2, trained length ``L = 4096``, so the methods run with their usual parameters
(Self-Extend ``group_size=8, window=1024``, reaching 25600 tokens; Dual Chunk defaults ``C = 3L/4 = 3072``,
``w = L/16 = 256``; ReRoPE ``window = L/4``). The last line printed is JSON.
Targets (issue 25): in float32 on the CPU, self_extend and dual_chunk within 1.0x the memory and 1.25x the
time of SDPA (issue 11 asked for 1.5x and 3x). With ``--dtype bfloat16`` (or float16) each method also runs
as ``METHOD/f32`` with its passes upcast to float32 (what every pass did before issue 25; this benchmark
patches ``rope_extend.hf.attention.passes.compute_dtype`` for it), and ``half_vs_f32_memory`` is the method's
memory increase over that variant's: target <= 0.6.
"""

from __future__ import annotations

import argparse
import json
import os

from _measure import LIVE_MEMORY_ENV, fmt, measure, spawn

SHAPE = dict(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
VARIANTS = {
    "sdpa": ("none", {}),
    "self_extend": ("self_extend", {"group_size": 8, "window": 1024}),
    "dual_chunk": ("dual_chunk", {}),
    "rerope": ("rerope", {}),
    "leaky_rerope": ("leaky_rerope", {}),
}
MOVING = ("self_extend", "rerope", "leaky_rerope")  # decode steps that read turned keys: ``--turn`` variants
TARGETS = {"self_extend": (1.0, 1.25), "dual_chunk": (1.0, 1.25)}
HALF_TARGET = 0.6
DECODE_TARGET = 1.2  # a decode step's time over SDPA's (issues 25 and 68)
DTYPES = ("float32", "bfloat16", "float16")


def worker(
    variant: str,
    length: int,
    device: str,
    repeats: int,
    seed: int,
    name: str | None,
    dtype: str,
    layer: bool,
    decode: bool = False,
) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import rope_extend

    dtype = getattr(torch, dtype)
    variant, _, suffix = variant.partition("/")
    switch(suffix)
    if name:
        from rope_extend.loading import load_model

        model = load_model(name, dtype=dtype, device=device)
    else:
        config = LlamaConfig(**SHAPE)
        config._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
        torch.set_default_dtype(torch.float32)
    method, params = VARIANTS[variant]
    if method != "none":
        rope_extend.patch(model, method, **({} if name else params))  # a named model: defaults from its own L
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed)).to(device)

    def run(n: int) -> torch.Tensor:
        with torch.no_grad():
            if layer:
                return one_call(model, n, dtype, device, seed, decode)
            return model(input_ids=ids[:, :n], use_cache=False, logits_to_keep=1).logits

    extra = {}
    if decode and not layer:  # a cache of length - 1 tokens, then steps of one token (the cache grows by one each)
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, : length - 1], **rope_extend.cache_kwargs(cache), use_cache=True, logits_to_keep=1)

        def step() -> torch.Tensor:  # not cropped back: a crop replaces the key tensors, which drops kept keys
            with torch.no_grad():
                return model(input_ids=ids[:, length - 1 :], **rope_extend.cache_kwargs(cache), use_cache=True).logits

        step()  # warm-up (and the step that makes the kept keys)
        got = measure(step, repeats=repeats, device=device)
        extra = key_memory(cache)
    else:
        run(512)  # warm-up: kernels, allocator pools
        if layer:
            run(length)  # draws the inputs
        got = measure(lambda: run(length), repeats=repeats, device=device)
        if decode:
            extra = key_memory(_INPUTS["cache"])
    last = got.pop("result")
    finite = bool(torch.isfinite(last).all()) if last is not None else None
    name = variant + (f"/{suffix}" if suffix else "")
    return {"variant": name, "length": length, "device": device, "finite": finite, **got, **extra}


def switch(suffix: str) -> None:
    """A variant's suffix: ``f32``, the passes upcast to float32 (as before issue 25); ``turn``, every cached key
    turned at every step (kept keys off, as before issue 68)."""
    import torch

    if suffix == "f32":
        from rope_extend.hf.attention import passes

        passes.compute_dtype = lambda _dtype: torch.float32  # where the passes read it
    if suffix == "turn":
        from rope_extend.hf.attention import keys

        keys.KEEP = False


def key_memory(cache) -> dict:
    """MB of the cache's keys, and of the turned keys kept beside them (``hf.attention.keys``; 0 without)."""
    from rope_extend.hf.attention import keys

    cached = kept = 0
    for layer in cache.layers:
        cached += layer.keys.nbytes
        held = layer.__dict__.get(keys.KEPT_ATTR)
        kept += sum(space.nbytes for space, _ in held.spaces.values()) if held is not None else 0
    return {"key_cache_mb": round(cached / 2**20, 1), "kept_keys_mb": round(kept / 2**20, 1)}


LAYER = dict(heads=32, kv_heads=8, head_dim=128)  # Llama-3-8B's attention
_INPUTS: dict = {}  # one_call's queries, keys and values


def one_call(model, n: int, dtype, device: str, seed: int, decode: bool = False):
    """One call of layer 0's attention function on random queries, keys and values of ``LAYER``'s shape
    (``decode``: one query over a ``DynamicCache`` of ``n - 1`` keys, the call's key appended to it first, its
    ``torch.cat`` timed with the call for every variant, as in a decode step; the cache grows by one per call)."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from rope_extend.hf import attention

    h, kv, d = LAYER["heads"], LAYER["kv_heads"], LAYER["head_dim"]
    key = (n, decode)
    if key not in _INPUTS:  # drawn once, outside the timed calls (drawing 16k keys costs more than a decode step)
        _INPUTS.clear()
        g = torch.Generator(device=device).manual_seed(seed)
        q = torch.randn(1, h, 1 if decode else n, d, generator=g, device=device, dtype=dtype)
        _INPUTS[key] = (q, *(torch.randn(1, kv, n, d, generator=g, device=device, dtype=dtype) for _ in range(2)))
    q, k, v = _INPUTS[key]
    module = model.model.layers[0].self_attn
    plan = module.__dict__.get(attention.PLAN_ATTR)
    if decode:  # a DynamicCache of n - 1 keys; each call appends the last key again, as a decode step would
        from transformers import DynamicCache

        from rope_extend.hf.attention import keys

        if "cache" not in _INPUTS:
            _INPUTS["cache"] = DynamicCache()
            _INPUTS["cache"].update(k[:, :, :-1], v[:, :, :-1], 0)
        cache = _INPUTS["cache"]
        if plan is not None:  # what the decoder's cache recorder and the module's pre-hook do before the update
            plan.recorder.cache = cache
            keys.check(module, ())
        k, v = cache.update(k[:, :, -1:], v[:, :, -1:], 0)  # (1, H_kv, m, D): the cache's own tensors
        n = k.shape[2]
    positions = torch.arange(n - q.shape[2], n, device=device)[None]
    if plan is not None:
        return attention.attention_forward(module, q, k, v, None, scaling=d**-0.5, position_ids=positions)[0]
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, None, scaling=d**-0.5, position_ids=positions)[0]


def run_variant(variant: str, length: int, args) -> dict:
    cmd = ["--worker", variant, "--length", str(length), "--device", args.device, "--dtype", args.dtype]
    cmd += ["--layer"] if args.layer else []
    cmd += ["--decode"] if args.decode else []
    cmd += ["--repeats", str(args.repeats), "--seed", str(args.seed)] + (["--model", args.model] if args.model else [])
    timed = spawn(__file__, cmd)
    # a decode step's memory is the kept keys' (``key_memory``, exact); one run per variant halves the time
    if args.device != "cpu" or timed.get("error") or args.decode:
        return {"variant": variant, "length": length, **timed}
    live = spawn(__file__, cmd, env=LIVE_MEMORY_ENV)  # memory from a run whose RSS follows the live tensors
    memory = {k: live.get(k) for k in ("base_mb", "peak_mb", "increase_mb")}
    return {"variant": variant, "length": length, **timed, **memory, "cached_increase_mb": timed.get("increase_mb")}


def ratio(r: dict, base: dict) -> dict:
    """``r``'s memory increase, peak and time over ``base``'s (None where either failed)."""
    ok = not r.get("error") and not base.get("error")
    return {
        # a decode step may add nothing to the peak (RSS grows by pages): no ratio of a zero
        "memory_ratio": round(r["increase_mb"] / base["increase_mb"], 3) if ok and base["increase_mb"] > 0 else None,
        "peak_memory_ratio": round(r["peak_mb"] / base["peak_mb"], 3) if ok else None,
        "time_ratio": round(r["seconds"] / base["seconds"], 3) if ok else None,
        "error": r.get("error") or base.get("error"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", action="store_true", help="bf16 on CUDA at 16k and 32k tokens")
    p.add_argument("--lengths", help="comma-separated token counts (default 8192,16384; with --gpu 16384,32768)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="a model folder or name (bundled) instead of the random Llama")
    p.add_argument(
        "--layer",
        action="store_true",
        help="time one attention call of Llama-3-8B's shape (32/8 heads, dim 128) instead of the whole forward",
    )
    p.add_argument(
        "--decode",
        action="store_true",
        help="time one decode step over a cache of LENGTH - 1 tokens (with --layer: one query over LENGTH keys); "
        "the memory ratios are then of that step",
    )
    p.add_argument(
        "--turn",
        action="store_true",
        help="with --decode: also run " + ", ".join(MOVING) + " as METHOD/turn, turning every cached key at every "
        "step (no kept keys, hf.attention.keys.KEEP = False: the path before issue 68)",
    )
    p.add_argument("--dtype", choices=DTYPES, help="the model's dtype (default float32; with --gpu bfloat16)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--device", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(
            json.dumps(
                worker(
                    args.worker,
                    args.length,
                    args.device,
                    args.repeats,
                    args.seed,
                    args.model,
                    args.dtype,
                    args.layer,
                    args.decode,
                )
            )
        )
        return
    args.device = args.device or ("cuda" if args.gpu else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.gpu else "float32")
    half = args.dtype != "float32"
    lengths = [int(x) for x in (args.lengths or ("16384,32768" if args.gpu else "8192,16384")).split(",")]
    variants = ["sdpa"] + [v for v in args.variants.split(",") if v in VARIANTS and v != "sdpa"]
    methods = variants[1:]
    if half:
        variants += [v + "/f32" for v in methods]
    if args.decode and args.turn:
        variants += [v + "/turn" for v in methods if v in MOVING]
    rows, ratios = [], {}
    for length in lengths:
        found = {v: run_variant(v, length, args) for v in variants}
        rows += found.values()
        base = found["sdpa"]
        for v in variants[1:]:
            ratios.setdefault(v, {})[str(length)] = cell = ratio(found[v], base)
            f32 = found.get(v + "/f32")
            if f32 is not None:
                cell["half_vs_f32_memory"] = ratio(found[v], f32)["memory_ratio"]
    print(f"{'variant':18} {'length':>7} {'peak MB':>9} {'+MB':>9} {'seconds':>9} {'keys MB':>8} {'kept MB':>8}  error")
    for r in rows:
        print(
            f"{r['variant']:18} {r['length']:>7} {fmt(r.get('peak_mb'), '9.0f')} {fmt(r.get('increase_mb'), '9.0f')} "
            f"{fmt(r.get('seconds'), '9.4f')} {fmt(r.get('key_cache_mb'), '8.1f')} {fmt(r.get('kept_keys_mb'), '8.1f')}"
            f"  {r.get('error') or ''}"
        )
    if half:
        met = {
            v: all(x.get("half_vs_f32_memory") is not None and x["half_vs_f32_memory"] <= HALF_TARGET for x in cells)
            for v, cells in ((v, ratios[v].values()) for v in methods)
        }
        targets = {v: {"half_vs_f32_memory": f"<= {HALF_TARGET}"} for v in methods}
    elif args.decode:  # issue 25's decode target, issue 68's measure: time only (the step's memory is the kept keys)
        met = {
            v: all(x["time_ratio"] is not None and x["time_ratio"] <= DECODE_TARGET for x in ratios[v].values())
            for v in methods
        }
        targets = {v: {"time_ratio": f"<= {DECODE_TARGET}"} for v in methods}
    else:
        met = {
            v: all(
                x["memory_ratio"] is not None
                and x["memory_ratio"] <= TARGETS[v][0]
                and x["time_ratio"] <= TARGETS[v][1]
                for x in ratios.get(v, {}).values()
            )
            for v in TARGETS
            if v in ratios
        }
        targets = {v: {"memory_ratio": f"<= {m}", "time_ratio": f"<= {t}"} for v, (m, t) in TARGETS.items()}
    device = next((r.get("gpu") for r in rows if r.get("gpu")), None) or f"cpu ({os.cpu_count()} cores)"
    print(
        json.dumps(
            {
                "benchmark": "attention_methods",
                "device": device,
                "model": args.model or "random llama " + json.dumps(SHAPE),
                "measured": ("one attention call " + json.dumps(LAYER) if args.layer else "one forward")
                + (", one decode step" if args.decode else ""),
                "dtype": args.dtype,
                "targets": targets,
                "met": met,
                "ratios": ratios,
                "key_memory_mb": {
                    f"{r['variant']}@{r['length']}": [r.get("key_cache_mb"), r.get("kept_keys_mb")]
                    for r in rows
                    if r.get("key_cache_mb") is not None
                },
            }
        )
    )


if __name__ == "__main__":
    main()
