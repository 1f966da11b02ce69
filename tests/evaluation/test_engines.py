"""The harnesses measure a GGUF file in llama.cpp with the same prompts as the transformers model, and get the
same numbers (marker ``engines``: .ci/run runs it where llama-cpp-python is installed).

A tiny random Llama patched with yarn x2 past its L = 256 is exported to an f32 GGUF; passkey outputs must be
the same strings and perplexity equal within 1e-4 relative on both backends; records name the engine and the
file's digest, so a resumed transformers run never takes the engine's records.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import rope_extend
from rope_extend.errors import RopeExtendError
from rope_extend.evaluation import passkey, perplexity
from rope_extend.evaluation.prompts import FILLER
from rope_extend.export import export
from tests.tiny import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.engines
llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from rope_extend.evaluation import engines
from rope_extend.evaluation.engines import LlamaCppModel

LENGTHS = [200, 480]  # inside and past L = 256 (yarn x2 reaches 512)


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engines")
    model, tok = tiny_model("llama"), tiny_tokenizer()
    rope_extend.patch(model, "yarn", factor=2.0)
    result = export(model, "gguf", folder / "m.gguf", tokenizer=tok, tokenizer_pre="smollm")
    served = LlamaCppModel(result.out, n_ctx=512, method="yarn", factor=2.0, original_length=256, threads=2)
    yield model, served, tok, folder
    served.close()


def test_passkey_outputs_are_the_same_strings(backends):
    model, served, tok, folder = backends
    a = passkey(model, tok, LENGTHS, trials=3, progress=False, records=folder / "hf.jsonl")
    b = passkey(served, tok, LENGTHS, trials=3, progress=False, records=folder / "cpp.jsonl")
    assert [r["output"] for r in a.records] == [r["output"] for r in b.records]
    assert any(r["output"].strip() for r in b.records)  # a random model still says something
    assert a.accuracy_by_length == b.accuracy_by_length
    record = b.records[0]
    assert record["engine"].startswith("llama.cpp") and record["model_digest"] == served.digest
    assert record["method"] == "yarn" and record["factor"] == 2.0
    assert a.records[0]["setting"] != record["setting"]  # never mixed on resume


def test_perplexity_agrees_within_1e_4(backends):
    model, served, tok, _folder = backends
    texts = [" ".join([FILLER] * 40)]
    a = perplexity(model, tok, texts, LENGTHS, stride=100, progress=False)
    b = perplexity(served, tok, texts, LENGTHS, stride=100, progress=False)
    for n in LENGTHS:
        assert a.tokens[n] == b.tokens[n]
        assert abs(a.perplexity[n] - b.perplexity[n]) / a.perplexity[n] < 1e-4, (n, a.perplexity, b.perplexity)


def test_resume_reuses_the_engines_records(backends):
    _, served, tok, folder = backends
    path = folder / "resume.jsonl"
    first = passkey(served, tok, [200], trials=2, progress=False, records=path)
    again = passkey(served, tok, [200], trials=2, progress=False, records=path, resume=True)
    assert [r["output"] for r in again.records] == [r["output"] for r in first.records]
    assert len(path.read_text().splitlines()) == 2  # nothing measured twice
    assert all(json.loads(line)["engine"].startswith("llama.cpp") for line in path.read_text().splitlines())


def test_a_length_past_the_opened_context_is_refused_before_any_work(backends):
    _, served, tok, _ = backends
    with pytest.raises(RopeExtendError, match="n_ctx >= 1034"):
        passkey(served, tok, [1024], trials=1, progress=False)


def test_bad_path_and_context_are_one_line_errors(tmp_path):
    with pytest.raises(RopeExtendError, match="missing.gguf: no such file: give the path of a GGUF file"):
        LlamaCppModel(tmp_path / "missing.gguf", n_ctx=512)
    (tmp_path / "x.gguf").write_bytes(b"")
    with pytest.raises(RopeExtendError, match="n_ctx must be a positive integer"):
        LlamaCppModel(tmp_path / "x.gguf", n_ctx=0)


# ------------------------------------------------------------------------------ how llama.cpp is driven (issue 68)
def test_threads_apply_to_batches_and_the_defaults_are_the_measured_ones(backends):
    _, _, _, folder = backends
    with LlamaCppModel(folder / "m.gguf", n_ctx=512, threads=1) as one:
        ctx = one._llm._ctx.ctx
        # llama-cpp-python alone would run every batch of a prefill on multiprocessing.cpu_count() threads
        assert (llama_cpp.llama_n_threads(ctx), llama_cpp.llama_n_threads_batch(ctx)) == (1, 1)
        assert one.settings == {
            "threads": 1, "n_batch": 512, "n_ubatch": 512, "flash_attn": engines.FLASH_ATTN, "kv_type": engines.KV_TYPE
        }  # fmt: skip
        assert llama_cpp.llama_n_batch(ctx) == 512 and llama_cpp.llama_n_ubatch(ctx) == 512  # cut to n_ctx
    with LlamaCppModel(folder / "m.gguf", n_ctx=8192) as wide:
        ctx = wide._llm._ctx.ctx
        assert llama_cpp.llama_n_batch(ctx) == engines.N_BATCH and llama_cpp.llama_n_ubatch(ctx) == engines.N_UBATCH
        assert llama_cpp.llama_n_threads_batch(ctx) == len(os.sched_getaffinity(0))


def test_the_measured_settings_give_the_numbers_of_the_settings_before(backends):
    """Flash attention, larger batches and logits only where scored change no answer, and perplexity by < 1e-4."""
    _, served, tok, folder = backends
    texts = [" ".join([FILLER] * 40)]
    with LlamaCppModel(folder / "m.gguf", n_ctx=512, n_batch=64, n_ubatch=64, flash_attn=False) as before:
        a = passkey(before, tok, LENGTHS, trials=3, progress=False)
        b = passkey(served, tok, LENGTHS, trials=3, progress=False)
        assert [r["output"] for r in a.records] == [r["output"] for r in b.records]
        a = perplexity(before, tok, texts, LENGTHS, stride=100, progress=False)
        b = perplexity(served, tok, texts, LENGTHS, stride=100, progress=False)
    for n in LENGTHS:
        assert abs(a.perplexity[n] - b.perplexity[n]) / a.perplexity[n] < 1e-4, (n, a.perplexity, b.perplexity)


def test_a_float32_kv_cache_gives_the_same_answers(backends):
    """``kv_type="f32"`` (engine_speed.py's ``kv_f32``): keys and values kept unrounded, the same passkey outputs,
    perplexity within 1e-4 of the f16 cache's; the cache really is float32 (its state, mostly the cache, twice
    the bytes)."""
    _, served, tok, folder = backends
    texts = [" ".join([FILLER] * 40)]
    with LlamaCppModel(folder / "m.gguf", n_ctx=512, kv_type="f32", threads=2) as wide:
        a = passkey(wide, tok, LENGTHS, trials=3, progress=False)
        b = passkey(served, tok, LENGTHS, trials=3, progress=False)
        assert [r["output"] for r in a.records] == [r["output"] for r in b.records]
        a = perplexity(wide, tok, texts, LENGTHS, stride=100, progress=False)
        b = perplexity(served, tok, texts, LENGTHS, stride=100, progress=False)
        sizes = [llama_cpp.llama_state_get_size(m._llm._ctx.ctx) for m in (wide, served)]
    for n in LENGTHS:
        assert abs(a.perplexity[n] - b.perplexity[n]) / a.perplexity[n] < 1e-4, (n, a.perplexity, b.perplexity)
    assert sizes[0] > 1.8 * sizes[1], sizes  # an f16 cache would be the same size


def test_nll_scores_exactly_the_positions_asked_for(backends, monkeypatch):
    """Against llama-cpp-python's own path (``logits_all=True``, ``Llama.eval``, every position's logits kept),
    with the same settings: the sum over positions >= score_from of -log p(next token), in float64."""
    _, served, _, folder = backends
    ids = list(range(5, 405))
    ref = llama_cpp.Llama(
        str(folder / "m.gguf"), n_ctx=512, n_batch=engines.N_BATCH, n_ubatch=engines.N_UBATCH, n_threads=2,
        n_threads_batch=2, flash_attn=engines.FLASH_ATTN, logits_all=True, verbose=False,
    )  # fmt: skip
    try:
        ref.eval(ids)
        logits = np.asarray(ref.scores[: len(ids)], dtype=np.float64)
    finally:
        ref.close()
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    for score_from, rows in [(1, 512), (150, 512), (399, 512), (1, 100), (150, 100), (399, 7)]:
        monkeypatch.setattr(engines, "REDUCE_ROWS", rows)  # a batch reduced in slices of rows
        want = -sum(logp[j - 1, ids[j]] for j in range(score_from, len(ids)))
        total, count = served.nll(ids, score_from)
        assert count == len(ids) - score_from
        assert total == pytest.approx(want, rel=1e-5), (score_from, rows)
    assert served.nll(ids, 400) == (0.0, 0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"threads": 0}, "threads must be an integer >= 1, got 0"),
        ({"n_batch": True}, "n_batch must be an integer >= 1, got True"),
        ({"n_batch": 256, "n_ubatch": 512}, r"n_ubatch \(512\) must be <= n_batch \(256\)"),
        ({"flash_attn": "yes"}, "flash_attn must be True or False, got 'yes'"),
        ({"kv_type": "q8_0"}, "kv_type must be one of f32, f16, got 'q8_0'"),
        ({"kv_type": ["f32"]}, r"kv_type must be one of f32, f16, got \['f32'\]"),
    ],
)
def test_bad_settings_are_one_line_errors(backends, settings, message):
    _, _, _, folder = backends
    with pytest.raises(RopeExtendError, match=message):
        LlamaCppModel(folder / "m.gguf", n_ctx=512, **settings)
