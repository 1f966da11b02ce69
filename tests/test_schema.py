"""YAML as rope-extend reads it (schema.load_yaml): safe_load's objects, YAML 1.2's floats."""

import pytest
import yaml

from rope_extend.arguments import parse_params
from rope_extend.errors import RopeExtendError
from rope_extend.scaling import ScalingSpec
from rope_extend.schema import load_yaml, parse_overrides, parse_value, read_yaml


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1e-3", 0.001),  # a string in YAML 1.1
        ("1.0e-3", 0.001),
        ("-2E5", -200000.0),
        ("+1e+2", 100.0),
        (".5e-3", 0.0005),
        ("1.5", 1.5),
        ("3", 3),
        ("1_000", 1000),
        (".inf", float("inf")),
        ("1e", "1e"),  # no digits after the exponent: a string, as before
        ("e5", "e5"),
        ("1e-3x", "1e-3x"),
        ("'1e-3'", "1e-3"),  # quoted: a string
        ("true", True),
    ],
)
def test_load_yaml_reads_an_exponent_without_a_dot_as_a_float(text, value):
    got = load_yaml(text)
    assert got == value and type(got) is type(value)
    assert parse_value(text) == value


def test_load_yaml_still_refuses_python_tags():
    with pytest.raises(yaml.YAMLError):
        load_yaml("!!python/object/apply:os.system ['true']")
    assert yaml.safe_load("1e-3") == "1e-3"  # PyYAML's own loader is left as it is


def test_param_set_and_files_read_1e_3_as_a_number(tmp_path):
    assert parse_params(["temperature=1e-3", "attention_factor=1.0e-3"]) == {
        "temperature": 0.001,
        "attention_factor": 0.001,
    }
    spec = ScalingSpec(method="dual_chunk", factor=4.0, params=parse_params(["temperature=1e-3"])).check()
    assert spec.params == {"temperature": 0.001}
    assert parse_overrides(["passkey.x=1e-3", "y=2e2"]) == {"passkey": {"x": 0.001}, "y": 200.0}
    path = tmp_path / "suite.yaml"
    path.write_text("methods:\n  - {method: dual_chunk, factor: 4, params: {temperature: 1e-3}}\nlr: 1.0e-3\n")
    assert read_yaml(path) == {
        "methods": [{"method": "dual_chunk", "factor": 4, "params": {"temperature": 0.001}}],
        "lr": 0.001,
    }


def test_a_string_temperature_is_still_refused():
    with pytest.raises(RopeExtendError, match="temperature"):
        ScalingSpec(method="dual_chunk", factor=4.0, params={"temperature": "1e-3"}).check()
