"""eval/benchmarks/cuda_passes.py and compiled_decode.py at tiny sizes on the CPU (--smoke): the kernel candidates
that run on the CPU match today's passes, and compiled decoding runs; their GPU numbers come only from a GPU
(eval/reports/gpu/)."""

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parents[1] / "eval" / "benchmarks"


def run(script, *args):
    proc = subprocess.run(
        [sys.executable, str(HERE / script), "--smoke", *args], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pass_kernels_match_torch_tiles_on_every_pass_shape():
    # 700 tokens: the band pass's last block of rows is shorter than the window (the rectangle the cut adds)
    report = run("cuda_passes.py", "--lengths", "512,700", "--candidates", "flash,flex,efficient", "--repeats", "1")
    rows = {(r["pass"], r["length"], r["kernel"]): r for r in report["rows"]}
    assert len(rows) == 2 * 3 * 4
    for (_, _, kernel), row in rows.items():
        if kernel == "efficient":  # a CUDA kernel: on the CPU, an error row beside the others
            assert "NotImplementedError" in row["error"]
        elif kernel != "torch_tiles":
            assert row["max_out_diff"] < 1e-5 and row["max_lse_diff"] < 1e-5 and row["same_empty_rows"], row


def test_compiled_decoding_runs_and_matches_eager_in_float32():
    report = run("compiled_decode.py", "--variants", "yarn", "--new", "4")
    (row,) = report["rows"]
    assert row["variant"] == "yarn" and "error" not in row, row
    assert row["tokens_equal"] and row["compiled_runs_equal"] and row["compiled_tokens_per_s"] > 0
