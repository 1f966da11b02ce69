"""Evaluation through llama.cpp against transformers on the CPU: the same harness, prompts and windows, two backends.

    python eval/benchmarks/engine_speed.py                          # SmolLM2-135M yarn x4: 8k, 16k, 32k
    python eval/benchmarks/engine_speed.py --lengths 8k --trials 1  # a quick check

SmolLM2-135M-Instruct (float32) is patched with ``--method`` (yarn x4 by default, so 32k is inside its target)
and exported as an f32 GGUF; then, alternating backends length by length so that both see the same load on
the machine, passkey (``--trials`` trials) and perplexity (one window of the first Canterbury text that
reaches the length) are measured with ``rope_extend.evaluation`` on the transformers model (sdpa) and on the
file in llama.cpp (``evaluation.engines.LlamaCppModel``). Per length and task it prints the wall and CPU
seconds of each backend, their ratio (transformers / llama.cpp: above 1, llama.cpp is faster) and whether the
numbers agree (passkey outputs equal; perplexity relative difference). CPU seconds count every thread of the
process, so they are less sensitive than wall time to other work on a shared machine. The last line is JSON;
``--out`` writes it when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

import rope_extend
from rope_extend.documents import read_documents
from rope_extend.evaluation import passkey, perplexity
from rope_extend.evaluation.data import parse_lengths
from rope_extend.evaluation.engines import LlamaCppModel
from rope_extend.export import export
from rope_extend.io import write_json


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="yarn")
    parser.add_argument("--factor", type=float, default=4.0)
    parser.add_argument("--lengths", default="8k,16k,32k")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    lengths = parse_lengths(args.lengths)
    torch.set_num_threads(args.threads)

    model, tok = rope_extend.load(args.model, attn_implementation="sdpa")
    rope_extend.patch(model, args.method, factor=args.factor)
    text = next(t for t in read_documents("canterbury") if len(tok(t)["input_ids"]) >= max(lengths))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        gguf = export(model, "gguf", Path(tmp) / "m.gguf", tokenizer=tok).out
        served = LlamaCppModel(
            gguf, n_ctx=max(lengths) + 16, method=args.method, factor=args.factor, threads=args.threads
        )
        backends = {"transformers": model, "llama.cpp": served}
        for n in lengths:
            got = {}
            for name, m in backends.items():
                got[name, "passkey"] = timed(lambda m=m, n=n: passkey(m, tok, [n], trials=args.trials, progress=False))
                got[name, "perplexity"] = timed(lambda m=m, n=n: perplexity(m, tok, [text], [n], progress=False))
            for task in ("passkey", "perplexity"):
                (a, a_wall, a_cpu), (b, b_wall, b_cpu) = got["transformers", task], got["llama.cpp", task]
                if task == "passkey":
                    agree = [r["output"] for r in a.records] == [r["output"] for r in b.records]
                    values = (a.accuracy_by_length[n], b.accuracy_by_length[n])
                else:
                    agree = abs(a.perplexity[n] - b.perplexity[n]) / a.perplexity[n]
                    values = (a.perplexity[n], b.perplexity[n])
                row = {
                    "length": n,
                    "task": task,
                    "transformers": values[0],
                    "llama_cpp": values[1],
                    "agree": agree,
                    "wall_transformers": round(a_wall, 2),
                    "wall_llama_cpp": round(b_wall, 2),
                    "cpu_transformers": round(a_cpu, 2),
                    "cpu_llama_cpp": round(b_cpu, 2),
                    "wall_ratio": round(a_wall / b_wall, 2),
                    "cpu_ratio": round(a_cpu / b_cpu, 2),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
        served.close()
    print(
        "\n| length | task | transformers | llama.cpp | agree | wall s (hf / cpp) | ratio | CPU s (hf / cpp) | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        agree = ("outputs equal" if r["agree"] else "outputs differ") if r["task"] == "passkey" else f"{r['agree']:.1e}"
        print(
            f"| {r['length']} | {r['task']} | {r['transformers']:.4g} | {r['llama_cpp']:.4g} | {agree} | "
            f"{r['wall_transformers']} / {r['wall_llama_cpp']} | {r['wall_ratio']}x | "
            f"{r['cpu_transformers']} / {r['cpu_llama_cpp']} | {r['cpu_ratio']}x |"
        )
    summary = {"model": args.model, "method": args.method, "factor": args.factor, "threads": args.threads, "rows": rows}
    print(json.dumps(summary))
    if args.out:
        write_json(args.out, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
