"""A LongRoPE2 search's factors, end to end on a tiny model: searched with the needle fitness in LongRoPE2's
space, exported from the command line (``--params-from`` the search's ``longrope.json``) to every engine that
reads LongRoPE, and audited against transformers: the engines compute the searched factors past L (the switch
at L is each engine's own, said in the export's notes and the audit's warnings). The mixed-window recipe's saved
config (the same factors with ``attention_factor: 1.0``) exports with that scale in each engine's own keys."""

import json
import math

import pytest

from rope_extend.cli import main
from rope_extend.factor_search import run as R
from tests.evaluation.conftest import make_text
from tests.tiny import tiny_model, tiny_tokenizer

L = 64  # the tiny model's trained length; x4 = 256 tokens, where RULER's prompt fits


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """``(model folder, search folder, result)``: a needle search in the longrope2 space, 3 evaluations."""
    root = tmp_path_factory.mktemp("searched")
    model, tok = tiny_model("llama", max_position_embeddings=L), tiny_tokenizer()
    texts = [make_text(40, seed=i) for i in range(2)]
    options = {"max_evaluations": 3, "population": 4, "progress": False, "fitness": "needle", "space": "longrope2"}
    result = R.search(model, tok, 4.0, texts, out=root / "search", **options)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return root / "model", root / "search", result


def run(*argv) -> int:
    return main([str(a) for a in argv])


def exported(folder, to, out, *extra):
    code = run("export", folder, "--to", to, "--out", out, "--approximate", "--json", *extra)
    assert code == 0
    return out


@pytest.mark.parametrize(("to", "engine"), [("vllm", "vllm"), ("sglang", "sglang"), ("transformers4", None)])
def test_searched_factors_export_and_audit_equal(searched, tmp_path, capsys, to, engine):
    model, search, result = searched
    assert result.objective == "needle" and result.critical == 6  # head dimension 16, base 10000, L 64
    out = exported(model, to, tmp_path / to, "--method", "longrope", "--params-from", search / "longrope.json")
    config = json.loads((out / "config.json").read_text())
    rope = config["rope_scaling" if to == "transformers4" else "rope_parameters"]
    assert rope["long_factor"] == result.long_factor and rope["short_factor"] == [1.0] * 8
    assert rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == L
    scale = math.sqrt(1 + math.log(4) / math.log(L))  # LongRoPE's, which the search used
    if to == "transformers4":
        assert rope["attention_factor"] == pytest.approx(scale) and config["original_max_position_embeddings"] == L
        reference = []  # the folder read by this transformers: nothing to compare; the numbers are asserted above
    else:
        assert rope["short_mscale"] == rope["long_mscale"] == pytest.approx(scale)
        reference = ["--engine", engine]
    capsys.readouterr()
    assert run("audit", out, *reference, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["result"] == ("equal" if engine else "unchecked")
    if engine:
        assert any("long factors for every sequence" in w for w in report["warnings"])


def test_searched_factors_to_gguf_audit_equal_to_transformers(searched, tmp_path, capsys):
    model, search, _ = searched
    t4 = exported(
        model, "transformers4", tmp_path / "t4", "--method", "longrope", "--params-from", search / "longrope.json"
    )
    gguf = exported(
        model, "gguf", tmp_path / "m.gguf", "--method", "longrope", "--params-from", search / "longrope.json",
        "--tokenizer-pre", "smollm",
    )  # fmt: skip
    capsys.readouterr()
    assert run("audit", gguf, "--reference", t4, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["result"] == "equal"
    assert any("llama.cpp uses the long factors for every sequence" in w for w in report["warnings"])


def test_the_mixed_recipes_config_exports_with_scale_1(searched, tmp_path, capsys):
    """The mixed-window recipe saves the searched factors with ``attention_factor: 1.0`` (so that within L the
    saved model is the original one); vLLM and SGLang read LongRoPE's scale only as short_mscale / long_mscale,
    so the export writes 1 there, and the audit finds the engine's scale equal to transformers'."""
    model, search, result = searched
    mixed = tmp_path / "mixed"
    args = ["--method", "longrope", "--params-from", search / "longrope.json", "--param", "attention_factor=1.0"]
    assert run("configure", model, "--out", mixed, *args) == 0
    for to in ("vllm", "sglang"):
        out = exported(mixed, to, tmp_path / to)  # the config's own scaling
        rope = json.loads((out / "config.json").read_text())["rope_parameters"]
        assert rope["short_mscale"] == rope["long_mscale"] == 1.0 and rope["long_factor"] == result.long_factor
        capsys.readouterr()
        assert run("audit", out, "--engine", to, "--reference", mixed, "--json") == 0
        assert json.loads(capsys.readouterr().out)["result"] == "equal"


def test_params_from_refusals(searched, tmp_path, capsys):
    model, search, _ = searched
    file = search / "longrope.json"
    cases = [
        (["--params-from", file], "--params-from given without a scaling method (--method is none)"),
        (["--method", "yarn", "--params-from", file], "holds parameters of rope_type 'longrope', not of method 'yarn'"),
        (
            ["--method", "longrope", "--factor", "2", "--params-from", file],
            "was made for factor 4, but the method asks",
        ),
        (["--method", "longrope", "--params-from", tmp_path / "none.json"], "no such file"),
    ]
    for extra, said in cases:
        capsys.readouterr()
        assert run("export", model, "--to", "vllm", "--out", tmp_path / "x", "--approximate", *extra) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()
