"""The core subcommands of `rope-extend`."""

import json

import pytest
import transformers as T

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
