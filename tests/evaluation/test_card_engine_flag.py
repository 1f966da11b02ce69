"""``card --engine`` takes an optional value: the word after it is an engine or it is refused, never read as
one (``rope_extend.schema._FlagOrChoice``). Runs nothing: the refusals come while the command line is read."""

from __future__ import annotations

import pytest

from rope_extend.cli import build_parser, main

HOW = "--engine without a value goes after the positional arguments or before another option"


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["card", "bundled", "--engine", "--out", "o"], True),  # bare, before another option
        (["card", "bundled", "--out", "o", "--engine"], True),  # bare, at the end
        (["card", "--out", "o", "bundled", "--engine"], True),
        (["card", "bundled", "--engine", "llama.cpp", "--out", "o"], "llama.cpp"),
        (["card", "bundled", "--engine", "vllm", "--out", "o"], "vllm"),
        (["card", "bundled", "--no-engine", "--out", "o"], False),
    ],
)
def test_the_engine_flag_reads_as_written(argv, want):
    args = build_parser().parse_args(argv)
    assert args.model == "bundled" and args.engine == want


@pytest.mark.parametrize(
    ("argv", "word"),
    [
        (["card", "--engine", "bundled", "--method", "yarn", "--factor", "4"], "bundled"),  # the model after it
        (["card", "bundled", "--engine", "vlm"], "vlm"),  # a misspelt engine
        (["card", "bundled", "--engine", "sglang"], "sglang"),  # an engine card does not measure in
    ],
)
def test_a_word_after_engine_that_is_no_engine_is_refused_in_one_line(tmp_path, capsys, argv, word):
    out = tmp_path / "card"
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rope-extend: error: ")
    assert f"--engine takes llama.cpp or vllm, not {word!r}; {HOW} (rope-extend card MODEL --engine ...)" in err
    assert "or name one (--engine llama.cpp)" in err
    assert not out.exists()


def test_the_help_shows_no_engine_without_a_value_and_a_value_after_it_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["card", "--help"])
    shown = capsys.readouterr().out
    assert "[--engine [{llama.cpp,vllm}]] [--no-engine]" in shown
    assert "  --no-engine           turn --engine off" in shown and "--no-engine [" not in shown
    with pytest.raises(SystemExit) as refused:  # argparse's own refusal
        main(["card", "bundled", "--no-engine", "vllm", "--out", "o"])
    assert refused.value.code == 2
    assert "unrecognized arguments: vllm" in capsys.readouterr().err
