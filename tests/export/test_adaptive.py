"""Length-adaptive dynamic_yarn for vLLM, the parts that need no engine: buckets, the segment a request gets,
the table and its offsets, the prefix-cache salt, the plugin's two wrappers run on stand-ins of vLLM's objects,
and the exported folder (the engine itself: test_vllm_adaptive.py)."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
import transformers as T

import rope_extend
from rope_extend.errors import RopeExtendError, UnsupportedModelError
from rope_extend.export import adaptive, export, routes, vllm_plugin
from rope_extend.methods import registry
from rope_extend.methods._common import rope_frequencies
from tests.tiny import tiny_model, tiny_tokenizer

LAYOUT = adaptive.BucketLayout.of(1024, (2, 4))


def test_default_buckets_are_powers_of_two_then_the_factor():
    assert adaptive.default_buckets(8) == (2.0, 4.0, 8.0)
    assert adaptive.default_buckets(3) == (2.0, 3.0)
    assert adaptive.default_buckets(2) == (2.0,)
    assert adaptive.check_buckets("8, 2,4", 8.0) == (2.0, 4.0, 8.0)


@pytest.mark.parametrize(
    ("buckets", "match"), [("1,4", "above 1"), ("2,4", "largest bucket must be the factor 8"), ("a", "comma")]
)
def test_bad_buckets(buckets, match):
    with pytest.raises(RopeExtendError, match=match):
        adaptive.check_buckets(buckets, 8.0)


def test_segments_lengths_and_offsets():
    assert LAYOUT.factors == (1.0, 2.0, 4.0)
    assert LAYOUT.lengths == (1024, 2048, 4096) and LAYOUT.offsets == (0, 1024, 3072) and LAYOUT.rows == 7168
    assert [LAYOUT.segment(n) for n in (1, 1024, 1025, 2048, 2049, 4096)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(RopeExtendError, match="longer than the longest bucket"):
        LAYOUT.segment(4097)
    assert adaptive.BucketLayout.from_config(LAYOUT.as_config()) == LAYOUT


def test_a_request_needs_the_positions_it_feeds():
    # prompt + max_tokens - 1: the last token sampled is never fed back
    assert adaptive.need(1000, 24, 4096) == 1023
    assert adaptive.need(1000, 25, 4096) == 1024
    assert adaptive.need(1000, 26, 4096) == 1025
    assert adaptive.need(1000, None, 4096) == 4095  # without max_tokens vLLM lets it grow to max_model_len
    assert adaptive.need(4000, 500, 4096) == 4095  # stopped at max_model_len, whose last token is not fed either
    assert adaptive.need(1000, 0, 4096) == 1000  # the prompt is always fed whole


@pytest.mark.parametrize(
    ("prompt", "segment"),
    [(1023, 0), (1024, 0), (1025, 1), (2047, 1), (2048, 1), (2049, 2), (4096, 2)],
)
def test_pure_scoring_at_each_bucket_edge(prompt, segment):
    """A prompt of exactly L (2L) tokens scored with max_tokens=1 is fed L (2L) positions: plain RoPE (x2), as
    transformers' dynamic_yarn on those tokens; one token more is the next bucket."""
    assert vllm_plugin.request_segment(LAYOUT, prompt, 1, LAYOUT.longest) == segment
    runner = _runner({"a": (prompt, 1)}, None)
    positions = torch.arange(prompt)  # the prefill: every position the request will ever feed
    vllm_plugin.shift_positions(runner, LAYOUT, SimpleNamespace(num_scheduled_tokens={"a": prompt}), positions)
    assert positions.tolist() == list(range(LAYOUT.offsets[segment], LAYOUT.offsets[segment] + prompt))


def test_factor_one_names_the_factor_not_the_buckets():
    for buckets in (None, "2", "1,2"):
        with pytest.raises(RopeExtendError, match="needs a factor above 1, got 1: ") as caught:
            adaptive.check_buckets(buckets, 1.0)
        assert "bucket" not in str(caught.value)
    with pytest.raises(RopeExtendError, match="needs a factor above 1, got nan"):
        adaptive.check_buckets(None, float("nan"))


def test_factor_one_through_the_command_line(tmp_path, capsys):
    from rope_extend.cli import main

    folder = _saved(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    for extra in ([], ["--buckets", "2"]):
        capsys.readouterr()
        args = ["export", str(folder), "--to", "vllm", "--method", "dynamic_yarn", "--factor", "1"]
        assert main([*args, "--out", str(tmp_path / "out"), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "needs a factor above 1, got 1" in err and "bucket" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_offsets_per_token_follow_the_batch_order():
    got = adaptive.offsets_per_token(LAYOUT, [0, 2, 1], [2, 1, 3])
    assert got.tolist() == [0, 0, 3072, 1024, 1024, 1024]


def test_salts_differ_per_factor_and_cannot_be_forged():
    salts = {adaptive.salt(LAYOUT, k, None) for k in range(3)}
    assert len(salts) == 3
    # a plain request whose own salt spells a factor's salt still gets another salt than that factor's requests
    forged = adaptive.salt(LAYOUT, 1, None)
    assert adaptive.salt(LAYOUT, 0, forged) != forged
    assert adaptive.salt(LAYOUT, 2, "user") == "rope-extend yarn x4|user"


def test_table_segments_are_plain_rope_and_yarn_at_each_bucket():
    dim, base = 64, 100000.0
    method = adaptive.scaling(LAYOUT, {"beta_fast": 32.0, "beta_slow": 1.0})
    table = adaptive.table(LAYOUT, method, dim, base)
    assert table.shape == (LAYOUT.rows, dim)
    expected = [(rope_frequencies(dim, base), 1.0)]
    for s in (2.0, 4.0):
        yarn = registry.resolve(registry.get("yarn"), factor=s, original_max_position_embeddings=1024, params={})
        expected.append(yarn.compute(dim, base))
    for k, (freqs, scale) in enumerate(expected):
        rows = table[LAYOUT.offsets[k] : LAYOUT.offsets[k] + LAYOUT.lengths[k]]
        angles = torch.arange(LAYOUT.lengths[k], dtype=torch.float32)[:, None] * freqs[None, :]
        torch.testing.assert_close(rows, torch.cat((angles.cos() * scale, angles.sin() * scale), -1), rtol=0, atol=0)
    assert expected[2][1] == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)


def test_finetuned_dynamic_yarn_is_static_yarn_not_adaptive():
    with pytest.raises(RopeExtendError, match="finetuned"):
        adaptive.scaling(LAYOUT, {"finetuned": True})


# ------------------------------------------------------------------------- the plugin, on stand-ins of vLLM
def _config(layout=LAYOUT):
    hf = SimpleNamespace(**{adaptive.CONFIG_KEY: {**layout.as_config(), "architecture": "LlamaForCausalLM"}})
    return SimpleNamespace(hf_config=hf, max_model_len=layout.longest)


def _request(prompt, max_tokens, salt=None, resumable=False):
    return SimpleNamespace(
        prompt_token_ids=list(range(prompt)),
        prompt_embeds=None,
        sampling_params=SimpleNamespace(max_tokens=max_tokens),
        cache_salt=salt,
        resumable=resumable,
    )


def test_admission_salts_each_request_with_its_factor():
    config = SimpleNamespace(model_config=_config())
    requests = [_request(1000, 25), _request(1000, 26, salt="tenant"), _request(3000, None), _request(1024, 1)]
    for r in requests:
        vllm_plugin.salt_request(config, r)
    assert [r.cache_salt for r in requests] == [
        "rope-extend yarn x1|",
        "rope-extend yarn x2|tenant",
        "rope-extend yarn x4|",
        "rope-extend yarn x1|",  # L tokens scored: L positions fed
    ]
    with pytest.raises(ValueError, match="streaming-input session"):
        vllm_plugin.salt_request(config, _request(10, 5, resumable=True))
    other = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(), max_model_len=4096))
    untouched = _request(1000, 24, salt="tenant")
    vllm_plugin.salt_request(other, untouched)  # any other model: nothing changes
    assert untouched.cache_salt == "tenant"


def _runner(requests, computed):
    states = {
        rid: SimpleNamespace(
            prompt_token_ids=list(range(p)), prompt_embeds=None, sampling_params=SimpleNamespace(max_tokens=m)
        )
        for rid, (p, m) in requests.items()
    }
    return SimpleNamespace(
        requests=states,
        input_batch=SimpleNamespace(req_ids=list(requests), num_computed_tokens_cpu=computed),
        model_config=_config(),
    )


def test_each_token_gets_its_requests_offset():
    # a: plain (prompt 500 + 8); b: x4 (3000 + 100), a decode step at position 3050; c: x2 (1500 + 8), a chunk
    runner = _runner({"a": (500, 8), "b": (3000, 100), "c": (1500, 8)}, None)
    scheduled = SimpleNamespace(num_scheduled_tokens={"a": 3, "b": 1, "c": 2})
    positions = torch.tensor([0, 1, 2, 3050, 700, 701, 0, 0])  # two padding tokens after the six scheduled
    vllm_plugin.shift_positions(runner, LAYOUT, scheduled, positions)
    assert positions.tolist() == [0, 1, 2, 3050 + 3072, 700 + 1024, 701 + 1024, 0, 0]
    assert [runner.requests[r].rope_extend_segment for r in "abc"] == [0, 2, 1]


def test_a_position_past_its_bucket_is_refused():
    runner = _runner({"a": (500, 8)}, None)
    with pytest.raises(RuntimeError, match="past its request's bucket"):
        vllm_plugin.shift_positions(
            runner, LAYOUT, SimpleNamespace(num_scheduled_tokens={"a": 1}), torch.tensor([1024])
        )


# ------------------------------------------------------------------------------------------- the export
def _saved(tmp_path, family="llama"):
    folder = tmp_path / "model"
    tiny_model(family).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_route_is_exported_and_static_needs_approximate():
    scaling = registry.resolve(
        registry.get("dynamic_yarn"), factor=4.0, original_max_position_embeddings=256, params={}
    )
    decision = routes.decide(scaling, "vllm", 64, 10000.0)
    assert decision.status == routes.EXPORTED and decision.adaptive and decision.form.changes
    assert routes.decide(scaling, "sglang", 64, 10000.0).status == routes.APPROXIMATE


def test_export_writes_the_plugins_folder(tmp_path):
    folder = _saved(tmp_path)
    result = export(
        str(folder), "vllm", tmp_path / "a", method="dynamic_yarn", factor=8, original_max_position_embeddings=64
    )
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == ["RopeExtendAdaptiveLlamaForCausalLM"]
    assert config["max_position_embeddings"] == 64  # vLLM serves 64 x factor 8 for this rope type
    assert config["rope_parameters"]["rope_type"] == "dynamic_yarn" and config["rope_parameters"]["factor"] == 8.0
    assert config[adaptive.CONFIG_KEY] == {
        "original_max_position_embeddings": 64,
        "buckets": [2.0, 4.0, 8.0],
        "architecture": "LlamaForCausalLM",
    }
    assert result.command.endswith("--max-model-len 512 --dtype float32") and "x2, x4, x8" in result.how
    assert not any("VLLM_ALLOW_LONG_MAX_MODEL_LEN" in n for n in result.notes)
    # the record and the notes name the release the plugin runs on, not the source the static rules were read from
    info = json.loads((tmp_path / "a" / "rope-extend-export.json").read_text())
    assert result.engine == info["engine"] == "vllm 0.32.0 with rope-extend's plugin"
    assert info["notes"] == result.notes and "serve with vLLM 0.32.0" in result.notes[0]
    assert "0.33" not in json.dumps(info)
    # what the plugin serves against transformers, with this layout's numbers: the same up to L positions; at the
    # bucket edges yarn at the bucket, where the patched model's grid runs it a little higher
    edge = result.notes[3]
    assert "prompt + max_tokens - 1" in edge and "the same model up to L=64 positions" in edge
    assert "(128 tokens, 256 tokens, 512 tokens) this serves yarn at x2, x4, x8" in edge
    assert edge.endswith("runs yarn at x2.047, x4.094, x8.078")  # 131, 262 and 517 tokens over 64
    # transformers with rope-extend reads the folder as rope-extend's dynamic_yarn (plain transformers refuses it)
    model = tiny_model("llama").eval()
    reloaded = T.AutoModelForCausalLM.from_pretrained(tmp_path / "a").eval()
    ids = torch.randint(3, 500, (1, 100))
    with torch.no_grad():
        inside = model(ids[:, :40]).logits
        rope_extend.patch(model, "dynamic_yarn", factor=8, original_max_position_embeddings=64)
        torch.testing.assert_close(reloaded(ids[:, :40]).logits, inside, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_export_buckets_and_the_static_fallback(tmp_path):
    folder = _saved(tmp_path)
    export(
        str(folder),
        "vllm",
        tmp_path / "b",
        method="dynamic_yarn",
        factor=8,
        original_max_position_embeddings=64,
        buckets="4,8",
    )
    assert json.loads((tmp_path / "b" / "config.json").read_text())[adaptive.CONFIG_KEY]["buckets"] == [4.0, 8.0]
    static = export(
        str(folder),
        "vllm",
        tmp_path / "s",
        method="dynamic_yarn",
        factor=8,
        original_max_position_embeddings=64,
        approximate=True,
    )
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["architectures"] == ["LlamaForCausalLM"]
    assert "made static" in static.notes[0]
    with pytest.raises(RopeExtendError, match="buckets goes with dynamic_yarn"):
        export(str(folder), "vllm", tmp_path / "c", method="yarn", factor=8, buckets="2,8")


def test_export_refuses_what_the_plugin_does_not_serve(tmp_path):
    with pytest.raises(UnsupportedModelError, match="built for LlamaForCausalLM.*Gemma3ForCausalLM.*Phi3ForCausalLM"):
        export(str(_saved(tmp_path / "p", "phi3")), "vllm", tmp_path / "p2", method="dynamic_yarn", factor=4)
    model = tiny_model("llama")
    model.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match="ships linear scaling"):
        export(model, "vllm", tmp_path / "l", method="dynamic_yarn", factor=4)
    gemma = tiny_model("gemma3")  # Gemma 3 4B and up ship linear x8 on their global layers
    gemma.config.rope_parameters["full_attention"].update(rope_type="linear", factor=8.0)
    with pytest.raises(UnsupportedModelError, match="ships linear scaling"):
        export(gemma, "vllm", tmp_path / "g", method="dynamic_yarn", factor=4)
    assert not any((tmp_path / n).exists() for n in ("p2", "l", "g"))


@pytest.mark.parametrize(
    ("family", "change", "match"),
    [
        ("mistral", {"llama_4_scaling": {"beta": 0.1}}, "scales each query by its position"),
        ("qwen2", {"dual_chunk_attention_config": {"chunk_size": 64}}, "Dual Chunk Attention"),
        ("qwen3", {"use_sliding_window": True}, "sliding-window layers .use_sliding_window. were not checked"),
        (
            "gemma3",
            {"layer_types": ["sliding_attention", "full_attention", "chunked_attention", "full_attention"]},
            "layer types .'chunked_attention'.",
        ),
    ],
)
def test_what_cannot_be_served_exactly_is_refused_at_export(tmp_path, family, change, match):
    """The plugin shifts the positions vLLM's model is handed: whatever else reads them, or was never run through
    the plugin, is refused before anything is written (and again by the model class, as vLLM loads it)."""
    model = tiny_model(family)
    for key, value in change.items():
        setattr(model.config, key, value)
    with pytest.raises(UnsupportedModelError, match=f"cannot serve this .*ForCausalLM exactly: .*{match}"):
        export(model, "vllm", tmp_path / "x", method="dynamic_yarn", factor=4)
    assert not (tmp_path / "x").exists()
    with pytest.raises(UnsupportedModelError, match=match):
        adaptive.check_config(model.config, type(model).__name__)


def test_gemma3_scales_its_global_layers_only(tmp_path):
    """Gemma 3's folder: the global layers' rope dict is dynamic_yarn, the sliding layers' dict is kept (their
    own base, unscaled); max_position_embeddings is the longest bucket (vLLM multiplies no Gemma 3 length by a
    factor); transformers with rope-extend reads it as the patched model. Static exports of it are refused (the
    folder target writes one flat dict)."""
    model = tiny_model("gemma3").eval()
    result = export(model, "vllm", tmp_path / "g", method="dynamic_yarn", factor=4)
    config = json.loads((tmp_path / "g" / "config.json").read_text())
    assert config["architectures"] == ["RopeExtendAdaptiveGemma3ForCausalLM"]
    assert config["max_position_embeddings"] == 1024 and result.command.endswith("--max-model-len 1024 --dtype float32")
    rope = config["rope_parameters"]
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert rope["full_attention"]["rope_type"] == "dynamic_yarn" and rope["full_attention"]["rope_theta"] == 1e6
    reloaded = T.AutoModelForCausalLM.from_pretrained(tmp_path / "g").eval()
    ids = torch.randint(3, 500, (1, 700))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids[:, :200]).logits, model(ids[:, :200]).logits, rtol=1e-5, atol=1e-5)
        rope_extend.patch(model, "dynamic_yarn", factor=4)
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    for method, approximate in (("yarn", False), ("dynamic_yarn", True)):
        with pytest.raises(UnsupportedModelError, match="keeps one rope dict per layer type"):
            export(tiny_model("gemma3"), "vllm", tmp_path / "s", method=method, factor=4, approximate=approximate)
    assert not (tmp_path / "s").exists()


def test_the_model_class_builds_plain_then_swaps_each_layers_table():
    """What vLLM's model is built with (the scaled dicts made plain, Gemma 3's sliding dict kept), and which rotary
    embedding gets the scaled table: every one for a flat dict, Gemma 3's global layers only; the others get plain
    RoPE at their own base in every segment, since they are handed the same shifted positions."""
    flat = {"rope_type": "dynamic_yarn", "factor": 4.0, "rope_theta": 5e5}
    assert adaptive.plain_rope(flat) == {"rope_type": "default", "rope_theta": 5e5}
    local = {"rope_type": "default", "rope_theta": 1e4}
    nested = {"full_attention": flat, "sliding_attention": local}
    assert adaptive.plain_rope(nested) == {"full_attention": adaptive.plain_rope(flat), "sliding_attention": local}
    assert adaptive.global_rope(nested) is flat and adaptive.global_rope(flat) is flat
    gemma = SimpleNamespace(rope_parameters=nested, layer_types=["sliding_attention", "full_attention"])
    assert [adaptive.scaled_layer(gemma, f"model.layers.{i}.self_attn.rotary_emb") for i in (0, 1)] == [False, True]
    assert adaptive.scaled_layer(SimpleNamespace(rope_parameters=flat), "model.layers.0.self_attn.rotary_emb")
    with pytest.raises(UnsupportedModelError, match="cannot tell the layer type"):
        adaptive.scaled_layer(gemma, "model.layers.2.self_attn.rotary_emb")
    table = adaptive.table(LAYOUT, None, 32, 1e4)
    plain = adaptive.table(adaptive.BucketLayout.of(1024, (4,)), None, 32, 1e4)[1024:]  # plain RoPE over 4096 rows
    for k in range(3):
        rows = table[LAYOUT.offsets[k] : LAYOUT.offsets[k] + LAYOUT.lengths[k]]
        torch.testing.assert_close(rows, plain[: LAYOUT.lengths[k]], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ vLLM versions
def test_only_the_checked_vllm_release_is_served():
    assert vllm_plugin.CHECKED == ("0.32.0",)
    assert vllm_plugin.version_problem("0.32.0") is None
    assert vllm_plugin.version_problem("0.32.0+cpu") is None  # a local build of the same release
    for other in ("0.33.0", "0.32.1", "0.31.2", "0.32"):
        problem = vllm_plugin.version_problem(other)
        assert f"this is vLLM {other}: install vllm 0.32.0" in problem and "\n" not in problem


@pytest.mark.parametrize(("version", "wrapped"), [("0.32.0", True), ("0.33.0", False)])
def test_register_wraps_nothing_under_another_release(monkeypatch, version, wrapped):
    """The architectures are registered either way (an adaptive folder then reaches its model class, which
    refuses with version_problem's line); the engine core is wrapped only under the checked release."""
    registered, calls = [], []
    fake = SimpleNamespace(
        __version__=version, ModelRegistry=SimpleNamespace(register_model=lambda *a: registered.append(a))
    )
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(vllm_plugin, "_wrap_admission", lambda: calls.append(True))
    vllm_plugin.register()
    names = [f"RopeExtendAdaptive{f}ForCausalLM" for f in ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma3")]
    assert registered == [(n, f"rope_extend.export.vllm_models:{n}") for n in names]
    assert calls == ([True] if wrapped else [])
