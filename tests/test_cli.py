"""The core subcommands of `rope-extend`."""

import json

import pytest
import transformers as T

import rope_extend
from rope_extend import RopeExtendError
from rope_extend.cli import main, parse_params
from tests.tiny import tiny_model


def test_methods_lists_every_method(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in ("linear", "ntk", "dynamic_ntk", "ntk_by_parts", "yarn", "dynamic_yarn", "llama3", "longrope"):
        assert name in out


def test_configure_copies_a_model_with_a_scaled_config(tmp_path, capsys):
    model = tiny_model()
    model.save_pretrained(tmp_path / "src")
    (tmp_path / "src" / "notes.txt").write_text("kept")
    capsys.readouterr()  # what building the model printed (DeepSpeed's import warning) is not the command's
    assert (
        main(
            [
                "configure",
                str(tmp_path / "src"),
                "--method",
                "yarn",
                "--factor",
                "4",
                "--param",
                "beta_fast=16",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out.splitlines()  # a summary a person reads, not raw JSON
    assert printed[:2] == [f"out:                     {tmp_path / 'out'}", "max_position_embeddings: 1024"]
    assert printed[2].startswith("rope_parameters:") and "rope_type=yarn" in printed[2] and "beta_fast=16" in printed[2]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["beta_fast"] == 16
    assert config["max_position_embeddings"] == 1024
    assert (tmp_path / "out" / "notes.txt").read_text() == "kept"
    assert json.loads((tmp_path / "src" / "config.json").read_text())["rope_parameters"]["rope_type"] == "default"
    T.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    # an existing output folder is refused, and nothing in it is lost
    assert (
        main(
            ["configure", str(tmp_path / "src"), "--method", "linear", "--factor", "2", "--out", str(tmp_path / "out")]
        )
        == 2
    )
    assert "already holds" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"


def test_configure_json_prints_the_raw_result(tmp_path, capsys):
    tiny_model().save_pretrained(tmp_path / "src")
    args = ["configure", str(tmp_path / "src"), "--method", "linear", "--factor", "2", "--out", str(tmp_path / "out")]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["out"] == str(tmp_path / "out") and result["max_position_embeddings"] == 512
    assert result["rope_parameters"]["rope_type"] == "linear" and result["rope_parameters"]["factor"] == 2


def test_configure_reports_bad_arguments(tmp_path, capsys):
    tiny_model().save_pretrained(tmp_path / "src")
    code = main(
        ["configure", str(tmp_path / "src"), "--method", "yarn", "--factor", "0.5", "--out", str(tmp_path / "out")]
    )
    assert code == 2 and "factor must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_parse_params():
    assert parse_params(["a=1", "b=true", "c=[1, 2.5]", "d=x"]) == {"a": 1, "b": True, "c": [1, 2.5], "d": "x"}
    with pytest.raises(RopeExtendError, match="key=value"):
        parse_params(["oops"])


def test_every_command_that_claims_a_folder_takes_the_flags_its_refusal_suggests(tmp_path, capsys):
    """eval: a second run into the same --out is refused with "--resume ... or --overwrite", and both flags are
    accepted (and exclusive); --overwrite replaces the earlier run's records."""
    from rope_extend.cli import build_parser

    out = tmp_path / "pk"
    run = ["eval", "passkey", "--model", "bundled", "--lengths", "128", "--trials", "1", "--no-progress"]
    assert main([*run, "--out", str(out)]) == 0
    first = (out / "records.jsonl").read_text()
    capsys.readouterr()
    assert main([*run, "--out", str(out)]) == 2
    message = capsys.readouterr().err
    assert "--resume" in message and "--overwrite" in message
    assert main([*run, "--out", str(out), "--overwrite"]) == 0
    assert (out / "records.jsonl").read_text().count("\n") == first.count("\n")
    parser = build_parser()
    for command in (
        ["eval", "passkey", "--model", "m", "--lengths", "1k", "--out", "o"],
        ["eval", "niah", "--model", "m", "--lengths", "1k", "--out", "o"],
        ["eval", "perplexity", "--model", "m", "--lengths", "1k", "--out", "o"],
        ["eval", "ruler", "--model", "m", "--lengths", "1k", "--out", "o"],
        ["eval", "compare", "smoke", "--out", "o"],
        ["search", "--model", "m", "--factor", "2", "--out", "o"],
    ):
        for flag in ("--resume", "--overwrite"):
            assert getattr(parser.parse_args([*command, flag]), flag.strip("-"))
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--resume", "--overwrite"])


def test_version_and_help(capsys):
    import rope_extend

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"rope-extend {rope_extend.__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "long-context" in out


def test_patched_repr_names_the_scaling_not_function_addresses():
    model = tiny_model()
    rope_extend.patch(model, "yarn", factor=4)
    text = repr(rope_extend.patched(model))
    assert " at 0x" not in text and text.startswith("Scaling('yarn', factor=4") and "beta_fast=32" in text


def test_recipes_prints_bundled_paths_only(capsys):
    from rope_extend import resources

    assert main(["recipes", "tiny-cpu"]) == 0
    assert capsys.readouterr().out.strip() == str(resources.RECIPES / "tiny-cpu.yaml")
    assert main(["recipes", "accelerate/fsdp2.yaml"]) == 0
    assert capsys.readouterr().out.strip() == str(resources.RECIPES / "accelerate" / "fsdp2.yaml")
    assert main(["recipes", "smoke"]) == 0
    assert capsys.readouterr().out.strip() == str(resources.SUITES / "smoke.yaml")
    for name in ("../../../../etc/passwd", "../recipes/tiny-cpu", "data/../tiny-cpu", "/etc/passwd", "data"):
        assert main(["recipes", name]) == 2, name
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1
        assert "is not a shipped recipe" in captured.err and "allowed: " in captured.err and "tiny-cpu" in captured.err


def test_the_command_line_prints_logs_on_stderr_and_results_on_stdout(tmp_path):
    """Training imports DeepSpeed when it is installed, and DeepSpeed logs to stdout: a fresh process's stdout
    holds the command's own lines only (the summary, the result as JSON), DeepSpeed's warning goes to stderr."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "rope_extend", "train", "tiny-cpu", "max_steps=1", f"output_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and "trainable parameters" in lines[0] and json.loads(lines[1])["step"] == 1
