import json

import pytest
import torch

import rope_extend
from rope_extend import RopeExtendError
from rope_extend.evaluation import niah, passkey, retrieval
from tests.evaluation.conftest import untimed
from tests.tiny import tiny_config


def answer_from_prompt(tok, monkeypatch, *, niah_answer=None):
    """Make generate() answer correctly: the key read back from the prompt (or a fixed NIAH answer)."""
    calls = []

    def fake_generate(model, tokenizer, input_ids, max_new_tokens):
        calls.append(list(input_ids))
        if niah_answer:
            return " " + niah_answer
        text = tokenizer.decode(input_ids)
        return " " + text.split("The pass key is ")[1].split(".")[0] + ". Remember"

    monkeypatch.setattr(retrieval, "greedy", fake_generate)
    return calls


def test_passkey_accuracy_and_records_with_a_perfect_reader(llama, tok, monkeypatch):
    calls = answer_from_prompt(tok, monkeypatch)
    r = passkey(llama, tok, "128,256", trials=3, seed=1, progress=False)
    assert r.accuracy == {128: 1.0, 256: 1.0} and r.context() == 256
    assert [len(c) for c in calls] == [128] * 3 + [256] * 3
    rec = r.records[0]
    assert rec["method"] == "none" and rec["correct"] and rec["prediction"] == rec["answer"]
    assert 1 <= rec["answer"] <= 50000 and {"length", "depth", "trial", "params", "factor"} <= set(rec)
    assert len({x["answer"] for x in r.records}) == 6  # every trial its own key


def test_passkey_depth_grid_keys_and_wrong_answers(llama, tok, monkeypatch):
    monkeypatch.setattr(retrieval, "greedy", lambda m, t, ids, n: " 99999999")
    r = passkey(llama, tok, [128, 192], depths="0,0.5,1", trials=2, progress=False)
    assert set(r.accuracy) == {(n, d) for n in (128, 192) for d in (0.0, 0.5, 1.0)}
    assert all(v == 0.0 for v in r.accuracy.values()) and r.context() is None
    assert r.accuracy_by_length == {128: 0.0, 192: 0.0}


def test_passkey_is_deterministic_and_real_greedy(llama, tok):
    a = passkey(llama, tok, [128], trials=2, seed=3, progress=False)
    b = passkey(llama, tok, [128], trials=2, seed=3, progress=False)
    c = passkey(llama, tok, [128], trials=2, seed=4, progress=False)
    assert [untimed(x) for x in a.records] == [untimed(x) for x in b.records]
    assert [x["answer"] for x in a.records] != [x["answer"] for x in c.records]


def test_greedy_ignores_the_checkpoint_sampling_config(tok):
    from tests.tiny import tiny_model

    model = tiny_model("llama", seed=1)
    model.generation_config.do_sample = True
    model.generation_config.temperature = 5.0
    model.generation_config.top_k = 3
    model.generation_config.repetition_penalty = 3.0
    ids = tok("The grass is green. The sky", add_special_tokens=False)["input_ids"]
    out = retrieval.greedy(model, tok, ids, 8)
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(8):
            x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert out == tok.decode(x[0, len(ids) :].tolist(), skip_special_tokens=True)


def test_records_name_the_patched_method(llama, tok, monkeypatch):
    answer_from_prompt(tok, monkeypatch)
    rope_extend.patch(llama, "yarn", factor=2)
    try:
        r = passkey(llama, tok, [128], trials=1, progress=False, run={"label": "yarn-2"})
    finally:
        rope_extend.unpatch(llama)
    rec = r.records[0]
    assert (rec["method"], rec["factor"], rec["original_length"], rec["label"]) == ("yarn", 2.0, 256, "yarn-2")


def test_model_that_cannot_generate(tok):
    from transformers import LlamaModel

    with pytest.raises(RopeExtendError, match="LlamaModel cannot generate"):
        passkey(LlamaModel(tiny_config("llama")), tok, [128], trials=1, progress=False)


@pytest.mark.parametrize(
    "lengths, match",
    [
        ("0", "positive integer"),
        ("-5", "positive integer"),
        ("1.5", "positive integer"),
        ("abc", "positive integer"),
        ("", "no lengths"),
        ("40", "too short"),
    ],
)
def test_bad_lengths(llama, tok, lengths, match):
    with pytest.raises(RopeExtendError, match=match):
        passkey(llama, tok, lengths, trials=1, progress=False)


def test_bad_trials_and_depths(llama, tok):
    with pytest.raises(RopeExtendError, match="trials"):
        passkey(llama, tok, [128], trials=0, progress=False)
    with pytest.raises(RopeExtendError, match="depth"):
        passkey(llama, tok, [128], depths="0,1.5", progress=False)


def test_niah_grid_substring_and_haystack_checks(llama, tok, texts, monkeypatch):
    calls = answer_from_prompt(tok, monkeypatch, niah_answer="sit in dolores park")
    r = niah(llama, tok, texts, [128, 256], depths=[0, 0.5, 1], progress=False)
    assert r.accuracy == {(n, d): 1.0 for n in (128, 256) for d in (0.0, 0.5, 1.0)}
    text = tok.decode(calls[4])
    assert "Dolores Park on a sunny day" in text and len(calls[4]) == 256
    with pytest.raises(RopeExtendError, match="haystack text has .* tokens but length 100000"):
        niah(llama, tok, texts[:1], [128, 100000], progress=False)
    with pytest.raises(RopeExtendError, match="answer must be a non-empty"):
        niah(llama, tok, texts, [128], answer="", progress=False)


def test_records_file_is_jsonl_appended_per_trial(llama, tok, tmp_path, monkeypatch):
    answer_from_prompt(tok, monkeypatch)
    path = tmp_path / "r.jsonl"
    r = passkey(llama, tok, [128], trials=2, records=path, progress=False)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == r.records


def test_a_length_that_cannot_fit_fails_before_any_prompt_is_built(llama, tok, monkeypatch):
    import importlib

    from rope_extend import RopeExtendError
    from rope_extend.evaluation import runner

    passkey_module = importlib.import_module("rope_extend.evaluation.passkey")  # the package attribute is the function

    monkeypatch.setattr(runner, "_available_bytes", lambda device: 10**6)  # 1 MB free
    built = []
    real = passkey_module.passkey_prompt
    monkeypatch.setattr(passkey_module, "passkey_prompt", lambda *a, **k: built.append(1) or real(*a, **k))
    with pytest.raises(RopeExtendError, match="length 4096 cannot be reached.*MiB"):
        passkey_module.passkey(llama, tok, [128, 4096], trials=1, progress=False)
    assert built == []
    monkeypatch.setattr(runner, "_available_bytes", lambda device: None)  # unknown: no refusal
    assert runner.memory_needed(llama, 4096, cache=True) > runner.memory_needed(llama, 4096, cache=False) > 0


def test_passkey_with_other_filler_keeps_the_keys_and_changes_the_haystack(llama, tok, monkeypatch):
    calls = answer_from_prompt(tok, monkeypatch)
    prose = "A heron stood in the shallows. Rain drummed on the tin roof. Who left the gate open? Nobody knew."
    plain = passkey(llama, tok, [160], trials=4, seed=2, progress=False)
    other = passkey(llama, tok, [160], trials=4, seed=2, progress=False, filler=prose)
    assert [r["answer"] for r in other.records] == [r["answer"] for r in plain.records]
    assert [r["depth"] for r in other.records] == [r["depth"] for r in plain.records]
    assert other.accuracy == {160: 1.0} and other.records[0]["setting"] != plain.records[0]["setting"]
    texts = [tok.decode(c) for c in calls]
    assert all("grass" in t for t in texts[:4]) and not any("grass" in t for t in texts[4:])
    assert all("heron" in t or "roof" in t or "gate" in t for t in texts[4:])
