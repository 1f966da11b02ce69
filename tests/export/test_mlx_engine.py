"""mlx-lm itself running rope-extend's ``mlx`` exports (marker ``mlx``; ``.ci/run`` makes the MLX venv and points
``ROPE_EXTEND_MLX_PYTHON`` at its interpreter; skipped without it).

Each case of ``eval/mlx_parity.py`` (a tiny random Llama, L=256, x4: none, linear, ntk, yarn, llama3, longrope and
yarn with its own attention factor; yarn on Mistral, Qwen2 and Qwen3) is exported, run in mlx-lm 0.32.2 on the CPU
(``tests/export/mlx_run.py`` in the MLX venv) and compared with the patched transformers model on the same 1016
token ids: perplexity within 1e-5 (measured: at most 1.2e-6), every log-prob within 1e-3 (measured: at most 2.7e-4,
ntk), the same 8 greedy tokens through mlx-lm's KV cache. The rope module mlx-lm built
in every layer equals what the audit's model of mlx-lm (``rope_extend/export/audit/mlx.py``) says, for the exports
and for rope dicts the export never writes (``type`` instead of ``rope_type``, DeepSeek's mscale pair, dynamic,
LongRoPE's mscales, which mlx-lm does not read); a folder as transformers 5 saves it (``rope_parameters`` only) runs
at base 10000, as the audit says, and parts from transformers. SmolLM2-135M with L=256: yarn x4 on 600 tokens of
lcet10.txt.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from eval import mlx_parity as mp

pytestmark = pytest.mark.mlx

if mp.mlx_python() is None:
    pytest.skip(f"no MLX venv: set {mp.ENV} to its python ({mp.VENV_COMMAND}; .ci/run does)", allow_module_level=True)

from eval.vllm_parity import Case, random_ids, tiny_folder, transformers_run
from rope_extend.export.audit import mlx as model_of


def same_ropes(got: list, folder, length: int) -> None:
    """mlx-lm's rope modules (``mlx_run.rope_of``) against the audit's model of them, every layer."""
    want, _, _ = model_of.layers(folder, length)
    assert len(got) == len(want)
    for (_, inv, scale), (_, rope) in zip(got, want, strict=True):
        np.testing.assert_allclose(inv, rope.freqs, rtol=1e-5)  # mlx keeps them in float32
        assert scale == pytest.approx(rope.scale, rel=1e-6)


@pytest.mark.parametrize("case", mp.tiny_cases(), ids=lambda c: f"{c.family}-{c.method}-{len(c.params)}")
def test_mlx_lm_runs_each_export_as_the_patched_model(tmp_path, case):
    from tests.tiny import tiny_model

    source = tiny_folder(case.family, tmp_path / "model")
    model = tiny_model(case.family, **mp.tiny_overrides(case.family))
    ids = random_ids(case.target(mp.L) - mp.NEW)
    row = mp.measure(case, model, source, ids, tmp_path / "export", mp.mlx_python())
    assert row["ppl_rel_diff"] < 1e-5, row
    assert row["logprob_max_abs_diff"] < 1e-3, row
    assert row["greedy_identical"], row
    same_ropes(row["rope"], tmp_path / "export", len(ids))


@pytest.mark.parametrize(
    "scaling",
    [
        {"type": "linear", "factor": 3.0},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "mscale": 0.7,
         "mscale_all_dim": 0.3, "beta_fast": 16, "beta_slow": 2},
        {"rope_type": "dynamic", "factor": 4.0},
        {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 256, "long_mscale": 3.0,
         "short_factor": [1.0] * 16, "long_factor": [1.0 + i / 2 for i in range(16)]},
    ],
    ids=lambda s: s.get("type") or s["rope_type"],
)  # fmt: skip
def test_the_audit_models_mlx_lm_on_dicts_the_export_never_writes(tmp_path, scaling):
    folder = tiny_folder("llama", tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(rope_theta=20000.0, rope_scaling=scaling, max_position_embeddings=512)
    (folder / "config.json").write_text(json.dumps(config))
    got = mp.mlx_run(folder, random_ids(700), 1, mp.mlx_python())
    same_ropes(got["rope"], folder, 700)


def test_a_transformers5_folder_runs_at_the_default_base(tmp_path):
    """Why the export writes top-level keys: mlx-lm's llama reads no ``rope_parameters``."""
    from tests.tiny import tiny_model

    overrides = {**mp.tiny_overrides("llama"), "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    model = tiny_model("llama", **overrides)
    model.save_pretrained(tmp_path / "model")
    ids = random_ids(248)
    got = mp.mlx_run(tmp_path / "model", ids, 1, mp.mlx_python())
    want, _ = transformers_run(model, ids, 1)
    assert np.abs(np.array(got["logprobs"]) - want).max() > 1e-2
    same_ropes(got["rope"], tmp_path / "model", len(ids))
    assert got["rope"][0][1][1] == pytest.approx(10000.0 ** (-2 / 32), rel=1e-6)  # base 10000, not 500000


@pytest.mark.real_model
def test_smollm2_past_its_length(tmp_path):
    from rope_extend.loading import resolve_name
    from tests.export.smollm2 import model_and_text

    model, tokenizer, text = model_and_text()
    # L=256 so that a short prompt is well past it: mlx[cpu]'s wheel ships netlib's reference BLAS (0.8 GFLOP/s here
    # under load, torch 13), and 600 tokens of SmolLM2 are about 0.2 TFLOP
    ids = tokenizer(text)["input_ids"][:600]
    case = Case("smollm2-135m", "yarn", 4.0, 256)
    row = mp.measure(case, model, resolve_name("smollm2-135m"), ids, tmp_path / "export", mp.mlx_python())
    assert row["ppl_rel_diff"] < 5e-5, row  # measured 2.8e-7
    assert row["logprob_max_abs_diff"] < 1e-3, row  # measured 1.2e-4
    assert row["greedy_identical"], row
