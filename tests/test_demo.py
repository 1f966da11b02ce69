"""`rope-extend demo --quick` end to end on the bundled model (about a minute)."""

import json
import re

import pytest

from rope_extend.cli import main
from rope_extend.demo import CARD, CARD_TASKS, FINETUNED, METHODS, Stages


def test_stage_lines_scale_elapsed_time_by_the_costs_left(monkeypatch, capsys):
    clock = iter([10.0, 12.0, 70.0])
    monkeypatch.setattr("rope_extend.demo.time.perf_counter", lambda: next(clock))
    monkeypatch.setattr("rope_extend.demo._contention", lambda: None)
    stages = Stages([("a", 1.0), ("b", 2.0), ("c", 6.0)], start=10.0)
    assert stages.next() == "[demo] stage 1/3: a | 0:00 elapsed | estimating the time left"
    # 2 s for a stage of cost 1: the stages of cost 2 + 6 left take about 16 s
    assert stages.next("B x4") == "[demo] stage 2/3: B x4 | 0:02 elapsed | about 0:16 left"
    # 60 s for cost 3: 6 left take about 120 s
    assert stages.next() == "[demo] stage 3/3: c | 1:00 elapsed | about 2:00 left"
    assert capsys.readouterr().err.count("[demo] stage") == 3
    with pytest.raises(RuntimeError, match="past the last of 3"):
        stages.next()


def test_the_time_left_follows_this_runs_speed_per_kind_of_stage(monkeypatch, capsys):
    """Issue 55, item 1: the estimate comes from the stages this run finished, per kind (their cost), not from fixed
    stage costs; the time before the first stage (loading the model) is not stage work."""
    clock = iter([100.0, 103.0, 104.0, 105.0])
    monkeypatch.setattr("rope_extend.demo.time.perf_counter", lambda: next(clock))
    monkeypatch.setattr("rope_extend.demo._contention", lambda: None)
    stages = Stages([("a", 1.0), ("b", 1.0), ("c", 1.0), ("d", 5.0)], start=40.0)  # 60 s of loading first
    stages.next()
    assert stages.next().endswith("about 0:21 left")  # a took 3 s: b and c 3 s each, d 5 x 3 s
    # b took 1 s: stages of cost 1 take (3 + 1) / 2 = 2 s; d: 5 x (4 s / 2 units) = 10 s
    assert stages.next().endswith("about 0:12 left")
    monkeypatch.setattr("rope_extend.demo._contention", lambda: "the cores are shared: load 5.0 on 2")
    stages.next()
    assert "(the cores are shared: load 5.0 on 2)" in capsys.readouterr().err.splitlines()[-1]


BUILT = pytest.mark.skipif(
    not __import__("rope_extend.bundled", fromlist=["available"]).available(),
    reason="the bundled model is not built into this checkout",
)


@BUILT
def test_the_fine_tune_writes_nothing_on_the_demos_stdout(tmp_path, capsys):
    """The training loop's summary line is `rope-extend train`'s stdout (tests/test_cli.py); inside the demo it
    goes to stderr, so the demo's stdout is its table and card line only."""
    from rope_extend import bundled
    from rope_extend.demo import Effort, finetune

    effort = Effort(trials=1, ppl_docs=1, steps=1, documents=20, card_samples=1)
    folder = finetune(tmp_path, bundled.trained_length(), effort, seed=0)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "trainable parameters" in captured.err and "1 process(es)" in captured.err
    assert (folder / "config.json").is_file()


@BUILT
def test_demo_quick(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    table = captured.out
    # one progress line per stage: the nine methods, the fine-tune, the fine-tuned model, the card
    stages = re.findall(r"\[demo\] stage (\d+)/(\d+): (.+?) \|", captured.err)
    assert [int(i) for i, _, _ in stages] == list(range(1, 13)) and {n for _, n, _ in stages} == {"12"}
    assert stages[-1][2] == CARD and stages[-2][2] == FINETUNED and stages[9][2] == "fine-tune (12 steps)"
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
    # the card of YaRN x4: RULER's two needle tasks that fit L, a nonzero score at L (the model was taught their
    # format), at L, 2L and 4L
    card = json.loads((out / "card" / "card.json").read_text())
    assert card["ruler_tasks"] == CARD_TASKS and card["ruler_lengths"] == [256, 512, 1024]
    assert card["backends"]["transformers"]["ruler"]["256"] > 0
    line = re.search(r"RULER \(yarn x4\) (.+); effective length (\w+) \(L = 256\); card: (.+)", table)
    assert line and line.group(3).endswith("card.md") and (out / "card" / "card.png").is_file()
    finetuned = json.loads((out / "finetune" / "model" / "config.json").read_text())
    assert finetuned["rope_parameters"]["rope_type"] == "yarn" and finetuned["max_position_embeddings"] == 1024
    # a second run refuses to replace the report unless told to
    before = (out / "report.md").read_text()
    capsys.readouterr()
    assert main(["demo", "--quick", "--out", str(out)]) == 2
    assert "already holds results" in capsys.readouterr().err and (out / "report.md").read_text() == before
