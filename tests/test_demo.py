"""`rope-extend demo --quick` end to end on the bundled model (about a minute)."""

import json

import pytest

from rope_extend.cli import main
from rope_extend.demo import FINETUNED, METHODS


@pytest.mark.skipif(
    not __import__("rope_extend.bundled", fromlist=["available"]).available(),
    reason="the bundled model is not built into this checkout",
)
def test_demo_quick(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    for label in [
        "none",
        "linear x4",
        "yarn x4",
        "dynamic_yarn x4",
        "self_extend",
        "dual_chunk",
        "rerope logn",
        FINETUNED,
    ]:
        assert label in table
    results = json.loads((out / "results.json").read_text())
    labels = {r["label"] for r in results["summary"]["passkey"]}
    assert len(labels) == len(METHODS) + 1
    for name in ("report.md", "results.csv", "passkey.png", "perplexity.png"):
        assert (out / name).is_file()
    finetuned = json.loads((out / "finetune" / "model" / "config.json").read_text())
    assert finetuned["rope_parameters"]["rope_type"] == "yarn" and finetuned["max_position_embeddings"] == 1024
    # a second run refuses to replace the report unless told to
    before = (out / "report.md").read_text()
    capsys.readouterr()
    assert main(["demo", "--quick", "--out", str(out)]) == 2
    assert "already holds results" in capsys.readouterr().err and (out / "report.md").read_text() == before
