"""Parity of a GGUF export with the patched transformers model, measured with llama.cpp's own code.

    python eval/serving_parity.py                      # SmolLM2-135M, 12288 tokens of lcet10.txt, 4 scalings
    python eval/serving_parity.py --tokens 2048 --methods none,yarn:2

For each scaling: patch SmolLM2-135M-Instruct (float32) with it, export it with ``rope_extend.export`` (f32
GGUF), run the GGUF in llama.cpp through llama-cpp-python, and compare on the same token ids:

- per-token log-probabilities of the text (largest and mean absolute difference);
- perplexity (relative difference);
- a greedy 32-token continuation after the whole text (identical or not, and the first differing step).

Needs ``pip install llama-cpp-python`` (the CI builds 0.3.36 from source and caches the wheel) and the
``gguf`` extra. Prints a Markdown table and writes ``--out`` (JSON) when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import rope_extend
from rope_extend.documents import read_documents
from rope_extend.export import export
from rope_extend.io import write_json

DEFAULT_METHODS = "none,linear:2,yarn:2,llama3:2"


def log_probs(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    """``log p(ids[t+1] | ids[:t+1])`` for every t, in float64."""
    x = logits[:-1].astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    x = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return x[np.arange(len(ids) - 1), ids[1:]]


def llama_cpp_run(path: Path, ids: list[int], new: int, threads: int) -> tuple[np.ndarray, list[int], float]:
    from llama_cpp import Llama

    n_ctx = (len(ids) + new + 255) // 256 * 256  # llama.cpp pads the context to 256; scores are sized from n_ctx
    llm = Llama(str(path), n_ctx=n_ctx, n_batch=512, logits_all=True, n_threads=threads, verbose=False)
    start = time.perf_counter()
    llm.eval(ids)
    seconds = time.perf_counter() - start
    logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
    greedy = []
    for _ in range(new):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(token)
        llm.eval([token])
    llm.close()
    return logits, greedy, seconds


def transformers_run(model, ids: list[int], new: int) -> tuple[np.ndarray, list[int], float]:
    start = time.perf_counter()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
        seconds = time.perf_counter() - start
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=new,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    return logits, out[0, len(ids) :].tolist(), seconds


def measure(spec: str, model, tokenizer, ids: list[int], new: int, threads: int, folder: Path) -> dict:
    method, _, factor = spec.partition(":")
    if method != "none":
        rope_extend.patch(model, method, factor=float(factor))
    try:
        result = export(model, "gguf", folder / f"{method}.gguf", tokenizer=tokenizer)
        hf_logits, hf_greedy, hf_s = transformers_run(model, ids, new)
    finally:
        if method != "none":
            rope_extend.unpatch(model)
    cpp_logits, cpp_greedy, cpp_s = llama_cpp_run(result.out, ids, new, threads)
    a, b = log_probs(cpp_logits, ids), log_probs(hf_logits, ids)
    ppl_cpp, ppl_hf = float(np.exp(-a.mean())), float(np.exp(-b.mean()))
    first = next((i for i, (x, y) in enumerate(zip(cpp_greedy, hf_greedy, strict=True)) if x != y), None)
    (folder / f"{method}.gguf").unlink()
    return {
        "scaling": spec,
        "how": result.how,
        "tokens": len(ids),
        "ppl_llama_cpp": ppl_cpp,
        "ppl_transformers": ppl_hf,
        "ppl_rel_diff": abs(ppl_cpp - ppl_hf) / ppl_hf,
        "logprob_max_abs_diff": float(np.abs(a - b).max()),
        "logprob_mean_abs_diff": float(np.abs(a - b).mean()),
        "greedy_identical": first is None,
        "greedy_first_difference": first,
        "seconds_llama_cpp": cpp_s,
        "seconds_transformers": hf_s,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", default="canterbury/lcet10.txt")
    parser.add_argument("--tokens", type=int, default=12288)
    parser.add_argument("--new", type=int, default=32, help="greedy continuation length")
    parser.add_argument(
        "--methods", default=DEFAULT_METHODS, help=f"comma-separated method:factor (default {DEFAULT_METHODS})"
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--out", default="eval/reports/serving-parity/results.json")
    args = parser.parse_args(argv)

    model, tokenizer = rope_extend.load(args.model)
    ids = tokenizer(read_documents(args.text)[0])["input_ids"][: args.tokens]
    if len(ids) < args.tokens:
        parser.error(f"{args.text} has only {len(ids)} tokens")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.methods.split(","):
            row = measure(spec, model, tokenizer, ids, args.new, args.threads, Path(tmp))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(
        f"\n| scaling | llama.cpp gets | ppl llama.cpp | ppl transformers | diff | max abs dlogp | greedy {args.new} |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        same = "identical" if r["greedy_identical"] else f"differs at {r['greedy_first_difference']}"
        print(
            f"| {r['scaling']} | {r['how']} | {r['ppl_llama_cpp']:.4f} | {r['ppl_transformers']:.4f} | "
            f"{100 * r['ppl_rel_diff']:.3f}% | {r['logprob_max_abs_diff']:.3f} | {same} |"
        )
    write_json(args.out, {"model": args.model, "text": args.text, "tokens": len(ids), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
