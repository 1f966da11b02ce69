"""Evaluation through llama.cpp against transformers on the CPU: the same harness, prompts and windows, two backends.

    python eval/benchmarks/engine_speed.py                                    # SmolLM2-135M yarn x4: 4k, 8k
    python eval/benchmarks/engine_speed.py --lengths 8k --variants before,default,threads1 --repeats 2

SmolLM2-135M-Instruct (float32) is patched with ``--method`` (yarn x4 by default, so 32k is inside its target)
and exported as an f32 GGUF (and f16 for the ``f16`` variant); then, length by length, passkey (``--trials``
trials) and perplexity (one window of the first Canterbury text that reaches the length) are measured with
``rope_extend.evaluation`` on the transformers model (sdpa) and on the file in llama.cpp, once per ``--variants``
setting (``evaluation.engines.LlamaCppModel``), the backends alternating within each repeat so that all see the
same load on the machine. ``before`` is the backend as it was before issue 68 (512-token batches and
micro-batches, no flash attention, every position's logits kept for a perplexity window and reduced at the end),
``default`` what ``LlamaCppModel`` does now; the others change one setting of ``default``.

Per length, task and variant it prints the best wall and CPU seconds over the repeats, the ratio transformers /
llama.cpp (above 1, llama.cpp is faster) and whether the numbers agree: passkey outputs equal to transformers'
and to ``before``'s; perplexity's relative difference to both. CPU seconds count every thread of the process
(llama.cpp's threads wait for each other spinning, so on busy cores its CPU seconds grow with the load too).
The last line is JSON; ``--out`` writes it when complete.

The llama.cpp is whatever llama-cpp-python is installed: .ci/run builds it portable (``GGML_NATIVE=OFF``: AVX2, no
AVX-512). The build for this machine's own instructions (AVX-512 here), which CI does not make because the wheel
it caches must run on any runner, is

    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF" \\
        pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36

(``llama_cpp.llama_print_system_info()`` then lists AVX512); run this script in each environment to compare them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import rope_extend
from rope_extend.documents import read_documents
from rope_extend.evaluation import passkey, perplexity
from rope_extend.evaluation.data import parse_lengths
from rope_extend.evaluation.engines import LlamaCppModel
from rope_extend.export import export
from rope_extend.io import write_json

BEFORE = {"n_batch": 512, "n_ubatch": 512, "flash_attn": False}  # LlamaCppModel's settings before issue 68
VARIANTS = {
    "before": BEFORE,
    "default": {},
    "threads1": {"threads": 1},
    "no_flash": {"flash_attn": False},
    "ubatch512": {"n_ubatch": 512},
    "batch512": {"n_batch": 512, "n_ubatch": 512},
    "f16": {"dtype": "f16"},  # an f16 GGUF: a different file, so its numbers are not the f32 file's
}


class Before(LlamaCppModel):
    """The perplexity path before issue 68: every position's logits requested, copied and concatenated into one
    ``n x vocab`` float32 array (1.6 GB at 8k tokens of a 49k vocabulary), then converted to float64 whole."""

    def nll(self, ids, score_from):
        n = len(ids)
        if n - score_from <= 0:
            return 0.0, 0
        self.check_reachable(n)
        llm, rows = self._llm, []
        llm._ctx.kv_cache_clear()
        for i in range(0, n, self.n_batch):
            chunk = list(ids[i : i + self.n_batch])
            llm._batch.set_batch(batch=chunk, n_past=i, logits_all=True)
            llm._ctx.decode(llm._batch)
            flat = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(len(chunk) * self.vocab,))
            rows.append(flat.reshape(len(chunk), self.vocab).copy())
        logits = np.concatenate(rows)[score_from - 1 : n - 1].astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        log_z = np.log(np.exp(logits).sum(-1))
        targets = np.asarray(ids[score_from:])
        return float((log_z - logits[np.arange(len(targets)), targets]).sum()), len(targets)


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def value(task, result, n):
    if task == "passkey":
        return [r["output"] for r in result.records], result.accuracy_by_length[n]
    return result.perplexity[n], result.perplexity[n]


def agree(task, a, b):
    """Passkey: the outputs are the same strings; perplexity: the relative difference."""
    if a is None or b is None:
        return None
    return a == b if task == "passkey" else abs(a - b) / a


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="yarn")
    parser.add_argument("--factor", type=float, default=4.0)
    parser.add_argument("--lengths", default="4k,8k")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="each measurement this many times; the best is kept")
    parser.add_argument("--variants", default="before,default", help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--tasks", default="passkey,perplexity")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    lengths, tasks = parse_lengths(args.lengths), args.tasks.split(",")
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; allowed: {', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)

    model, tok = rope_extend.load(args.model, attn_implementation="sdpa")
    rope_extend.patch(model, args.method, factor=args.factor)
    text = next(t for t in read_documents("canterbury") if len(tok(t)["input_ids"]) >= max(lengths))
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for dtype in {VARIANTS[v].get("dtype", "f32") for v in variants}:
            files[dtype] = export(model, "gguf", Path(tmp) / f"m-{dtype}.gguf", tokenizer=tok, dtype=dtype).out

        def served(variant):
            settings = dict(VARIANTS[variant])
            path = files[settings.pop("dtype", "f32")]
            settings.setdefault("threads", args.threads)
            kind = Before if variant == "before" else LlamaCppModel
            return kind(path, n_ctx=max(lengths) + 16, method=args.method, factor=args.factor, **settings)

        def run(m, task, n):
            if task == "passkey":
                return passkey(m, tok, [n], trials=args.trials, progress=False)
            return perplexity(m, tok, [text], [n], progress=False)

        opened = {v: served(v) for v in variants}  # a missing llama-cpp-python: LlamaCppModel's one-line error
        import llama_cpp

        build = llama_cpp.llama_print_system_info().decode()
        rows = measure({"transformers": model, **opened}, lengths, tasks, args.repeats, run)
        for m in opened.values():
            m.close()
    print_table(rows)
    summary = {
        "model": args.model,
        "method": args.method,
        "factor": args.factor,
        "threads": args.threads,
        "repeats": args.repeats,
        "llama_cpp": f"llama-cpp-python {llama_cpp.__version__}: {build.strip()}",
        "settings": {v: m.settings for v, m in opened.items()},
        "rows": rows,
    }
    print(json.dumps(summary))
    if args.out:
        write_json(args.out, summary)
    return 0


def measure(backends, lengths, tasks, repeats, run):
    """One row per (length, task, llama.cpp variant): the best of ``repeats`` timings of each backend, the backends
    taking turns within a repeat, and whether each variant's numbers agree with transformers' and ``before``'s."""
    rows = []
    for n in lengths:
        for task in tasks:
            best: dict[str, list[float]] = {b: [math.inf, math.inf] for b in backends}
            got = {}
            for _ in range(repeats):
                for name, m in backends.items():
                    result, wall, cpu = timed(lambda m=m, task=task, n=n: run(m, task, n))
                    got[name] = value(task, result, n)
                    best[name] = [min(best[name][0], wall), min(best[name][1], cpu)]
                    print(f"# {n} {task} {name}: {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)
            hf_wall, hf_cpu = best["transformers"]
            for name in backends:
                if name == "transformers":
                    continue
                wall, cpu = best[name]
                row = {
                    "length": n,
                    "task": task,
                    "variant": name,
                    "settings": VARIANTS[name],
                    "transformers": got["transformers"][1],
                    "llama_cpp": got[name][1],
                    "agree_transformers": agree(task, got["transformers"][0], got[name][0]),
                    "agree_before": agree(task, got.get("before", (None,))[0], got[name][0]),
                    "wall_transformers": round(hf_wall, 2),
                    "wall_llama_cpp": round(wall, 2),
                    "cpu_transformers": round(hf_cpu, 2),
                    "cpu_llama_cpp": round(cpu, 2),
                    "wall_ratio": round(hf_wall / wall, 2),
                    "cpu_ratio": round(hf_cpu / cpu, 2),
                    "load": round(os.getloadavg()[0], 1),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def print_table(rows):
    def shown(r, key):
        a = r[key]
        if a is None:
            return "-"
        if r["task"] == "passkey":
            return "equal" if a else "differ"
        return f"{a:.1e}"

    print(
        "\n| length | task | llama.cpp variant | value (hf / cpp) | vs hf | vs before | wall s (hf / cpp) | ratio "
        "| CPU s (hf / cpp) | ratio | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['length']} | {r['task']} | {r['variant']} | {r['transformers']:.4g} / {r['llama_cpp']:.4g} | "
            f"{shown(r, 'agree_transformers')} | {shown(r, 'agree_before')} | "
            f"{r['wall_transformers']} / {r['wall_llama_cpp']} | {r['wall_ratio']}x | "
            f"{r['cpu_transformers']} / {r['cpu_llama_cpp']} | {r['cpu_ratio']}x | {r['load']} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
