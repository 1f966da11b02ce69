"""eval/benchmarks/gpu_scale.py at tiny sizes on the CPU (--smoke): every prefill variant runs, decodes and is
compared with the unpatched model; bad arguments are refused. Its GPU numbers come only from a GPU."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "eval" / "benchmarks" / "gpu_scale.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False)


def test_smoke_prefill_and_decode_against_the_unpatched_model():
    proc = run("--smoke", "--sections", "prefill", "--variants", "yarn,self_extend", "--decode", "3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["environment"]["device"] == "cpu" and report["environment"]["shape"] == "tiny (--smoke)"
    prefill = report["sections"]["prefill"]
    rows = {r["variant"]: r for r in prefill["rows"]}
    assert set(rows) == {"native", "yarn", "self_extend"}
    for r in rows.values():
        assert r["finite"] is True and r["seconds"] > 0 and r["decode_step_s"] > 0 and not r["error"]
    for variant in ("yarn", "self_extend"):
        cell = prefill["ratios"][variant]["512"]
        assert set(cell) == {"prefill_time", "peak_memory", "decode_step"} and all(v > 0 for v in cell.values())
        assert prefill["met"][variant] == all(cell[k] <= float(t[3:]) for k, t in prefill["targets"].items())


def test_bad_arguments_name_what_is_allowed():
    proc = run("--smoke", "--sections", "prefill,speed")
    assert (
        proc.returncode == 2 and "unknown sections speed; allowed: prefill, perplexity, train, attention" in proc.stderr
    )
    proc = run("--smoke", "--variants", "yarn,flash")
    assert proc.returncode == 2 and "unknown variants flash" in proc.stderr
