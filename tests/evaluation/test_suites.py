import json
import os
from pathlib import Path

import pytest
import yaml

from rope_extend import RopeExtendError, resources
from rope_extend.cli import main
from rope_extend.evaluation.compare import run_suite
from rope_extend.evaluation.suite import load_suite, parse_suite
from rope_extend.hf.reading import rotary_geometry
from tests.evaluation.conftest import make_text

SUITES = sorted(resources.SUITES.glob("*.yaml"))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": make_text(60, seed=i)}) for i in range(2)))
    return path


def rotary_pairs(model_dir):
    """d/2, the number of LongRoPE factors a saved model's heads take (the package's own rotary geometry)."""
    from transformers import AutoConfig

    return rotary_geometry(AutoConfig.from_pretrained(model_dir))[0] // 2


def tiny_overrides(suite_path, tiny_dir, data_file):
    raw = yaml.safe_load(suite_path.read_text())
    sets = [f"model={tiny_dir}", "dtype=float32", "device=cpu"]
    for task in ("passkey", "niah", "perplexity"):
        if task in raw:
            sets += [f"{task}.lengths=[128, 256]"]
            sets += [f"{task}.trials=1", f"{task}.max_new_tokens=4"] if task != "perplexity" else []
            sets += [f"{task}.trials_at=null"] if "trials_at" in raw[task] else []
            sets += [f"{task}.depths=[0, 1]"] if task == "niah" else []
            sets += [f"{task}.data={data_file}"] if task != "passkey" else []
    if "ruler" in raw:  # RULER's prompts at the suite's lengths (12k) would take minutes on the tiny model
        sets += ["ruler.lengths=[1024]", "ruler.samples=1", "ruler.max_new_tokens=4"]
    if any(m.get("method") == "longrope" for m in raw["methods"]):  # factors sized for the tiny model's heads
        half = rotary_pairs(tiny_dir)
        tiny = {"short_factor": [1.0] * half, "long_factor": [2.0] * half}
        methods = [{**m, "params": tiny} if m.get("method") == "longrope" else m for m in raw["methods"]]
        sets += [f"methods={json.dumps(methods)}"]
    return sets


def test_there_are_suites():
    assert SUITES, "rope_extend/suites/ should hold at least one suite"


@pytest.mark.parametrize("suite_path", SUITES, ids=lambda p: p.name)
def test_every_suite_loads_and_runs_on_a_tiny_model(suite_path, tiny_dir, data_file, tmp_path):
    load_suite(suite_path)  # as shipped: keys valid, methods known
    suite = load_suite(suite_path, tiny_overrides(suite_path, tiny_dir, data_file))
    result = run_suite(suite, out=tmp_path / "report", progress=False)
    labels = {r["label"] for r in result["records"]}
    assert labels == {m.name() for m in suite.methods}
    for name in ("results.json", "results.csv", "report.md", "suite.yaml", "records.jsonl"):
        assert (tmp_path / "report" / name).is_file()
    report = (tmp_path / "report" / "report.md").read_text()
    assert all(f"| {m.name()}" in report or f" {m.name()} |" in report for m in suite.methods)
    n_records = len(result["records"])
    again = run_suite(suite, out=tmp_path / "report", resume=True, progress=False)
    assert len(again["records"]) == n_records
    assert len((tmp_path / "report" / "records.jsonl").read_text().splitlines()) == n_records


def test_unknown_keys_name_the_closest_valid_ones():
    base = {"model": "m", "methods": [{"method": "none"}], "passkey": {"lengths": [128]}}
    with pytest.raises(RopeExtendError, match=r"unknown key 'passky'.*did you mean 'passkey'.*valid keys"):
        parse_suite({**base, "passky": {"lengths": [128]}})
    with pytest.raises(RopeExtendError, match="passkey is missing 'lengths'"):
        parse_suite({**base, "passkey": {}})
    with pytest.raises(RopeExtendError, match=r"the suite: unknown key 'passkey.trails'.*'passkey.trials'"):
        parse_suite({**base, "passkey": {"lengths": [128], "trails": 3}})
    with pytest.raises(RopeExtendError, match=r"methods\[0\]\.factr.*'methods\[0\]\.factor'"):
        parse_suite({**base, "methods": [{"method": "yarn", "factr": 2}]})
    with pytest.raises(RopeExtendError, match="unknown method 'yarm'.*did you mean 'yarn'"):
        parse_suite({**base, "methods": [{"method": "yarm", "factor": 2}]})
    with pytest.raises(RopeExtendError, match="positive integer"):
        parse_suite({**base, "passkey": {"lengths": [0]}})
    with pytest.raises(RopeExtendError, match="no task"):
        parse_suite({"model": "m", "methods": [{"method": "none"}]})
    with pytest.raises(RopeExtendError, match="same label"):
        parse_suite({**base, "methods": [{"method": "none"}, {"method": "none"}]})
    with pytest.raises(RopeExtendError, match="perplexity.sliding_window: got 'off'.*one of 'auto', 'full', 'keep'"):
        parse_suite({**base, "perplexity": {"lengths": [128], "sliding_window": "off"}})
    suite = parse_suite(base, overrides=["passkey.trials=3", "passkey.depths=grid:3"])
    assert suite.passkey.trials == 3 and suite.passkey.depths == [0, 0.5, 1]
    # narrowing the lengths from the command line: the error says how to drop the suite's trials_at
    more = {**base, "passkey": {"lengths": ["4k", "16k"], "trials_at": {"16k": 10}}}
    with pytest.raises(RopeExtendError, match=r"trials_at names 16384.*--set TASK\.trials_at=null"):
        parse_suite(more, overrides=["passkey.lengths=[4k]"])
    suite = parse_suite(more, overrides=["passkey.lengths=[4k]", "passkey.trials_at=null"])
    assert suite.passkey.lengths == [4096] and suite.passkey.trials_at is None


def test_cli_passkey_perplexity_and_errors(tiny_dir, data_file, tmp_path, capsys):
    out = tmp_path / "pk"
    args = [
        "eval",
        "passkey",
        "--model",
        str(tiny_dir),
        "--lengths",
        "128,160",
        "--trials",
        "2",
        "--depths",
        "0,1",
        "--method",
        "yarn",
        "--factor",
        "2",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(args + ["--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {r["length"] for r in printed["summary"]["passkey"]} == {128, 160}
    assert {p.name for p in out.iterdir()} >= {
        "records.jsonl",
        "results.json",
        "results.csv",
        "report.md",
        "passkey.png",
        "passkey_heatmap_yarn_x2.png",
    }
    records = json.loads((out / "results.json").read_text())["records"]
    assert len(records) == 8 and {r["method"] for r in records} == {"yarn"}
    before = (out / "records.jsonl").read_text()
    assert main(args) == 2  # existing results and no --resume: refused, nothing lost
    assert "already holds results" in capsys.readouterr().err and (out / "records.jsonl").read_text() == before
    assert main(args + ["--resume"]) == 0 and (out / "records.jsonl").read_text() == before
    table = capsys.readouterr().out  # without --json: the report's tables, trials and intervals in each cell
    assert "| length | yarn x2 |" in table and f"wrote 5 files into {out}" in table
    assert [line.count("/4;") for line in table.splitlines() if line.startswith(("| 128 |", "| 160 |"))] == [1, 1]

    assert (
        main(
            [
                "eval",
                "perplexity",
                "--model",
                str(tiny_dir),
                "--lengths",
                "64,128",
                "--data",
                str(data_file),
                "--stride",
                "32",
                "--out",
                str(tmp_path / "ppl"),
                "--no-progress",
            ]
        )
        == 0
    )
    assert (tmp_path / "ppl" / "perplexity.png").is_file()
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "passkey",
                "--model",
                str(tiny_dir),
                "--lengths",
                "128",
                "--method",
                "yarm",
                "--factor",
                "2",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    assert "unknown method 'yarm'" in capsys.readouterr().err
    assert (
        main(
            [
                "eval",
                "perplexity",
                "--model",
                str(tiny_dir),
                "--lengths",
                "100000",
                "--data",
                str(data_file),
                "--out",
                str(tmp_path / "y"),
                "--no-progress",
            ]
        )
        == 2
    )
    assert "cannot be reached" in capsys.readouterr().err
    assert main(["eval", "passkey", "--model", str(tiny_dir), "--lengths", "1.5", "--out", str(tmp_path / "z")]) == 2
    assert "positive integer" in capsys.readouterr().err


def test_cli_niah_and_compare(tiny_dir, data_file, tmp_path):
    assert (
        main(
            [
                "eval",
                "niah",
                "--model",
                str(tiny_dir),
                "--lengths",
                "128,256",
                "--data",
                str(data_file),
                "--depths",
                "grid:3",
                "--out",
                str(tmp_path / "n"),
                "--no-progress",
            ]
        )
        == 0
    )
    assert (tmp_path / "n" / "niah_heatmap_none.png").is_file()
    suite = tmp_path / "s.yaml"
    suite.write_text(
        yaml.safe_dump(
            {
                "model": "x",
                "methods": [{"method": "none"}, {"method": "linear", "factor": 2}],
                "perplexity": {"lengths": [64], "data": data_file.name},
            }
        )
    )
    (tmp_path / data_file.name).write_text(data_file.read_text())  # relative data path: beside the suite
    assert (
        main(["eval", "compare", str(suite), "--model", str(tiny_dir), "--out", str(tmp_path / "c"), "--no-progress"])
        == 0
    )
    rows = json.loads((tmp_path / "c" / "results.json").read_text())["summary"]["perplexity"]
    assert [r["label"] for r in rows] == ["none", "linear x2"]
    assert rows[0]["perplexity"] != rows[1]["perplexity"]  # the scaling changed the model


def test_cli_plot_spectrum(tmp_path, capsys):
    out = tmp_path / "spectrum.png"
    spectrum = ["plot", "spectrum", "--methods", "linear,yarn,longrope", "--factor", "4", "--out", str(out)]
    assert main(spectrum) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out}: linear, yarn"
    assert main(spectrum + ["--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["methods"] == ["linear", "yarn"] and printed["skipped"] == ["longrope"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_checks_every_method_against_the_model_before_the_first_runs(tiny_dir, tmp_path):
    suite = parse_suite(
        {
            "model": str(tiny_dir),
            "methods": [
                {"method": "none"},
                {"method": "longrope", "factor": 2, "params": {"short_factor": [1.0], "long_factor": [2.0]}},
            ],
            "passkey": {"lengths": [128], "trials": 1},
        }
    )
    with pytest.raises(RopeExtendError, match="short_factor"):
        run_suite(suite, out=tmp_path / "r", progress=False)
    assert not (tmp_path / "r" / "records.jsonl").exists()  # `none` did not run first


def test_cli_compare_trials_at_and_records_from_another_run(tiny_dir, tmp_path, monkeypatch):
    from rope_extend.evaluation import retrieval

    suite = tmp_path / "s.yaml"
    suite.write_text(
        "model: x\nmethods: [{method: none}]\n"
        "passkey: {lengths: [128, 160], trials: 1, trials_at: {160: 3}, max_new_tokens: 3}\n"
    )
    base = ["eval", "compare", str(suite), "--model", str(tiny_dir), "--no-progress"]
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    first = json.loads((tmp_path / "a" / "results.json").read_text())
    assert [(r["length"], r["trials"]) for r in first["summary"]["passkey"]] == [(128, 1), (160, 3)]
    calls = []
    real = retrieval.greedy
    monkeypatch.setattr(retrieval, "greedy", lambda *a: calls.append(len(a[2])) or real(*a))
    # another machine: a new folder, going on from the committed report; one more trial at 160
    more = [*base, "--out", str(tmp_path / "b"), "--records-from", str(tmp_path / "a" / "results.json")]
    assert main([*more, "--set", "passkey.trials_at={160: 4}"]) == 0
    assert calls == [160]
    second = json.loads((tmp_path / "b" / "results.json").read_text())
    assert second["records"][:4] == first["records"]
    assert [(r["length"], r["trials"]) for r in second["summary"]["passkey"]] == [(128, 1), (160, 4)]
    # a bad source or a length not measured: refused before the model loads, nothing written
    assert main([*base, "--out", str(tmp_path / "c"), "--records-from", str(tmp_path / "nowhere.jsonl")]) == 2
    assert main([*base, "--out", str(tmp_path / "d"), "--set", "passkey.trials_at={4k: 2}"]) == 2
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()
    assert calls == [160]


def test_params_from_reads_a_search_result_beside_the_suite(tiny_dir, tmp_path):
    half = rotary_pairs(tiny_dir)
    long = [1.0 + i / half for i in range(half)]
    result = {  # the shape a LongRoPE search writes: extra keys (fitness, settings) are not parameters
        "rope_type": "longrope",
        "factor": 2.0,
        "short_factor": [1.0] * half,
        "long_factor": long,
        "fitness": 3.2,
        "settings": {"model": "m"},
    }
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "longrope.json").write_text(json.dumps(result))
    suite_file = tmp_path / "search" / "suite.yaml"
    base = {"model": str(tiny_dir), "dtype": "float32", "passkey": {"lengths": [128], "trials": 1}}
    method = {"method": "longrope", "params_from": "longrope.json", "label": "searched"}
    suite_file.write_text(yaml.safe_dump({**base, "methods": [method]}))
    suite = load_suite(suite_file)
    spec = suite.methods[0]
    assert spec.factor == 2.0 and spec.params == {"short_factor": [1.0] * half, "long_factor": long}
    run = run_suite(suite, out=tmp_path / "r", progress=False)
    assert run["records"][0]["params"]["long_factor"] == long  # the record's setting holds the values read

    # keys given in params win over the file's
    mine = {**method, "params": {"long_factor": [2.0] * half}}
    spec = parse_suite({**base, "methods": [mine]}, path=suite_file).methods[0]
    assert spec.params["long_factor"] == [2.0] * half and spec.params["short_factor"] == [1.0] * half

    def refused(match, **change):
        with pytest.raises(RopeExtendError, match=match):
            parse_suite({**base, "methods": [{**method, **change}]}, path=suite_file)

    refused(r"params_from \(.*missing.json\): no such file", params_from="missing.json")
    refused("made for factor 2, but the method asks for 4", factor=4)
    refused("made for factor 2: give that factor instead of target_length", target_length=512)
    (tmp_path / "search" / "yarn.json").write_text(json.dumps({"rope_type": "yarn", "factor": 2.0, "beta_fast": 16}))
    refused("rope_type 'yarn', not of method 'longrope'", params_from="yarn.json")
    (tmp_path / "search" / "list.json").write_text("[1, 2]")
    refused("holds a list, not a JSON object", params_from="list.json")
    (tmp_path / "search" / "bad.json").write_text("{not json")
    refused(r"bad.json\) is not valid JSON", params_from="bad.json")
    (tmp_path / "search" / "other.json").write_text(json.dumps({"fitness": 3.0}))
    refused("has none of longrope's parameters", params_from="other.json")
    (tmp_path / "search" / "text.json").write_text(json.dumps({**result, "factor": "2"}))
    refused("factor must be a number, got '2'", params_from="text.json")
    refused("params_from given without a scaling method", method="none")
    short = {**result, "long_factor": long[:-1]}
    (tmp_path / "search" / "short.json").write_text(json.dumps(short))
    refused("same length", params_from="short.json")


@pytest.mark.parametrize(
    ("suite", "search"),
    [("smollm2-32k-longrope", "smollm2-longrope-search"), ("smollm2-32k-longrope2", "smollm2-longrope2-search")],
)
def test_the_shipped_longrope_suites_hold_the_committed_search_results(suite, search):
    """Each shipped LongRoPE suite copies the factors of its search's eval/reports/<search>/longrope.json."""
    result = Path(__file__).parents[2] / "eval" / "reports" / search / "longrope.json"
    if not result.is_file():
        pytest.skip("the search report is in the repository, not in an installed package")
    searched = json.loads(result.read_text())
    (method,) = [m for m in load_suite(suite).methods if m.method == "longrope"]
    assert method.factor == searched["factor"]
    assert method.params == {k: searched[k] for k in ("short_factor", "long_factor")}


def test_a_huge_value_in_params_from_is_shown_short_and_quickly(tiny_dir, tmp_path):
    """``params_from``'s errors show a value from the file bounded (``untrusted.shown``): a factor of 100,000
    items, or a rope_type that is a long list, is a short message, computed at once."""
    import time

    base = {"model": str(tiny_dir), "dtype": "float32", "passkey": {"lengths": [128], "trials": 1}}
    method = {"method": "longrope", "label": "searched"}
    for name, content in {
        "factor.json": {"factor": [1.5] * 100_000, "long_factor": [1.0]},
        "type.json": {"rope_type": ["yarn"] * 100_000, "long_factor": [1.0]},
    }.items():
        (tmp_path / name).write_text(json.dumps(content))
        start = time.monotonic()
        with pytest.raises(RopeExtendError) as info:
            parse_suite({**base, "methods": [{**method, "params_from": str(tmp_path / name)}]})
        assert time.monotonic() - start < 1
        text = str(info.value)
        assert len(text) < 400 and "..." in text, text
        assert "factor must be a number, got [1.5, 1.5," in text or "rope_type ['yarn', 'yarn'," in text


@pytest.mark.parametrize(
    ("plant", "said"),
    [
        (lambda p: os.mkfifo(p), "is a named pipe, not a regular file"),
        (lambda p: p.write_bytes(b" " * (2 << 20)), "is larger than 1048576 bytes"),
        (lambda p: p.write_bytes(b'{"long_factor": "\xff"}'), "is not UTF-8 text (byte 17)"),
        (lambda p: p.write_text("[" * 100_000), "is nested too deeply to be read as JSON"),
    ],
    ids=["fifo", "huge", "not utf-8", "deep"],
)
def test_a_hostile_params_from_file_is_one_line_before_the_model_loads(tiny_dir, tmp_path, capsys, plant, said):
    suite = tmp_path / "suite.yaml"
    method = {"method": "longrope", "factor": 2, "params_from": "p.json"}
    suite.write_text(yaml.safe_dump({"model": str(tiny_dir), "methods": [method], "passkey": {"lengths": [128]}}))
    plant(tmp_path / "p.json")
    capsys.readouterr()
    code = main(["eval", "compare", str(suite), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"methods[longrope x2].params_from ({tmp_path / 'p.json'}) {said}: give a JSON object" in err
    assert not (tmp_path / "out").exists()
