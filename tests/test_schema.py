"""YAML as rope-extend reads it (schema.load_yaml): safe_load's objects, YAML 1.2's floats."""

import pytest
import yaml

from rope_extend.arguments import parse_params
from rope_extend.errors import RopeExtendError
from rope_extend.scaling import ScalingRequest
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
    spec = ScalingRequest(method="dual_chunk", factor=4.0, params=parse_params(["temperature=1e-3"])).check()
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
        ScalingRequest(method="dual_chunk", factor=4.0, params={"temperature": "1e-3"}).check()


# ------------------------------------------------------------------------------ hostile YAML: one line, bounded
def _recipe(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "key", "lines"),
    [
        ("max_steps: 10\nlearning_rate: 1e-4\nmax_steps: 20\n", "'max_steps'", (1, 3)),
        ("rope:\n  method: yarn\n  factor: 4\n  factor: 8\n", "'factor'", (3, 4)),  # inside a section
        ("methods:\n  - {method: none}\n  - {method: yarn, factor: 2, factor: 4}\n", "'factor'", (3, 3)),
        ("a:\n  b:\n    c:\n      d: 1\n      'd': 2\n", "'d'", (4, 5)),  # quoted or not, the same key
        ("1: one\n1.0: two\n", "1.0", (1, 2)),  # equal keys once read
        ("k: &k max_steps\nrun: {*k : 1, *k : 2}\n", "'max_steps'", (1, 1)),  # one key node, by alias, twice
    ],
)
def test_a_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path, text, key, lines):
    with pytest.raises(RopeExtendError) as info:
        read_yaml(_recipe(tmp_path, text), what="recipe")
    message = str(info.value)
    assert f"the key {key} is given twice in one mapping (line {lines[0]} and line {lines[1]}): give it once" in message
    assert message.count("\n") == 0 and message.startswith(f"recipe {tmp_path / 'recipe.yaml'}: ")
    with pytest.raises(yaml.YAMLError):
        load_yaml(text)


def test_a_recipe_with_max_steps_twice_is_refused_not_trained_with_the_second(tmp_path, capsys):
    from rope_extend.cli import main

    path = _recipe(tmp_path, "model: bundled\nmax_steps: 10\nmax_steps: 2000\n")
    assert main(["train", str(path), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "the key 'max_steps' is given twice in one mapping (line 2 and line 3)" in err


def test_a_merged_key_given_again_is_not_a_duplicate():
    text = "base: &b {trials: 2, seed: 0}\npasskey: {<<: *b, trials: 5}\nother: {<<: *b}\n"
    assert load_yaml(text) == {
        "base": {"trials": 2, "seed": 0},
        "passkey": {"trials": 5, "seed": 0},
        "other": {"trials": 2, "seed": 0},
    }


def test_deep_nesting_is_refused_in_one_line(tmp_path):
    for text in ("[" * 20_000 + "]" * 20_000, "x: " + "{a: " * 20_000 + "1" + "}" * 20_000):
        with pytest.raises(RopeExtendError, match=r"^recipe \S+: values nest deeper than 64 levels \(line 1, column"):
            read_yaml(_recipe(tmp_path, text), what="recipe")
    block = "".join(" " * i + f"k{i}:\n" for i in range(1000)) + " " * 1000 + "v\n"  # 1000 levels, 0.5 MB
    with pytest.raises(RopeExtendError, match=r"values nest deeper than 64 levels \(line 64, column 64\)"):
        read_yaml(_recipe(tmp_path, block))
    with pytest.raises(RopeExtendError, match=r"^passkey\.trials: cannot read '\[\[\[.*values nest deeper than 64"):
        parse_overrides(["passkey.trials=" + "[" * 20_000])
    assert load_yaml("[" * 63 + "]" * 63) is not None  # 63 levels are read


BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
)  # i stands for 10^9 x's


def test_an_alias_bomb_is_refused_before_it_is_expanded(tmp_path):
    from rope_extend.evaluation.suite import load_suite

    path = _recipe(tmp_path, BOMB + "model: bundled\nmethods: *i\n")
    with pytest.raises(RopeExtendError) as info:
        load_suite(path)
    message = str(info.value)
    assert "aliases (*name) repeat more than 100000 characters in this document" in message
    assert len(message) < 400 and message.count("\n") == 0
    # ten thousand aliases of one long string: few values, gigabytes of text once printed
    long = "s: &s " + "y" * 10_000 + "\nt: [" + ", ".join(["*s"] * 10_000) + "]\n"
    with pytest.raises(yaml.YAMLError, match="repeat more than 100000 characters"):
        load_yaml(long)


def test_aliases_within_the_bound_and_a_value_that_contains_itself():
    assert load_yaml("a: &a [1, 2]\nb: [*a, *a]\n") == {"a": [1, 2], "b": [[1, 2], [1, 2]]}
    with pytest.raises(yaml.YAMLError, match="an alias inside the value it names"):
        load_yaml("a: &a [1, *a]\n")


def test_an_error_about_a_huge_value_prints_a_bounded_part_of_it():
    """A value that stands for 10^9 items (shared, as aliases make them) in a typed key: the message shows its
    first items, at once."""
    from dataclasses import dataclass

    from rope_extend.schema import build, option

    huge: list = ["x"] * 10
    for _ in range(8):
        huge = [huge] * 10

    @dataclass
    class Args:
        max_steps: int = option(10, help="steps")

    with pytest.raises(RopeExtendError) as info:
        build(Args, {"max_steps": huge, **{f"unknown{i}": i for i in range(1000)}}, where="recipe r.yaml")
    message = str(info.value)
    assert message.startswith("recipe r.yaml: 1001 problems: (1) max_steps: got [[[[...], [...], [...]")
    assert message.endswith("(and 993 more)") and len(message) < 4000
    with pytest.raises(RopeExtendError, match=r"^recipe r\.yaml: the top level must be a mapping") as info:
        build(Args, huge, where="recipe r.yaml")
    assert len(str(info.value)) < 400


def test_a_yaml_file_larger_than_any_recipe_is_refused_unread(tmp_path, monkeypatch):
    from rope_extend import yaml_loader

    monkeypatch.setattr(yaml_loader, "MAX_BYTES", 1000)
    with pytest.raises(RopeExtendError, match=r"^suite \S+ is larger than"):
        read_yaml(_recipe(tmp_path, "a: 1\n" * 300), what="suite")


def test_every_shipped_recipe_suite_and_launcher_loads():
    from rope_extend import resources
    from rope_extend.evaluation.suite import load_suite
    from rope_extend.training.args import load_args

    recipes = sorted(resources.RECIPES.glob("*.yaml"))
    suites = sorted(resources.SUITES.glob("*.yaml"))
    launchers = sorted((resources.RECIPES / "accelerate").glob("*.yaml"))
    assert len(recipes) >= 10 and len(suites) >= 10 and len(launchers) >= 4
    for path in recipes:
        assert load_args(path).max_steps >= 0
    for path in suites:
        assert load_suite(path).methods
    for path in launchers:
        assert isinstance(read_yaml(path), dict)


def test_an_integer_past_4300_digits_is_one_line_wherever_yaml_is_read(tmp_path, capsys):
    """``int`` refuses more than 4300 digits with a ValueError, which is no ``yaml.YAMLError``: a recipe, a suite
    or a ``--set`` value holding one was a traceback."""
    from rope_extend.cli import main

    digits = "1" * 5000
    with pytest.raises(yaml.YAMLError, match="an integer of 5000 digits"):
        load_yaml(f"max_steps: {digits}")
    with pytest.raises(RopeExtendError, match=r"^max_steps: cannot read '1111.*an integer of 5000 digits"):
        parse_overrides([f"max_steps={digits}"])
    recipe = _recipe(tmp_path, f"max_steps: {digits}\n")
    for argv in (["train", str(recipe), "--check"], ["train", "tiny-cpu", f"max_steps={digits}", "--check"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "an integer of 5000 digits: more than any value rope-extend reads" in err


def test_a_named_pipe_or_a_folder_is_refused_at_once_not_called_missing(tmp_path):
    """read_yaml reads through ``untrusted``: a named pipe is refused without waiting for a writer (it was called
    'no such file'); a link to a recipe is a user's input and is read."""
    import os

    pipe = tmp_path / "pipe.yaml"
    os.mkfifo(pipe)
    with pytest.raises(RopeExtendError, match=r"^recipe \S+pipe\.yaml is a named pipe, not a regular file: a recipe"):
        read_yaml(pipe, what="recipe")
    with pytest.raises(RopeExtendError, match=r"^suite \S+ is a folder, not a file: a suite is a few kB of YAML$"):
        read_yaml(tmp_path, what="suite")
    link = tmp_path / "link.yaml"
    link.symlink_to(_recipe(tmp_path, "a: 1\n"))
    assert read_yaml(link) == {"a": 1}
    with pytest.raises(RopeExtendError, match=r"link\.yaml is a symbolic link: rope-extend never reads a file it"):
        read_yaml(link, follow_links=False)
    with pytest.raises(RopeExtendError, match=r"^recipe '\S+nowhere\.yaml': no such file$"):
        read_yaml(tmp_path / "nowhere.yaml", what="recipe")
