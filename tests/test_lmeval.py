"""The lm-eval model type ``rope-extend`` (rope_extend.lmeval), offline on the bundled model (L = 256).

The argument checks run without lm-eval; the rest needs it (``pip install 'rope-extend[lm_eval]'``) and is
skipped without it. They run lm-eval itself: the example task (examples/lm_eval_tasks), a tiny task written
here (YAML and JSONL in a temporary folder), and lm-eval's command line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rope_extend
from rope_extend import lmeval
from rope_extend.errors import RopeExtendError
from rope_extend.evaluation.prompts import passkey_prompt
from rope_extend.loading import bundled_available, load_model, load_tokenizer
from rope_extend.methods import registry
from rope_extend.scaling import ScalingRequest

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "examples" / "lm_eval_tasks"
METRIC = "exact_match,first_integer"

needs_bundled = pytest.mark.skipif(not bundled_available(), reason="the bundled model is not in this checkout")


# ------------------------------------------------------------------------------------------ without lm-eval
def test_import_rope_extend_does_not_import_lm_eval():
    code = "import sys, rope_extend; assert 'lm_eval' not in sys.modules, 'lm_eval imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_unknown_model_argument_is_named_with_the_allowed_ones():
    with pytest.raises(RopeExtendError) as info:
        lmeval.split_arguments({"pretrained": "bundled", "method": "self_extend", "grop_size": 4})
    message = str(info.value)
    assert "unknown model argument 'grop_size'" in message
    assert "did you mean 'group_size'" in message
    allowed = message.split("allowed: ", 1)[1].split(", ")
    assert allowed == lmeval.allowed_arguments()
    assert {"pretrained", "method", "factor", "target_length", "group_size", "logn", "batch_size"} <= set(allowed)


def test_hflm_arguments_that_do_not_apply_are_refused():
    # lm-eval's own loader options: rope-extend loads the model itself, so they would be silently ignored
    for key in ("parallelize", "peft", "revision", "backend"):
        with pytest.raises(RopeExtendError, match=f"unknown model argument '{key}'"):
            lmeval.split_arguments({"pretrained": "bundled", key: "x"})


def test_method_arguments_need_a_method_and_a_known_one():
    with pytest.raises(RopeExtendError, match=r"factor= given without a scaling method \(method= is none\)"):
        lmeval.split_arguments({"pretrained": "bundled", "factor": 4})
    with pytest.raises(RopeExtendError, match="group_size= given without a scaling method"):
        lmeval.split_arguments({"pretrained": "bundled", "method": "none", "group_size": 4})
    with pytest.raises(RopeExtendError, match="unknown method 'yran'.*did you mean 'yarn'"):
        lmeval.split_arguments({"pretrained": "bundled", "method": "yran", "factor": 4})
    with pytest.raises(RopeExtendError, match="needs pretrained="):
        lmeval.split_arguments({"method": "yarn", "factor": 4})


def test_arguments_are_sorted_and_values_read():
    args = lmeval.split_arguments(
        {
            "pretrained": "bundled",
            "dtype": "float32",
            "method": "longrope",
            "factor": 4,
            "short_factor": "[1, 2]",  # lm-eval leaves a list as text
            "long_factor": "[3, 4]",
            "logn": True,
            "batch_size": 2,
            "max_length": 900,
        }
    )
    assert args.load == {"pretrained": "bundled", "dtype": "float32"}
    assert args.scaling == ScalingRequest(
        "longrope", factor=4, params={"short_factor": [1, 2], "long_factor": [3, 4], "logn": True}
    )
    assert args.hflm == {"batch_size": 2, "max_length": 900}
    assert lmeval.split_arguments({"pretrained": "bundled", "method": "none"}).scaling is None


def test_every_method_parameter_is_allowed():
    for name in rope_extend.method_names():
        for field in dataclasses.fields(registry.get(name).params):
            assert field.name in lmeval.method_parameters(), (name, field.name)


def test_without_lm_eval_the_error_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(lmeval, "_MISSING", ImportError("No module named 'lm_eval'"))
    with pytest.raises(RopeExtendError, match=r"No module named 'lm_eval'.*pip install 'rope-extend\[lm_eval\]'"):
        lmeval.evaluate("pretrained=bundled", ["rope_extend_passkey"])
    with pytest.raises(SystemExit) as info:
        lmeval.main(["--model", "rope-extend"])
    assert info.value.code == 2
    assert "pip install 'rope-extend[lm_eval]'" in capsys.readouterr().err


def test_loader_gets_the_load_arguments(monkeypatch):
    """rope-extend's loader does the loading (a .gguf path or gguf_file=, trust_remote_code off by default)."""
    from rope_extend import loading

    from .tiny import tiny_model, tiny_tokenizer

    calls = []

    def fake_model(name, **kwargs):
        calls.append(("model", name, kwargs))
        return tiny_model("llama")

    def fake_tokenizer(name, **kwargs):
        calls.append(("tokenizer", name, kwargs))
        return tiny_tokenizer()

    monkeypatch.setattr(loading, "load_model", fake_model)
    monkeypatch.setattr(loading, "load_tokenizer", fake_tokenizer)
    given = dict(pretrained="/models/m", gguf_file="m.Q8_0.gguf", dtype="bf16", device="cpu")
    args = lmeval.split_arguments({**given, "method": "yarn", "target_length": 1024})
    model, _, scaling = lmeval.load_patched(args)
    assert calls == [
        (
            "model",
            "/models/m",
            dict(
                dtype="bf16", device="cpu", trust_remote_code=False, attn_implementation="sdpa", gguf_file="m.Q8_0.gguf"
            ),
        ),
        ("tokenizer", "/models/m", dict(trust_remote_code=False, gguf_file="m.Q8_0.gguf")),
    ]
    assert rope_extend.patched(model) == scaling and scaling.factor == 4 and scaling.target_length == 1024

    calls.clear()
    args = lmeval.split_arguments({"pretrained": "m.gguf", "tokenizer": "tok", "trust_remote_code": True})
    model, _, scaling = lmeval.load_patched(args)
    assert scaling is None and rope_extend.patched(model) is None
    assert [(c[0], c[1], c[2]["trust_remote_code"]) for c in calls] == [
        ("model", "m.gguf", True),
        ("tokenizer", "tok", True),
    ]


# ------------------------------------------------------------------------------------------ with lm-eval
@pytest.fixture(scope="module")
def harness():
    lm_eval = pytest.importorskip("lm_eval")
    if not bundled_available():
        pytest.skip("the bundled model is not in this checkout")
    from lm_eval.tasks import TaskManager

    return lm_eval, TaskManager(include_path=str(TASKS))


def _make(model_args: str):
    return lmeval.RopeExtendLM.create_from_arg_string(model_args, {"device": "cpu", "batch_size": 1})


def _passkey_1000(lm_eval, manager, lm, limit=4) -> float:
    out = lm_eval.simple_evaluate(model=lm, tasks=["rope_extend_passkey_1000"], task_manager=manager, limit=limit)
    return float(out["results"]["rope_extend_passkey_1000"][METRIC])


def test_registered_under_both_names(harness):
    from lm_eval.api.registry import get_model

    assert get_model("rope-extend") is lmeval.RopeExtendLM
    assert get_model("rope_extend") is lmeval.RopeExtendLM


def test_yarn_is_patched_and_reads_the_example_task_at_4x(harness):
    lm_eval, manager = harness
    plain = _make("pretrained=bundled,max_length=1024")
    lm = _make("pretrained=bundled,method=yarn,factor=4")

    scaling = rope_extend.patched(lm.model)
    assert scaling == lm.scaling and scaling.method.name == "yarn" and scaling.factor == 4
    assert lm.max_length == 4 * 256 == scaling.target_length
    assert lm.model.config.rope_parameters["rope_type"] == "yarn"
    assert lm.model.config.max_position_embeddings == 1024
    assert rope_extend.patched(plain.model) is None and plain.scaling is None
    assert plain.model.config.rope_parameters == {"rope_theta": 1600.0, "rope_type": "default"}
    inv = dict(lm.model.named_buffers())["model.rotary_emb.inv_freq"]
    inv_plain = dict(plain.model.named_buffers())["model.rotary_emb.inv_freq"]
    # YaRN: the fastest pair kept, the slowest interpolated by the factor
    assert inv[0] == inv_plain[0] and inv[-1] == pytest.approx(inv_plain[-1] / 4, rel=1e-5)

    # passkeys at 1000 tokens (~3.9 L): the unpatched model reading the whole prompt finds none, YaRN 4x all
    assert _passkey_1000(lm_eval, manager, plain) == 0.0
    assert _passkey_1000(lm_eval, manager, lm) == 1.0


def test_unpatched_max_length_is_the_trained_length(harness):
    lm = _make("pretrained=bundled")
    assert lm.scaling is None and lm.max_length == 256


def test_attention_method_with_logn(harness):
    lm = _make("pretrained=bundled,method=self_extend,group_size=4,window=64,logn=true")
    scaling = rope_extend.patched(lm.model)
    assert scaling.method.name == "self_extend" and scaling.logn
    assert (scaling.params.group_size, scaling.params.window) == (4, 64)
    # no factor: the usable length (L - W) * G + W
    assert lm.max_length == (256 - 64) * 4 + 64 == scaling.target_length
    assert lm.model.config.rope_parameters["rope_type"] == "self_extend"
    # plain RoPE frequencies: Self-Extend changes positions in attention
    plain = load_model("bundled")
    assert dict(lm.model.named_buffers())["model.rotary_emb.inv_freq"].equal(plain.model.rotary_emb.inv_freq)


def test_bad_method_parameter_through_lm_eval(harness):
    lm_eval, manager = harness
    with pytest.raises(RopeExtendError, match="unknown parameter 'window' for method 'yarn'"):
        _make("pretrained=bundled,method=yarn,factor=4,window=64")
    with pytest.raises(RopeExtendError, match="unknown model argument 'factr'.*did you mean 'factor'"):
        lm_eval.simple_evaluate(
            model="rope-extend",
            model_args="pretrained=bundled,factr=4",
            tasks=["rope_extend_passkey_240"],
            task_manager=manager,
        )


def _tiny_task(folder: Path) -> str:
    """A loglikelihood task on local JSONL: is the key the model's greedy continuation (``acc``)?"""
    tokenizer = load_tokenizer("bundled")
    rows = []
    for i, (length, key) in enumerate([(600, 31337), (600, 2718), (200, 4242)]):
        prompt = passkey_prompt(tokenizer, length, key, depth=0.3)
        rows.append({"id": i, "input": tokenizer.decode(prompt.input_ids), "target": str(key)})
    data = folder / "tiny.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (folder / "tiny.yaml").write_text(
        "\n".join(
            [
                "task: tiny_passkey_ll",
                "dataset_path: json",
                "dataset_kwargs:",
                f"  data_files: {{test: {json.dumps(str(data))}}}",
                f"  cache_dir: {json.dumps(str(folder / 'cache'))}",
                "test_split: test",
                "output_type: loglikelihood",
                'doc_to_text: "{{input}}"',
                'doc_to_target: " {{target}}"',  # loglikelihood: the continuation as written, with its space
                "metric_list:",
                "  - metric: acc",
                "",
            ]
        ),
        encoding="utf-8",
    )
    return "tiny_passkey_ll"


def test_model_name_runs_a_tiny_local_task(harness, tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    task = _tiny_task(tmp_path)
    loaded = []
    original = lmeval.load_patched
    monkeypatch.setattr(lmeval, "load_patched", lambda args: loaded.append(original(args)) or loaded[-1])

    manager = TaskManager(include_path=str(tmp_path))
    accuracy = {}
    for model_args in ("pretrained=bundled,max_length=1024", "pretrained=bundled,method=self_extend,factor=4"):
        out = lmeval.evaluate(model_args, [task], task_manager=manager)
        accuracy[model_args] = float(out["results"][task]["acc,none"])
    model, _, scaling = loaded[-1]
    assert rope_extend.patched(model) == scaling and scaling.method.name == "self_extend"
    # the 200-token prompt is inside L for both; the two 600-token ones only Self-Extend reads
    assert accuracy == {
        "pretrained=bundled,max_length=1024": pytest.approx(1 / 3),
        "pretrained=bundled,method=self_extend,factor=4": 1.0,
    }


def test_command_line(harness, tmp_path):
    argv = [
        "--model",
        "rope-extend",
        "--model_args",
        "pretrained=bundled,method=yarn,factor=4",
        "--tasks",
        "rope_extend_passkey_1000",
        "--include_path",
        str(TASKS),
        "--device",
        "cpu",
        "--limit",
        "2",
        "--output_path",
        str(tmp_path),
    ]
    lmeval.main(argv)
    (result,) = tmp_path.rglob("results_*.json")
    out = json.loads(result.read_text())
    assert out["config"]["model"] == "rope-extend"
    assert out["results"]["rope_extend_passkey_1000"][METRIC] == 1.0


def test_python_m_registers_the_model_and_reports_a_bad_argument(harness):
    """``python -m rope_extend.lmeval`` is lm-eval's command line with the model type registered (once)."""
    args = ["--model", "rope-extend", "--model_args", "pretrained=bundled,method=yarn,factor=4,gruop_size=4"]
    args += ["--tasks", "rope_extend_passkey_240", "--include_path", str(TASKS), "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "rope_extend.lmeval", *args],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "rope-extend-lm-eval: error: unknown model argument 'gruop_size'" in done.stderr
    assert "did you mean 'group_size'" in done.stderr and "allowed: pretrained, tokenizer" in done.stderr
