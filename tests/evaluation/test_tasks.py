"""The task interface (``evaluation.tasks``): a task defined once, here in the test, is a suite section, a
``rope-extend eval`` subcommand and a report section, with nothing else edited; the command line and a
suite section of the same task give the same options and the same errors."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import yaml

from rope_extend import RopeExtendError, schema
from rope_extend.cli import build_parser, main
from rope_extend.evaluation import report, runner
from rope_extend.evaluation.compare import run_suite
from rope_extend.evaluation.suite import load_suite, parse_suite
from rope_extend.evaluation.tasks import (
    Context,
    Task,
    TextOptions,
    check_lengths,
    get_task,
    register_task,
    tasks,
    unregister_task,
)
from rope_extend.schema import option
from tests.evaluation.conftest import make_text


# ------------------------------------------------------------------------------------------ the toy task
@dataclass(kw_only=True)
class NextTokenOptions(TextOptions):
    lengths: list[Any] = option(help="context lengths in tokens")
    positions: int = option(4, help="positions scored per length (the last ones)")

    def __post_init__(self):
        check_lengths(self)


def next_token(model, tokenizer, options: NextTokenOptions, context: Context) -> list[dict]:
    """Greedy next-token accuracy over the last ``positions`` tokens of the first ``length`` of the texts."""
    ids = tokenizer(" ".join(context.texts), return_tensors="pt").input_ids[0]
    device = next(model.parameters()).device

    def measure(job):
        window = ids[: job["length"]].to(device)
        with torch.no_grad():
            guess = model(window[None, :-1]).logits[0, -options.positions :].argmax(-1)
        hits = (guess == window[-options.positions :]).float().mean().item()
        return {"correct": hits == 1.0, "hits": hits}

    jobs = [{"length": n} for n in options.lengths]
    return runner.run(
        model,
        task="next_token",
        setting={"positions": options.positions},
        jobs=jobs,
        measure=measure,
        longest=max(options.lengths),
        records=context.records,
        resume=context.resume,
        progress=context.progress,
        run=context.run,
    )


TOY = Task(
    name="next_token",
    help="greedy next-token accuracy at the end of a window",
    title="Next token",
    options=NextTokenOptions,
    run=next_token,
    summarize=lambda records: {"next_token": report.accuracy_rows(records)},
    render=lambda summary: (
        report.length_table(summary["next_token"], "Next-token accuracy", report.accuracy_cell)
        if summary.get("next_token")
        else []
    ),
)


@pytest.fixture
def toy():
    register_task(TOY)
    yield TOY
    unregister_task(TOY.name)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "doc.txt"
    path.write_text(make_text(80, seed=3))
    return path


# ------------------------------------------------------------------------------------------ one definition
def test_a_task_defined_once_runs_from_the_command_line(toy, tiny_dir, text_file, tmp_path, capsys):
    out = tmp_path / "cli"
    args = ["eval", "next_token", "--model", str(tiny_dir), "--lengths", "64,128", "--positions", "3"]
    code = main([*args, "--data", str(text_file), "--out", str(out), "--no-progress", "--json"])
    assert code == 0, capsys.readouterr().err
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = payload["summary"]["next_token"]
    assert sorted(r["length"] for r in rows) == [64, 128] and all(r["trials"] == 1 for r in rows)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["task"] for r in records} == {"next_token"}
    assert all(abs(3 * r["hits"] - round(3 * r["hits"])) < 1e-6 for r in records)  # --positions 3 reached run
    assert "## Next-token accuracy" in (out / "report.md").read_text()
    assert "next_token" in _eval_help()


def _eval_help() -> str:
    parser = build_parser()
    action = next(a for a in parser._subparsers._group_actions if "eval" in a.choices)
    return action.choices["eval"].format_help()


def test_a_task_defined_once_is_a_suite_section(toy, tiny_dir, text_file, tmp_path):
    (tmp_path / "doc.txt").write_text(text_file.read_text())
    path = tmp_path / "toy.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_dir),
                "methods": [{"method": "none"}, {"method": "linear", "factor": 2}],
                "next_token": {"lengths": [64], "data": "doc.txt"},  # relative to the suite file
                "perplexity": {"lengths": [64], "data": "doc.txt"},
            }
        )
    )
    suite = load_suite(path, ["next_token.lengths=[64, 96]"])
    assert [t.name for t, _ in suite.tasks()] == ["perplexity", "next_token"]  # registration order
    result = run_suite(suite, out=tmp_path / "out", progress=False)
    toy_records = [r for r in result["records"] if r["task"] == "next_token"]
    assert {(r["label"], r["length"]) for r in toy_records} == {
        (lb, n) for lb in ("none", "linear x2") for n in (64, 96)
    }
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["suite"]["next_token"]["lengths"] == [64, 96]
    assert len(saved["summary"]["next_token"]) == 4
    text = (tmp_path / "out" / "report.md").read_text()
    assert text.index("## Perplexity") < text.index("## Next-token accuracy")
    again = run_suite(suite, out=tmp_path / "out", resume=True, progress=False)  # resumed: nothing re-run
    assert [r for r in again["records"] if r["task"] == "next_token"] == toy_records


def test_an_unregistered_task_is_no_longer_a_section_nor_a_command(tiny_dir):
    with pytest.raises(RopeExtendError, match="unknown key 'next_token'.*valid keys.*passkey"):
        parse_suite({"model": str(tiny_dir), "methods": [{"method": "none"}], "next_token": {"lengths": [64]}})
    assert "next_token" not in _eval_help()
    with pytest.raises(RopeExtendError, match="unknown evaluation task 'passky'.*did you mean 'passkey'"):
        get_task("passky")


def test_a_misspelt_section_names_the_task(tiny_dir):
    with pytest.raises(RopeExtendError, match="unknown key 'perplexty'; did you mean 'perplexity'"):
        parse_suite({"model": str(tiny_dir), "methods": [{"method": "none"}], "perplexty": {"lengths": [64]}})


def test_no_task_names_the_registered_ones(tiny_dir):
    with pytest.raises(RopeExtendError, match="no task: give at least one of passkey, niah, perplexity, ruler"):
        parse_suite({"model": str(tiny_dir), "methods": [{"method": "none"}]})


@pytest.mark.parametrize("name", ["passkey", "compare", "methods", "not-an-identifier"])
def test_a_task_name_that_is_taken_or_reserved_is_refused(name):
    with pytest.raises(RopeExtendError, match="already registered|identifier other than"):
        register_task(Task(name, "", "", NextTokenOptions, next_token, dict, list))
    assert [t.name for t in tasks()] == ["passkey", "niah", "perplexity", "ruler"]


# ------------------------------------------------------------------------------------------ CLI = YAML
def _from_cli(task, argv):
    parser = argparse.ArgumentParser()
    schema.add_arguments(parser, task.options)
    args = parser.parse_args(argv)
    return schema.build(task.options, schema.arguments_data(args, task.options), where="the command line")


@pytest.mark.parametrize(
    ("name", "argv", "section"),
    [
        ("passkey", ["--lengths", "1k,2k"], {"lengths": ["1k", "2k"]}),
        (
            "passkey",
            ["--lengths", "256", "512", "--key-range", "1", "99", "--depths", "grid:3", "--trials", "2"],
            {"lengths": [256, 512], "key_range": [1, 99], "depths": "grid:3", "trials": 2},
        ),
        (
            "niah",
            ["--lengths", "4k", "--depths", "0,0.5,1", "--needle", "a needle.", "--sample-by", "paragraph"],
            {"lengths": ["4k"], "depths": "0,0.5,1", "needle": "a needle.", "sample_by": "paragraph"},
        ),
        ("perplexity", ["--lengths", "8k", "--stride", "512"], {"lengths": ["8k"], "stride": 512}),
        (
            "ruler",
            ["--lengths", "12k", "--tasks", "vt,niah_single_1", "--samples", "3", "--sliding-window", "keep"],
            {"lengths": ["12k"], "tasks": ["vt", "niah_single_1"], "samples": 3, "sliding_window": "keep"},
        ),
    ],
)
def test_the_command_line_gives_the_options_of_the_same_suite_section(name, argv, section):
    task = get_task(name)
    assert _from_cli(task, argv) == schema.build(task.options, section, where="a suite")


@pytest.mark.parametrize(
    ("name", "argv", "error"),
    [
        ("passkey", ["--lengths", "1.5"], "a length must be a positive integer"),
        ("passkey", ["--lengths", "1k", "--key-range", "9", "1"], "key_range must be two integers"),
        ("passkey", ["--lengths", "1k", "--trials", "0"], "trials must be a positive integer"),
        ("ruler", ["--lengths", "1k", "--tasks", "vtt"], "unknown RULER task 'vtt'"),
        ("perplexity", ["--lengths", "1k", "--stride", "-4"], "stride must be a positive integer"),
    ],
)
def test_bad_options_are_refused_the_same_way_from_both(name, argv, error):
    task = get_task(name)
    with pytest.raises(RopeExtendError, match=error):
        _from_cli(task, argv)
    parser = argparse.ArgumentParser()
    schema.add_arguments(parser, task.options)
    data = schema.arguments_data(parser.parse_args(argv), task.options)
    with pytest.raises(RopeExtendError, match=error):
        parse_suite({"model": "m", "methods": [{"method": "none"}], name: data})


def test_every_task_option_is_a_flag_with_its_help():
    for task in tasks():
        parser = argparse.ArgumentParser()
        schema.add_arguments(parser, task.options)
        text = parser.format_help()
        for f in schema.public_fields(task.options):
            flag = "--" + f.name.replace("_", "-")
            assert flag in text, (task.name, flag)
            assert f.metadata["help"].split()[0] in text


def test_max_docs_holds_for_the_bundled_corpus_too():
    """It used to apply only with --data: without it every bundled document was read."""
    from rope_extend.evaluation.data import default_texts
    from rope_extend.evaluation.perplexity import PerplexityOptions
    from rope_extend.evaluation.tasks import load_task_texts

    assert len(default_texts()) > 2
    assert load_task_texts(PerplexityOptions(lengths=[64], max_docs=2)) == default_texts()[:2]


def test_the_reserved_names_cover_every_suite_key():
    """A task named like a suite key (or like ``Suite.tasks``) would shadow it: RESERVED must list them all."""
    from rope_extend.evaluation.suite import Suite
    from rope_extend.evaluation.tasks.base import RESERVED

    assert {f.name for f in dataclasses.fields(Suite)} | {"tasks", "compare"} <= RESERVED


def test_a_list_option_that_cannot_be_read_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["eval", "passkey", "--model", "bundled", "--lengths", "[1", "--out", str(tmp_path / "o")])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "argument --lengths: value: cannot read '[1'" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["niah", "perplexity"])
def test_a_text_task_without_texts_names_the_task(name):
    # a Context built without loading the texts used to reach the harness and fail with a TypeError there
    from rope_extend.evaluation.tasks.base import TASKS, Context

    task = TASKS.get(name)
    with pytest.raises(RopeExtendError, match=f"the {name} task reads texts, but its context holds none"):
        task.run(None, None, None, Context())
