import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rope_extend.evaluation.report import markdown, summarize, time_table, wilson, write_report
from rope_extend.evaluation.spectrum import spectrum


def synthetic_records():
    """Passkey trials and perplexity documents of two runs with known numbers."""
    recs = []
    acc = {"none": {1024: 1.0, 2048: 0.5, 4096: 0.0}, "yarn-4": {1024: 1.0, 2048: 1.0, 4096: 0.75}}
    for label, table in acc.items():
        for length, a in table.items():
            for depth in (0.0, 0.5, 1.0):
                for trial in range(4):
                    recs.append(
                        {
                            "task": "passkey",
                            "label": label,
                            "method": label.split("-")[0],
                            "length": length,
                            "depth": depth,
                            "depth_grid": depth,
                            "trial": trial,
                            "correct": trial < 4 * a,
                        }
                    )
    for label, ppls in {"none": [8.0, 60.0, 900.0], "yarn-4": [8.2, 7.5, 7.1]}.items():
        for length, ppl in zip((1024, 2048, 4096), ppls, strict=True):
            for doc, tokens in ((0, 100), (1, 300)):
                import math

                recs.append(
                    {
                        "task": "perplexity",
                        "label": label,
                        "method": "x",
                        "length": length,
                        "doc": doc,
                        "tokens": tokens,
                        "nll": tokens * math.log(ppl),
                        "params": {"a": 1},
                    }
                )
    return recs


def test_summary_and_markdown_numbers():
    summary = summarize(synthetic_records())
    pk = {(r["label"], r["length"]): r["accuracy"] for r in summary["passkey"]}
    assert pk == {
        ("none", 1024): 1.0,
        ("none", 2048): 0.5,
        ("none", 4096): 0.0,
        ("yarn-4", 1024): 1.0,
        ("yarn-4", 2048): 1.0,
        ("yarn-4", 4096): 0.75,
    }
    ppl = {(r["label"], r["length"]): r["perplexity"] for r in summary["perplexity"]}
    assert ppl[("none", 2048)] == pytest.approx(60.0) and ppl[("yarn-4", 4096)] == pytest.approx(7.1)
    assert len(summary["passkey_depth"]) == 18
    md = markdown(summary, "T")
    assert "| length | none | yarn-4 |" in md
    # 3 depths x 4 trials per cell: 6/12 and 12/12 with their 95% Wilson intervals
    assert "| 2k | 50% (6/12; 25-75) | 100% (12/12; 76-100) |" in md and "| 4k | 900.000 | 7.100 |" in md
    assert "| 4k | 0% (0/12; 0-24) | 75% (9/12; 47-91) |" in md
    row = next(r for r in summary["passkey"] if (r["label"], r["length"]) == ("yarn-4", 4096))
    assert (row["correct"], row["trials"]) == (9, 12) and row["low"] == pytest.approx(0.4677, abs=1e-4)
    assert "| context (>= 80%) | 1k | 2k |" in md


@pytest.mark.parametrize(
    "k, n, low, high",
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I, method 3 (Wilson)
    [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)],
)
def test_wilson_interval_matches_newcombes_published_values(k, n, low, high):
    assert wilson(k, n) == pytest.approx((low, high), abs=5e-5)


@given(st.integers(1, 500).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
def test_wilson_interval_holds_the_estimate_inside_zero_one_and_narrows_with_more_trials(kn):
    k, n = kn
    low, high = wilson(k, n)
    assert 0.0 <= low <= k / n <= high <= 1.0 and high - low > 0
    low4, high4 = wilson(4 * k, 4 * n)  # the same proportion from four times the trials
    assert high4 - low4 < high - low
    assert wilson(n - k, n) == pytest.approx((1 - high, 1 - low))  # symmetric in success and failure


def test_write_report_files(tmp_path):
    records = synthetic_records()
    files = write_report(tmp_path, records, title="synthetic")
    assert set(files) == {
        "json",
        "csv",
        "markdown",
        "passkey_plot",
        "perplexity_plot",
        "passkey_heatmap_none",
        "passkey_heatmap_yarn-4",
    }
    for path in files.values():
        assert path.is_file() and path.stat().st_size > 0
        if path.suffix == ".png":
            assert path.read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "results.json").read_text())["records"] == records
    assert len((tmp_path / "results.csv").read_text().splitlines()) == len(records) + 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_spectrum_ratios():
    curves, skipped = spectrum(
        ["linear", "ntk", "yarn", "longrope"], factor=4, head_dim=128, base=10000, original_length=4096
    )
    assert set(skipped) == {"longrope"}
    assert curves["linear"]["ratio"] == pytest.approx([0.25] * 64)
    assert curves["ntk"]["ratio"][0] == pytest.approx(1.0) and curves["ntk"]["ratio"][-1] == pytest.approx(
        0.25, rel=1e-4
    )
    yarn = curves["yarn"]["ratio"]  # the YaRN ramp for head_dim 128, L 4096: low=20, high=46
    assert yarn[:21] == pytest.approx([1.0] * 21) and yarn[46:] == pytest.approx([0.25] * 18)
    assert curves["yarn"]["attention_scale"] == pytest.approx(1.1386, abs=1e-4)


def test_an_unpatched_model_is_labelled_by_the_scaling_its_config_names():
    """A fine-tuned model (yarn x4 in its config, no patch) is not reported as ``none``."""
    import rope_extend
    from rope_extend.evaluation.records import run_info
    from rope_extend.evaluation.report import label_of
    from tests.tiny import tiny_model

    model = tiny_model()
    assert run_info(model)["method"] == "none" and label_of(run_info(model)) == "none"
    rope_extend.configure(model.config, "yarn", factor=4)
    info = run_info(model)
    assert (info["method"], info["factor"], info["scaling_from"]) == ("yarn", 4.0, "config")
    assert label_of(info) == "yarn x4 (config)"
    rope_extend.patch(model, "linear", factor=2)  # a patch is what runs: it names the run
    assert label_of(run_info(model)) == "linear x2"


def test_report_sums_the_evaluation_time_per_run_and_task(tmp_path):
    records = [
        {"task": "passkey", "label": "yarn x4", "length": 128, "correct": True, "seconds": 1.5, "cpu_seconds": 3.0},
        {"task": "passkey", "label": "yarn x4", "length": 128, "correct": False, "seconds": 2.25, "cpu_seconds": 4.0},
        {"task": "passkey", "label": "none", "length": 128, "correct": True},  # written before records were timed
    ]
    lines = time_table(records)
    assert "| yarn x4 | passkey | 2 of 2 | 4 | 7 |" in lines and "| none | passkey | 0 of 1 | 0 | 0 |" in lines
    assert time_table([records[2]]) == []  # no timed record: no section
    report = write_report(tmp_path, records)["markdown"].read_text()
    assert "## Evaluation time" in report
