"""Evaluation through vLLM against transformers on the CPU: the same harnesses, prompts and windows, two backends.

    python eval/benchmarks/vllm_eval_speed.py --out eval/reports/vllm-eval/speed.json   # in vLLM's venv

SmolLM2-135M-Instruct (float32) with yarn x4 from L = 1024 (so 4096 tokens are served) is patched in transformers
(sdpa) and exported with ``rope-extend export --to vllm``; then passkey (``--trials`` trials at each of
``--lengths``) and perplexity (one window of Canterbury's lcet10.txt at ``--ppl-length``) are measured with
``rope_extend.evaluation`` on both backends, alternating (transformers, vLLM, transformers, vLLM, ...:
``--repeats`` each), so that both see the same load on the machine; each run writes its own records (nothing is
reused). vLLM's engine is started once, before the first repeat, and its start is timed apart; so is loading
the transformers model. Prints, per repeat, each backend's wall seconds and whether the answers and perplexity
agree (the same passkey outputs; perplexity's relative difference), with the load average before and after;
the last line is JSON, which ``--out`` writes when complete.

Wall time only: vLLM runs its OpenMP threads on every CPU this process may use (``VLLM_CPU_OMP_THREADS_BIND``), as
torch does.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import rope_extend
from rope_extend.documents import read_documents
from rope_extend.evaluation import passkey, perplexity
from rope_extend.evaluation.data import parse_lengths
from rope_extend.evaluation.vllm_engine import VllmModel
from rope_extend.export import export
from rope_extend.io import write_json
from rope_extend.loading import resolve_name

SCALING = {"method": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def measure(model, tok, text: str, lengths: list[int], ppl_length: int, trials: int, folder: Path) -> dict:
    start = time.perf_counter()
    pk = passkey(model, tok, lengths, trials=trials, records=folder / "passkey.jsonl", progress=False)
    middle = time.perf_counter()
    ppl = perplexity(model, tok, [text], [ppl_length], records=folder / "ppl.jsonl", progress=False)
    end = time.perf_counter()
    return {
        "passkey_seconds": round(middle - start, 2),
        "perplexity_seconds": round(end - middle, 2),
        "outputs": [r["output"] for r in pk.records],
        "accuracy": {str(n): a for n, a in pk.accuracy_by_length.items()},
        "perplexity": ppl.perplexity[ppl_length],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,3072", help="passkey lengths")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--ppl-length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    lengths = parse_lengths(args.lengths)
    text = read_documents("canterbury/lcet10.txt")[0]
    result: dict = {"scaling": SCALING, "lengths": lengths, "trials": args.trials, "ppl_length": args.ppl_length}
    result["load_start"] = load()
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        model, tok = rope_extend.load("smollm2-135m", dtype="float32")
        rope_extend.patch(model, **SCALING)
        result["transformers_load_seconds"] = round(time.perf_counter() - t, 2)
        folder = export(resolve_name("smollm2-135m"), "vllm", Path(tmp) / "served", **SCALING).out
        t = time.perf_counter()
        served = VllmModel(folder)
        result["vllm_start_seconds"] = round(time.perf_counter() - t, 2)
        runs = []
        try:
            for i in range(args.repeats):
                for name, backend in (("transformers", model), ("vllm", served)):
                    where = Path(tmp) / f"{name}-{i}"
                    where.mkdir()
                    before = load()
                    row = {"repeat": i, "backend": name, "load_before": before}
                    row.update(measure(backend, tok, text, lengths, args.ppl_length, args.trials, where))
                    row["load_after"] = load()
                    runs.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "outputs"}), flush=True)
        finally:
            served.close()
    result["runs"] = runs
    hf = [r for r in runs if r["backend"] == "transformers"]
    vl = [r for r in runs if r["backend"] == "vllm"]
    result["same_passkey_outputs"] = all(a["outputs"] == b["outputs"] for a, b in zip(hf, vl, strict=True))
    result["perplexity_rel_diff"] = max(
        abs(a["perplexity"] - b["perplexity"]) / a["perplexity"] for a, b in zip(hf, vl, strict=True)
    )
    result["load_end"] = load()
    print(json.dumps(result))
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
