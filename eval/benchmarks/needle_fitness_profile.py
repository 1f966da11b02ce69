"""Where one needle-fitness evaluation's time goes (issue 66: LongRoPE2 on SmolLM2-135M).

    python eval/benchmarks/needle_fitness_profile.py --length 8192 [--docs 1] [--model smollm2-135m]
        [--data canterbury/lcet10.txt] [--out eval/reports/needle-fitness-profile/8k.txt]

Builds the search's needle documents at ``--length`` tokens (``factor_search.needles``, seed 0), patches the
model with YaRN x4's factors as a LongRoPE candidate (every candidate costs the same), and runs the fitness's
own ``window_nll`` over the first ``--docs`` documents under ``torch.profiler``: wall time, peak resident
memory, and the operators by time (the attention kernel, the linear layers' matmuls, the head's log-softmax at
the answer positions). Writes the table to ``--out`` and prints it.
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--docs", type=int, default=1)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="canterbury/lcet10.txt")
    ap.add_argument("--out")
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from rope_extend.documents import read_documents
    from rope_extend.evaluation.perplexity import window_nll
    from rope_extend.factor_search.needles import needle_documents
    from rope_extend.factor_search.run import geometry, seed_factors
    from rope_extend.hf import head as hf_head
    from rope_extend.hf.window import sliding_window_widened
    from rope_extend.loading import load_model, load_tokenizer
    from rope_extend.patching import patch

    model = load_model(args.model, dtype="float32", device="cpu")
    tok = load_tokenizer(args.model)
    docs = needle_documents(tok, read_documents(args.data), args.length, 0)
    dim, base, L = geometry(model)
    patch(model, "longrope", factor=4.0, short_factor=[1.0] * (dim // 2),
          long_factor=seed_factors("yarn", dim, base, 4.0, L))  # fmt: skip
    head = hf_head.lm_head(model, decoder=True)
    threads = torch.get_num_threads()
    lines = [f"{args.model}, attention {model.config._attn_implementation}, {threads} threads"]
    lines.append(f"documents (tokens): {[len(d) for d, _ in docs]}")
    with sliding_window_widened(model, args.length):
        for i, (ids, start) in enumerate(docs[: args.docs]):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t = time.perf_counter()
                _nll, n = window_nll(head, torch.tensor(ids), start)
                took = time.perf_counter() - t
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
            lines.append(f"document {i}: {len(ids)} tokens, {n} scored, {took:.1f} s, peak resident {peak:.2f} GB")
            lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
