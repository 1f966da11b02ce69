"""eval/benchmarks/train_scale.py at a tiny shape on the CPU (--smoke): every variant steps, tiling changes no loss,
and the slopes and ratios come out. Its Llama-3-8B-shape numbers are in docs/benchmarks.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "eval" / "benchmarks" / "train_scale.py"


def test_smoke_steps_every_variant_and_tiling_changes_no_loss(tmp_path):
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--lengths", "128", "256", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report == json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {(r["variant"], r["tokens"]): r for r in report["rows"]}
    assert set(rows) == {(v, t) for v in ("hf", "rope", "rope+tiled_mlp") for t in (128, 256)}
    for t in (128, 256):
        assert rows["rope+tiled_mlp", t]["loss"] == pytest.approx(rows["rope", t]["loss"], abs=1e-6)
        assert rows["rope+tiled_mlp", t]["mlp_tiles"] == t // 64  # --smoke: 64-token tiles
        assert rows["hf", t]["loss"] == pytest.approx(rows["rope", t]["loss"], abs=1e-4)  # the same mean token loss
        assert all(r["step_mb"] > 0 and r["seconds"] > 0 for r in rows.values())
    slopes = report["slopes_kib_per_token"]
    assert set(slopes) == {"hf", "rope", "rope+tiled_mlp"} and slopes["hf"] > 0
    assert report["slope_ratio_vs_hf"]["rope+tiled_mlp"] == pytest.approx(slopes["rope+tiled_mlp"] / slopes["hf"])
    assert report["tiled_target_met"] == (report["slope_ratio_vs_hf"]["rope+tiled_mlp"] <= 1 / 8)
    assert "| rope+tiled_mlp |" in proc.stdout
