"""Which kernel should the attention methods' passes run on, on CUDA (issue 70, item 3)? One pass, measured.

    python eval/benchmarks/cuda_passes.py                   # CUDA, bf16, the Llama-3-8B head layout, 16k and 32k
    python eval/benchmarks/cuda_passes.py --smoke           # any machine, tiny sizes: checks that it runs

A method's attention is a sum of passes over disjoint keys, each returning its output and its log-sum-exp
(``rope_extend.hf.attention.kernels``). On CUDA today every pass runs on ``torch_tiles`` (plain torch over 1024
keys at a time, scores in float32). The candidates, each on the same pass, same inputs:

- ``torch_tiles``: today's path (``kernels._partial_torch``), the reference for the numbers;
- ``efficient``: aten's memory-efficient attention with an additive mask and ``compute_log_sumexp`` (any mask;
  key/value heads repeated to the query heads, since the kernel has no grouped heads);
- ``flash``: aten's CUDA flash attention, which returns the log-sum-exp but takes no mask: it runs a pass cut
  into causal squares and unmasked rectangles, as the CPU path cuts them, and is timed here on the masks that
  are such pieces (``causal``; ``band`` and ``shifted`` cut into two and one pieces, merged by log-sum-exp);
- ``flex``: FlexAttention (compiled) with a block mask from the same predicate and the log-sum-exp returned
  (grouped heads native; the compile time is reported apart).

The passes (``T`` queries over ``S = T`` keys, the shapes Self-Extend and ReRoPE lay out): ``causal`` (the whole
lower triangle), ``band`` (the last ``--window`` keys of each row: the neighbour pass) and ``shifted`` (keys more
than ``--window`` behind: the grouped/far pass). Reported per candidate and pass: the median time of
``--repeats`` runs after a warm-up (CUDA events), peak memory over the inputs, and the largest difference from
``torch_tiles`` in output and log-sum-exp. Prints one JSON document; ``--out`` writes it too.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time

import torch

from rope_extend.hf.attention.kernels import _merge, _partial_torch
from rope_extend.io import write_text

PASSES = ("causal", "band", "shifted")
CANDIDATES = ("torch_tiles", "efficient", "flash", "flex")


def allowed(kind: str, n: int, window: int):
    """The pass's predicate on query ``i`` and key ``j`` (tensors or ints)."""
    if kind == "causal":
        return lambda i, j: j <= i
    if kind == "band":
        return lambda i, j: (j <= i) & (j > i - window)
    return lambda i, j: j <= i - window


def dense_mask(kind: str, n: int, window: int, device) -> torch.Tensor:
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    return allowed(kind, n, window)(i, j)[None, None]  # (1, 1, T, S)


def run_torch_tiles(q, k, v, kind, window, scale, state):
    if "mask" not in state:
        state["mask"] = dense_mask(kind, q.shape[2], window, q.device)
    return _partial_torch(q, k, v, state["mask"], scale, None)


def run_efficient(q, k, v, kind, window, scale, state):
    groups = q.shape[1] // k.shape[1]
    if "bias" not in state:
        mask = dense_mask(kind, q.shape[2], window, q.device)
        zero = torch.zeros((), dtype=q.dtype, device=q.device)
        bias = torch.where(mask, zero, torch.tensor(float("-inf"), dtype=q.dtype, device=q.device))
        state["bias"] = bias.expand(q.shape[0], q.shape[1], -1, -1)
        del mask
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # (B, H, S, D)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, kk, vv, state["bias"], True, 0.0, False, scale=scale
    )[:2]
    return out.float(), lse[..., : q.shape[2]].float()


def _flash(q, k, v, causal: bool, scale):
    """aten's flash attention and its log-sum-exp (the CPU build's under ``--smoke``, to check the cutting)."""
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    if q.device.type == "cpu":
        got = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kk, vv, 0.0, causal, scale=scale)
    else:
        got = torch.ops.aten._scaled_dot_product_flash_attention(q, kk, vv, 0.0, causal, False, scale=scale)
    return got[0].float(), got[1].float()


def run_flash(q, k, v, kind, window, scale, state):
    n = q.shape[2]
    if kind == "causal":
        return _flash(q, k, v, True, scale)
    if kind == "shifted":  # rows from `window` on see keys [0, i - window]: a causal square shifted down
        out = torch.zeros(*q.shape[:3], v.shape[-1], device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
        o, l_ = _flash(q[:, :, window:], k[:, :, : n - window], v[:, :, : n - window], True, scale)
        out[:, :, window:], lse[:, :, window:] = o, l_
        return out, lse
    # band: row i sees (i - window, i]. In blocks of `window` rows, row t of a block sees the causal square of its
    # own block, and of the `window - 1` keys before the block those with index m >= t: for the first
    # rr = min(rows, window - 1) rows, a mirrored causal square (rows and keys reversed) over keys [0, rr) and all
    # of keys [rr, window - 1); a block's row window - 1 sees none of them
    out = torch.empty(*q.shape[:3], v.shape[-1], device=q.device)
    lse = torch.empty(q.shape[:3], device=q.device)
    for r0 in range(0, n, window):
        r1 = min(r0 + window, n)
        o, l_ = _flash(q[:, :, r0:r1], k[:, :, r0:r1], v[:, :, r0:r1], True, scale)
        if r0 > 0:
            kp, vp = k[:, :, r0 - window + 1 : r0], v[:, :, r0 - window + 1 : r0]  # (B, H_kv, window - 1, D)
            rr = min(r1 - r0, window - 1)
            qs = q[:, :, r0 : r0 + rr]
            om, lm = _flash(qs.flip(2), kp[:, :, :rr].flip(2), vp[:, :, :rr].flip(2), True, scale)
            om, lm = om.flip(2), lm.flip(2)
            if rr < window - 1:
                om, lm = _merge(om, lm, *_flash(qs, kp[:, :, rr:], vp[:, :, rr:], False, scale))
            o2, l2 = _merge(o[:, :, :rr], l_[:, :, :rr], om, lm)
            o, l_ = torch.cat([o2, o[:, :, rr:]], 2), torch.cat([l2, l_[:, :, rr:]], 2)
        out[:, :, r0:r1], lse[:, :, r0:r1] = o, l_
    return out, lse


def run_flex(q, k, v, kind, window, scale, state):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in state:
        pred = allowed(kind, q.shape[2], window)
        state["block"] = create_block_mask(
            lambda b, h, i, j: pred(i, j), None, None, q.shape[2], k.shape[2], device=str(q.device)
        )
        fn = flex_attention if q.device.type == "cpu" else torch.compile(flex_attention, dynamic=False)
        state["fn"] = fn
        start = time.perf_counter()
        _flex_call(state, q, k, v, scale)
        torch.cuda.synchronize() if q.is_cuda else None
        state["compile_s"] = time.perf_counter() - start
    return _flex_call(state, q, k, v, scale)


def _flex_call(state, q, k, v, scale):
    try:
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = state["fn"](
            q, k, v, block_mask=state["block"], scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True)
        )
        lse = aux.lse
    except ImportError:
        out, lse = state["fn"](q, k, v, block_mask=state["block"], scale=scale, enable_gqa=True, return_lse=True)
    # flex gives log-sum-exp in base e for a scaled score (torch >= 2.5); rows with no key: -inf
    return out.float(), lse.float()


RUNNERS = {"torch_tiles": run_torch_tiles, "efficient": run_efficient, "flash": run_flash, "flex": run_flex}


def timed(fn, repeats: int, cuda: bool) -> list[float]:
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def measure_pass(kind: str, n: int, args) -> list[dict]:
    cuda = args.device == "cuda"
    gen = torch.Generator(device=args.device).manual_seed(0)
    shape_q, shape_k = (1, args.heads, n, args.head_dim), (1, args.kv_heads, n, args.head_dim)
    q, k, v = (torch.randn(s, generator=gen, device=args.device, dtype=args.dtype) for s in (shape_q, shape_k, shape_k))
    scale = 1 / math.sqrt(args.head_dim)
    rows, ref = [], None
    for name in args.candidates:
        state: dict = {}
        row = {"pass": kind, "length": n, "kernel": name}
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            out, lse = RUNNERS[name](q, k, v, kind, args.window, scale, state)  # warm-up (and compile)
            again = functools.partial(RUNNERS[name], q, k, v, kind, args.window, scale, state)
            times = timed(again, args.repeats, cuda)
            row |= {"seconds": statistics.median(times), "times": times}
            if cuda:
                row["peak_extra_mb"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
            if "compile_s" in state:
                row["compile_s"] = round(state["compile_s"], 2)
            if ref is None and name == "torch_tiles":
                ref = (out, lse)
            elif ref is not None:
                seen = torch.isfinite(ref[1])
                row["max_out_diff"] = (out - ref[0])[seen].abs().max().item()
                row["max_lse_diff"] = (lse - ref[1])[seen].abs().max().item()
                row["same_empty_rows"] = bool(torch.equal(torch.isfinite(lse), seen))
            del out, lse
        except Exception as exc:  # noqa: BLE001 (a kernel this build or device lacks: reported beside the others)
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        state.clear()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "times"}), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default=None, help="comma-separated (default 16384,32768; --smoke 512)")
    p.add_argument("--passes", default=",".join(PASSES))
    p.add_argument("--candidates", default=",".join(CANDIDATES))
    p.add_argument("--window", type=int, default=None, help="band width / shift (default 2048; --smoke 64)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    args.device = "cpu" if args.smoke else "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device (--smoke runs it at tiny sizes on the CPU)")
    args.dtype = torch.float32 if args.smoke else torch.bfloat16
    args.heads, args.kv_heads, args.head_dim = (4, 2, 32) if args.smoke else (32, 8, 128)
    args.window = args.window or (64 if args.smoke else 2048)
    args.candidates = ["torch_tiles"] + [c for c in args.candidates.split(",") if c != "torch_tiles"]
    lengths = [int(x) for x in (args.lengths or ("512" if args.smoke else "16384,32768")).split(",")]
    rows = [r for n in lengths for kind in args.passes.split(",") for r in measure_pass(kind, n, args)]
    report = {
        "environment": {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "dtype": str(args.dtype),
            "heads": [args.heads, args.kv_heads, args.head_dim],
            "window": args.window,
        },
        "rows": rows,
    }
    if args.out:
        write_text(args.out, json.dumps(report, indent=1))  # atomic: never half a report
    print(json.dumps(report))


if __name__ == "__main__":
    main()
