"""Length-adaptive dynamic_yarn in the real vLLM engine for Mistral, Qwen2, Qwen3 and Gemma 3 (Llama, on SmolLM2:
test_vllm_adaptive.py), each against the patched transformers model.

Tiny random models of each family (tests/tiny.py, 4 heads of 32 as vLLM's CPU build serves them; Mistral with a
128-token sliding window, Gemma 3 with its 64-token sliding layers at their own base), L = 256, exported with
``dynamic_yarn`` x4 (buckets x2, x4) and served by ``vllm.LLM`` (float32, CPU, eager) with prefix caching on, one
engine per family (tests/export/vllm_run.py, in its own process):

- one mixed batch: a request inside L, one filling 2L and one filling 4L (prompt + 8 greedy tokens: 200 + 8,
  504 + 8, 1016 + 8), with prompt log-probs: the unscaled model, rope-extend's yarn x2 and yarn x4 in transformers
  (Gemma 3: the global layers scaled, the sliding ones plain at their own base);
- the same three prompts again: read from the prefix cache, the same tokens and log-probs;
- the 2L prompt with ``max_tokens`` 10 (505 + 10 - 1 = 514 positions: x4): nothing read from the x2 request's
  cached blocks, and yarn x4's tokens and log-probs;
- a prompt of 4L + 1 tokens, and one of exactly 4L: refused at admission by vLLM's own length check (the model
  refuses a max_model_len past the largest bucket when it loads, so no longer request reaches the plugin); a
  prompt of 4L - 8 tokens with ``max_tokens`` 100 is served, stopped at 4L (finish reason ``length``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.engines, pytest.mark.vllm]
vllm = pytest.importorskip("vllm")

RUN = Path(__file__).with_name("vllm_run.py")
L, FACTOR, GEN = 256, 4.0, 8
SHORT, X2, X4 = 200, 2 * L - GEN, 4 * L - GEN  # + 8 generated: inside L, the 2L edge, the 4L edge
REF = {"x2": 2.0, "x4": 4.0}
# vLLM's CPU attention serves heads of 32 and more; sharper random weights so that greedy steps are not near-ties
FAMILIES = {
    "mistral": {"sliding_window": 128},
    "qwen2": {},
    "qwen3": {"head_dim": 32},
    "gemma3": {"head_dim": 32, "query_pre_attn_scalar": 32, "initializer_range": 0.05},
}


def overrides(family: str) -> dict:
    return {"hidden_size": 128, "initializer_range": 0.2, **FAMILIES[family]}


def _plugin_registered() -> bool:
    from importlib.metadata import entry_points

    return any(e.value.startswith("rope_extend.export.vllm_plugin") for e in entry_points(group="vllm.general_plugins"))


def random_ids(count: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, size=count).tolist()  # the tiny tokenizer: no pad, bos, eos


def requests() -> dict[str, list]:
    short, x2, x4 = random_ids(SHORT, 1), random_ids(X2, 2), random_ids(X4, 3)
    mixed = [{"ids": ids, "max_tokens": GEN, "prompt_logprobs": True} for ids in (short, x2, x4)]
    again = [{"ids": ids, "max_tokens": GEN} for ids in (short, x2, x4)]
    refused = [
        {"ids": random_ids(4 * L + 1, 4), "max_tokens": 1},
        {"ids": random_ids(4 * L, 4), "max_tokens": 1},
        {"ids": x4, "max_tokens": 100},  # served at x4, stopped at 4L
    ]
    return {"batches": [mixed, again, [{"ids": x2, "max_tokens": 10}]], "refused": refused}


def serve(folder: Path, work: Path) -> dict:
    spec = {"model": str(folder), "max_model_len": 4 * L, "prefix_caching": True, "enforce_eager": True}
    spec.update(requests())
    path, out = work / "spec.json", work / "out.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run(
        [sys.executable, str(RUN), str(path), str(out)], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text(encoding="utf-8"))


def reference(family: str) -> dict:
    """Prompt log-probs and greedy tokens in transformers: unscaled inside L, yarn x2 and x4 past it."""
    import rope_extend
    from eval import vllm_parity as vp
    from tests.tiny import tiny_model

    model = tiny_model(family, **overrides(family)).float().eval()
    batch = requests()["batches"]
    out = {"plain": vp.transformers_run(model, batch[0][0]["ids"], GEN)}
    out["plain-of-4L"] = vp.transformers_run(model, batch[0][2]["ids"], 1)
    for name, factor in REF.items():
        rope_extend.patch(model, "yarn", factor=factor, original_max_position_embeddings=L)
        out[name] = vp.transformers_run(model, batch[0][1 if name == "x2" else 2]["ids"], GEN)
        out[f"{name}-of-2L"] = vp.transformers_run(model, batch[0][1]["ids"], 10)
        rope_extend.unpatch(model)
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    if not _plugin_registered():
        pytest.skip("rope-extend's vllm.general_plugins entry point is not installed in this environment")
    from rope_extend.export import export
    from tests.tiny import tiny_model, tiny_tokenizer

    family = request.param
    work = tmp_path_factory.mktemp(f"adaptive-{family}")
    tiny_model(family, **overrides(family)).save_pretrained(work / "model")
    tiny_tokenizer().save_pretrained(work / "model")
    result = export(
        str(work / "model"),
        "vllm",
        work / "export",
        method="dynamic_yarn",
        factor=FACTOR,
        original_max_position_embeddings=L,
    )
    assert result.command.endswith(f"--max-model-len {4 * L} --dtype float32")
    return family, serve(result.out, work), reference(family)


def _close(got: list, want: np.ndarray, name: str) -> None:
    diff = np.abs(np.asarray(got[1:], dtype=np.float64) - want).max()
    assert diff < 5e-4, f"{name}: largest log-prob difference {diff:.2e}"  # float32 kernels: 1e-5 expected


def test_mixed_batch_each_request_its_own_numbers(served):
    family, out, ref = served
    mixed = out["batches"][0]["answers"]
    for answer, name in zip(mixed, ("plain", "x2", "x4"), strict=True):
        want, tokens = ref[name]
        _close(answer["prompt_logprobs"], want, f"{family} {name}")
        assert answer["tokens"] == tokens, f"{family} {name}"
    # the 4L request is not the unscaled model (what serving without the plugin's table past L would give)
    assert np.abs(np.asarray(mixed[2]["prompt_logprobs"][1:]) - ref["plain-of-4L"][0]).max() > 1e-2, family


def test_prefix_cache_reads_only_its_own_factor(served):
    family, out, ref = served
    first, again, x4 = (b["answers"] for b in out["batches"])
    for a, b in zip(first, again, strict=True):
        assert b["cached"] > 0 and b["tokens"] == a["tokens"], family
        assert max(abs(p - q) for p, q in zip(a["logprobs"], b["logprobs"], strict=True)) < 5e-4, family
    # the 2L prompt at x4: none of the x2 request's blocks, and yarn x4's answer
    assert x4[0]["cached"] == 0, family
    assert x4[0]["tokens"] == ref["x4-of-2L"][1], family
    assert x4[0]["tokens"][:GEN] != first[1]["tokens"] or x4[0]["logprobs"][:GEN] != first[1]["logprobs"]


def test_requests_past_the_largest_bucket_are_refused_at_admission(served):
    family, out, _ = served
    longer, full, stopped = out["refused"]
    assert longer is not None and "maximum context length is 1024 tokens" in longer["message"], (family, longer)
    assert "at least 1025 input tokens" in longer["message"], (family, longer)
    assert full is not None and "plus the number of requested output tokens" in full["message"], (family, full)
    assert stopped == {"served": GEN, "finish": "length"}, (family, stopped)  # 1016 + 8 = 4L, then stopped
