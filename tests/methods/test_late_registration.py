"""A method registered after ``import rope_extend`` reaches transformers at once (issue: registration that
always reaches transformers): its config validates, builds, saves and reloads, from Python and the CLI."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers import modeling_rope_utils as mru

import rope_extend
from rope_extend.methods import registry
from rope_extend.methods._common import Geometry, Method, rope_frequencies
from tests.tiny import tiny_model


@dataclass(frozen=True)
class HalfParams:
    """``share``: the fraction of the frequencies (the fastest first) left unscaled."""

    share: float = 0.25


def half_interpolation(params: HalfParams, geo: Geometry, factor: float, seq_len):
    """Toy method: the fastest ``share`` of the frequencies as is, the rest divided by ``s``."""
    theta = rope_frequencies(geo.dim, geo.base)
    keep = int(len(theta) * params.share)
    return torch.cat([theta[:keep], theta[keep:] / factor]), 1.0


TOY = Method("toy_half", HalfParams, half_interpolation, rope_type="toy_half", source="a test")


@pytest.fixture
def toy():
    registry.register(TOY)
    yield TOY
    registry.unregister(TOY.name)  # its rope types leave transformers too (hf.unregister)


def test_a_method_registered_late_is_patched_configured_saved_and_reloaded(toy, tmp_path):
    assert "toy_half" in mru.ROPE_INIT_FUNCTIONS
    model = tiny_model()
    ids = torch.randint(3, 500, (1, 300))  # past the original 256
    rope_extend.patch(model, "toy_half", factor=2, share=0.5)
    with torch.no_grad():
        patched = model(ids).logits
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())["rope_parameters"]
    assert saved["rope_type"] == "toy_half" and saved["share"] == 0.5
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, patched, atol=1e-5, rtol=0)
    with pytest.raises(Exception, match="share"):  # its parameters are validated like the built-in methods'
        rope_extend.patch(model, "toy_half", factor=2, shares=0.5)


def test_a_method_registered_late_works_from_the_cli(toy, tmp_path, capsys):
    from rope_extend.cli import main

    tiny_model().save_pretrained(tmp_path / "m")
    code = main(["configure", str(tmp_path / "m"), "--out", str(tmp_path / "o"), "--method", "toy_half",
                 "--factor", "4", "--param", "share=0.5"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "toy_half" and config["max_position_embeddings"] == 1024
    AutoModelForCausalLM.from_pretrained(tmp_path / "o")


def test_an_unregistered_method_leaves_transformers(toy):
    """Unregistering undoes what registering installed: the rope types and validators are gone, so a config
    naming the type no longer builds a model (before, it validated and then failed inside rope-extend)."""
    mixin = mru.RotaryEmbeddingConfigMixin
    installed = ("toy_half", "proportional_toy_half")
    assert all(t in mru.ROPE_INIT_FUNCTIONS and hasattr(mixin, f"_validate_{t}_rope_parameters") for t in installed)
    assert registry.unregister("toy_half") is TOY
    try:
        assert not any(t in mru.ROPE_INIT_FUNCTIONS for t in installed)
        assert not any(hasattr(mixin, f"_validate_{t}_rope_parameters") for t in installed)
        config = tiny_model().config
        config.rope_parameters = {**config.rope_parameters, "rope_type": "toy_half", "factor": 2.0}
        with pytest.raises(KeyError, match="toy_half"):
            AutoModelForCausalLM.from_config(config)
        assert registry.unregister("toy_half") is None  # nothing left to undo
    finally:
        registry.register(TOY)  # for the fixture's teardown; installed again
    assert all(t in mru.ROPE_INIT_FUNCTIONS for t in installed)


def test_unregistering_a_method_keeps_transformers_own_rope_type():
    """A method on transformers' own ``dynamic`` (``in_transformers``) installs only ``proportional_dynamic``;
    unregistering it takes that out and leaves transformers' ``dynamic`` where it is."""
    own = mru.ROPE_INIT_FUNCTIONS["dynamic"]
    on_dynamic = Method("toy_dynamic", HalfParams, half_interpolation, rope_type="dynamic", in_transformers=True)
    registry.register(on_dynamic)
    try:
        assert mru.ROPE_INIT_FUNCTIONS["dynamic"] is own and "proportional_dynamic" in mru.ROPE_INIT_FUNCTIONS
    finally:
        registry.unregister("toy_dynamic")
    assert mru.ROPE_INIT_FUNCTIONS["dynamic"] is own and "proportional_dynamic" not in mru.ROPE_INIT_FUNCTIONS
    assert hasattr(mru.RotaryEmbeddingConfigMixin, "_validate_dynamic_rope_parameters")  # transformers' own


def test_a_method_whose_rope_type_transformers_owns_is_not_registered():
    """transformers' own ``dynamic`` (rope-extend's is ``dynamic_ntk``) is never replaced: all or nothing."""
    assert "dynamic" in mru.ROPE_INIT_FUNCTIONS and registry.by_rope_type("dynamic") is None
    own = mru.ROPE_INIT_FUNCTIONS["dynamic"]
    clash = Method("clash", HalfParams, half_interpolation, rope_type="dynamic")
    with pytest.raises(rope_extend.RopeExtendError, match="transformers already defines rope_type 'dynamic'"):
        registry.register(clash)
    assert "clash" not in registry.names() and mru.ROPE_INIT_FUNCTIONS["dynamic"] is own
    assert "proportional_dynamic" not in mru.ROPE_INIT_FUNCTIONS


def test_a_method_registered_late_is_a_suite_method(toy, tmp_path):
    """The same one definition is enough for a suite: a run labelled by it, its records and its report."""
    from rope_extend.evaluation.compare import run_suite
    from rope_extend.evaluation.suite import parse_suite
    from tests.tiny import tiny_tokenizer

    methods = [{"method": "none"}, {"method": "toy_half", "factor": 2, "params": {"share": 0.5}}]
    suite = parse_suite({"model": "unused", "methods": methods, "perplexity": {"lengths": [128, 384], "max_docs": 1}})
    result = run_suite(suite, out=tmp_path / "o", model=tiny_model(), tokenizer=tiny_tokenizer(), progress=False)
    toy_rows = [r for r in result["records"] if r["label"] == "toy_half x2"]
    assert [r["length"] for r in toy_rows] == [128, 384] and all(r["params"] == {"share": 0.5} for r in toy_rows)
    assert "toy_half x2" in (tmp_path / "o" / "report.md").read_text()
    with pytest.raises(Exception, match="share"):
        parse_suite({"model": "m", "methods": [{"method": "toy_half", "factor": 2, "params": {"shares": 1}}],
                     "perplexity": {"lengths": [128]}})  # fmt: skip
