"""Serve a folder with vLLM (CPU, float32) and answer a list of request batches; a script, run in its own process
by tests/export/test_vllm_adaptive.py and test_vllm_adaptive_families.py (vLLM's engine starts processes of its
own: the guard below keeps them from running this file again).

    python tests/export/vllm_run.py SPEC.json OUT.json

SPEC: ``{"model": folder, "max_model_len": n, "prefix_caching": bool, "enforce_eager": bool, "batches": [[request, ...], ...]}``, each
request ``{"ids": [...], "max_tokens": n, "prompt_logprobs": bool}``, greedy. OUT: per batch, per request: the
prompt tokens' log-probs (None for the first), the generated tokens, their log-probs and why they ended, the number of prompt
tokens vLLM read from its prefix cache, and each batch's wall time. SPEC's optional ``"refused": [request, ...]``
are sent one at a time after the batches. OUT: ``{"batches": [...], "refused": [...]}``, the latter each one's
error (type and message), or, where it was served, how many tokens and why they ended.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    llm = LLM(
        spec["model"],
        dtype="float32",
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=spec["prefix_caching"],
        seed=0,
        enforce_eager=spec.get("enforce_eager", False),
    )
    results = []
    for batch in spec["batches"]:
        prompts = [TokensPrompt(prompt_token_ids=r["ids"]) for r in batch]
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=r["max_tokens"],
                logprobs=0,
                prompt_logprobs=0 if r.get("prompt_logprobs") else None,
                ignore_eos=True,
            )
            for r in batch
        ]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        answers = []
        for r, out in zip(batch, outputs, strict=True):
            prompt = None
            if out.prompt_logprobs is not None:
                prompt = [None] + [row[t].logprob for t, row in zip(r["ids"][1:], out.prompt_logprobs[1:], strict=True)]
            gen = out.outputs[0]
            answers.append(
                {
                    "prompt_logprobs": prompt,
                    "tokens": list(gen.token_ids),
                    "logprobs": [row[t].logprob for t, row in zip(gen.token_ids, gen.logprobs, strict=True)],
                    "cached": out.num_cached_tokens,
                    "finish": gen.finish_reason,
                }
            )
        results.append({"seconds": seconds, "answers": answers})
    refused = []
    for r in spec.get("refused", []):
        params = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
        try:
            gen = llm.generate([TokensPrompt(prompt_token_ids=r["ids"])], params, use_tqdm=False)[0].outputs[0]
            refused.append({"served": len(gen.token_ids), "finish": gen.finish_reason})
        except Exception as exc:  # noqa: BLE001 (what the engine says is the answer)
            refused.append({"type": type(exc).__name__, "message": str(exc)})
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"batches": results, "refused": refused}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
