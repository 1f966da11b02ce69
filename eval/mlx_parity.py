"""Parity of MLX exports with the patched transformers model, measured in mlx-lm itself (its CPU build).

    ROPE_EXTEND_MLX_PYTHON=/work/venvs/mlx/bin/python python -m eval.mlx_parity
    ROPE_EXTEND_MLX_PYTHON=... python -m eval.mlx_parity --smollm2 yarn:4:1024:2560,llama3:4:1024:2560

For each case: export the model with ``rope_extend.export(..., "mlx", ...)``, run the folder in mlx-lm
(``tests/export/mlx_run.py``, in the MLX venv's interpreter: mlx-lm and rope-extend's torch live apart) and
compare with the same model patched in transformers on the same token ids: per-token log-probs (largest absolute
difference), perplexity, and a greedy continuation of ``NEW`` tokens (mlx-lm's own KV cache). The prompts end at
the export's length, past ``L`` (none: at ``L``); LongRoPE exports with ``--approximate`` (mlx-lm keeps its long
factors below ``L``), which past ``L``, as here, is the patched model. The tiny models, ids and the transformers
side are ``eval.vllm_parity``'s.

The MLX venv, one command (mlx-lm pulls transformers and numpy, no torch):
``python -m venv /work/venvs/mlx && /work/venvs/mlx/bin/pip install "mlx[cpu]==0.32.4" mlx-lm==0.32.2``.
Prints a Markdown table and writes ``--out`` (JSON) when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

import rope_extend
from eval.vllm_parity import (
    LONGROPE,
    NEW,
    Case,
    perplexity,
    random_ids,
    tiny_folder,
    tiny_overrides,
    transformers_run,
)
from rope_extend.export import export

L = 256
ENV = "ROPE_EXTEND_MLX_PYTHON"  # the MLX venv's interpreter
RUN = Path(__file__).resolve().parents[1] / "tests" / "export" / "mlx_run.py"
PINNED = {"mlx": "0.32.4", "mlx_lm": "0.32.2"}
VENV_COMMAND = 'python -m venv VENV && VENV/bin/pip install "mlx[cpu]==0.32.4" mlx-lm==0.32.2'


def mlx_python() -> str | None:
    """The MLX venv's interpreter (``ROPE_EXTEND_MLX_PYTHON``), None when unset or not a file."""
    path = os.environ.get(ENV)
    return path if path and Path(path).is_file() else None


def tiny_cases() -> list[Case]:
    """The methods of the issue on Llama (YaRN also with its own attention factor, written as mlx-lm's
    ``mscale``), and YaRN on the other families mlx-lm's initialize_rope serves."""
    llama = [
        Case("llama", name, params=LONGROPE if name == "longrope" else {})
        for name in ("none", "linear", "ntk", "yarn", "llama3", "longrope")
    ]
    own_scale = Case("llama", "yarn", params={"attention_factor": 1.3})
    return [*llama, own_scale, *(Case(family, "yarn") for family in ("mistral", "qwen2", "qwen3"))]


def mlx_run(folder: Path, ids: list[int], new: int, python: str) -> dict:
    """mlx-lm on ``folder`` (``tests/export/mlx_run.py`` in the MLX venv): log-probs, greedy tokens, ropes."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"model": str(folder), "ids": ids, "new": new}), encoding="utf-8")
        done = subprocess.run([python, str(RUN), str(spec), str(out)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"mlx-lm failed on {folder}:\n{done.stderr[-3000:]}")
        result = json.loads(out.read_text(encoding="utf-8"))
    found = {k: result[k] for k in PINNED}
    if found != PINNED:
        raise RuntimeError(f"the MLX venv has {found}, the export was read from {PINNED}")
    return result


def measure(case: Case, model, source, ids: list[int], folder: Path, python: str, new: int = NEW) -> dict:
    """Export ``source`` with ``case``, run it in mlx-lm and compare with ``model`` patched with the same."""
    options = {} if case.method == "none" else {"method": case.method, **case.patch_args()}
    result = export(str(source), "mlx", folder, approximate=case.method == "longrope", **options)
    start = time.perf_counter()
    if case.method != "none":
        rope_extend.patch(model, case.method, **case.patch_args())
    try:
        ref, ref_greedy = transformers_run(model, ids, new)
    finally:
        if case.method != "none":
            rope_extend.unpatch(model)
    seconds_hf = time.perf_counter() - start
    start = time.perf_counter()
    got = mlx_run(folder, ids, new, python)
    seconds_mlx = time.perf_counter() - start
    lp = np.array(got["logprobs"], dtype=np.float64)
    first = next((i for i, (a, b) in enumerate(zip(got["greedy"], ref_greedy, strict=True)) if a != b), None)
    ppl_hf, ppl_mlx = perplexity(ref), perplexity(lp)
    name = case.name + (
        f" (attention_factor {case.params['attention_factor']})" if "attention_factor" in case.params else ""
    )
    return {
        "family": case.family,
        "method": name,
        "how": result.how,
        "tokens": len(ids),
        "original": case.original,
        "ppl_transformers": ppl_hf,
        "ppl_mlx": ppl_mlx,
        "ppl_rel_diff": abs(ppl_mlx - ppl_hf) / ppl_hf,
        "logprob_max_abs_diff": float(np.abs(lp - ref).max()),
        "greedy_identical": first is None,
        "greedy_first_difference": first,
        "rope": got["rope"],
        "seconds_transformers": seconds_hf,
        "seconds_mlx": seconds_mlx,
    }


def tiny_rows(cases: list[Case], tmp: Path, python: str) -> list[dict]:
    from eval.tiny import tiny_model

    rows = []
    for i, case in enumerate(cases):
        source = tiny_folder(case.family, tmp / f"{case.family}-{i}")
        model = tiny_model(case.family, **tiny_overrides(case.family))
        ids = random_ids(case.target(L) - NEW)
        rows.append(measure(case, model, source, ids, tmp / f"export-{i}", python))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "rope"}), flush=True)
    return rows


def smollm2_rows(specs: list[str], tmp: Path, python: str) -> list[dict]:
    """SmolLM2-135M exported with ``method:factor:L:tokens`` (a smaller L than its 8192 reaches past it sooner)
    on the first ``tokens`` of ``lcet10.txt``."""
    from rope_extend.documents import read_documents
    from rope_extend.loading import resolve_name

    model, tokenizer = rope_extend.load("smollm2-135m")
    text = tokenizer(read_documents("canterbury/lcet10.txt")[0])["input_ids"]
    rows = []
    for i, spec in enumerate(specs):
        method, factor, original, count = spec.split(":")
        case = Case(
            "smollm2-135m", method, float(factor), int(original), LONGROPE_SMOLLM2 if method == "longrope" else {}
        )
        rows.append(measure(case, model, resolve_name("smollm2-135m"), text[: int(count)], tmp / f"s-{i}", python))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "rope"}), flush=True)
    return rows


# SmolLM2's head is 64 wide: 32 factors each, short ones near 1, long ones spread to 2 x the factor (x4)
LONGROPE_SMOLLM2 = {
    "short_factor": [1.0 + i / 128 for i in range(32)],
    "long_factor": [1.0 + i / 4.4 for i in range(32)],
}


def markdown(rows: list[dict]) -> str:
    lines = [
        f"| family | method | tokens (L) | ppl patched | ppl mlx-lm | max abs dlogp | greedy {NEW} |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        same = "identical" if r["greedy_identical"] else f"differs at {r['greedy_first_difference']}"
        lines.append(
            f"| {r['family']} | {r['method']} | {r['tokens']} ({r['original']}) | {r['ppl_transformers']:.4f} | "
            f"{r['ppl_mlx']:.4f} | {r['logprob_max_abs_diff']:.1e} | {same} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", help="comma-separated method:factor:L:tokens for SmolLM2-135M")
    parser.add_argument("--no-tiny", action="store_true", help="only the SmolLM2 cases")
    parser.add_argument("--out", help="JSON file to write the rows to")
    args = parser.parse_args(argv)
    python = mlx_python()
    if python is None:
        parser.error(f"set {ENV} to the MLX venv's python ({VENV_COMMAND})")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [] if args.no_tiny else tiny_rows(tiny_cases(), Path(tmp), python)
        if args.smollm2:
            rows += smollm2_rows(args.smollm2.split(","), Path(tmp), python)
    print(markdown(rows))
    if args.out:
        from rope_extend.io import write_json

        write_json(Path(args.out), {"engine": PINNED, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
