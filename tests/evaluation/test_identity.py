"""A record knows the model it was measured on: the digest of its weights and config, not the path typed."""

import json

import torch

from rope_extend.cli import main
from rope_extend.evaluation import retrieval
from rope_extend.evaluation.identity import forget_digest, model_digest
from rope_extend.evaluation.passkey import passkey
from tests.tiny import tiny_model, tiny_tokenizer


def test_the_digest_follows_the_weights_the_config_and_the_dtype():
    a, b = tiny_model("llama"), tiny_model("llama")
    assert model_digest(a) == model_digest(b)  # the same weights (seeded) in two objects
    with torch.no_grad():
        b.model.layers[0].mlp.up_proj.weight[3, 5] += 0.25  # one element, written in place
    assert model_digest(b) != model_digest(a)
    c = tiny_model("llama")
    c.config.rms_norm_eps = 1e-3  # the same weights, another config
    assert model_digest(c) != model_digest(a)
    assert model_digest(tiny_model("llama").to(torch.bfloat16)) != model_digest(a)


def test_a_write_through_data_is_seen_after_forget_digest():
    model = tiny_model("llama")
    before = model_digest(model)
    model.lm_head.weight.data[0, 0] += 1.0  # torch does not count writes through .data
    forget_digest(model)
    assert model_digest(model) != before


def test_a_saved_model_has_the_digest_of_its_files_whatever_folder_holds_it(tmp_path):
    from transformers import AutoModelForCausalLM

    tiny_model("llama").save_pretrained(tmp_path / "a")
    tiny_model("llama").save_pretrained(tmp_path / "b")
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "b")
    assert model_digest(a) == model_digest(b)


def _save(path, *, changed: bool):
    model = tiny_model("llama")
    if changed:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1.0)
    model.save_pretrained(path / "m")
    tiny_tokenizer().save_pretrained(path / "m")


def _measured(monkeypatch) -> list[int]:
    """The prompt lengths passkey measures from now on (reused records are not measured)."""
    calls: list[int] = []
    real = retrieval.greedy
    monkeypatch.setattr(retrieval, "greedy", lambda *a: calls.append(len(a[2])) or real(*a))
    return calls


def test_records_from_another_model_at_the_same_path_are_not_reused(tmp_path, monkeypatch):
    """The issue's case: two different models at the relative path ``m``; B must not report A's records."""
    _save(tmp_path / "A", changed=False)
    _save(tmp_path / "B", changed=True)
    run = ["eval", "passkey", "--model", "m", "--lengths", "128", "--trials", "2", "--max-new-tokens", "3"]
    run += ["--no-progress", "--json", "--out", "out"]
    monkeypatch.chdir(tmp_path / "A")
    assert main(run) == 0
    first = json.loads((tmp_path / "A" / "out" / "results.json").read_text())["records"]
    calls = _measured(monkeypatch)
    monkeypatch.chdir(tmp_path / "B")
    assert main([*run, "--records-from", "../A/out"]) == 0
    assert calls == [128, 128]  # both trials measured on B
    second = json.loads((tmp_path / "B" / "out" / "results.json").read_text())["records"]
    assert {r["model"] for r in first + second} == {"m"}
    assert first[0]["model_digest"] != second[0]["model_digest"]
    assert {r["setting"] for r in first}.isdisjoint(r["setting"] for r in second)
    # the same model again, read from A's records: nothing measured
    calls.clear()
    monkeypatch.chdir(tmp_path / "A")
    assert main([*run[:-1], "again", "--records-from", "out"]) == 0
    assert calls == []


def test_resume_after_the_model_is_replaced_in_place_measures_again(tmp_path, monkeypatch):
    tok = tiny_tokenizer()
    path = tmp_path / "records.jsonl"
    model = tiny_model("llama")
    first = passkey(model, tok, [128], trials=2, seed=1, max_new_tokens=3, records=path, progress=False)
    calls = _measured(monkeypatch)
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)  # fine-tuned in place, the same name
    again = passkey(model, tok, [128], trials=2, seed=1, max_new_tokens=3, records=path, resume=True, progress=False)
    assert calls == [128, 128]
    assert again.records[0]["setting"] != first.records[0]["setting"]
    assert first.records[0]["rope_extend"] and first.records[0]["task_version"] == 1


def test_another_tokenizer_measures_again(tmp_path, monkeypatch):
    """The same model with a tokenizer that splits text differently builds other prompts: its records are not
    reused (the setting carries the tokenizer's digest)."""
    import copy

    from rope_extend.evaluation.identity import tokenizer_digest

    tok = tiny_tokenizer()
    other = copy.deepcopy(tok)  # tiny_tokenizer() is shared: never changed in place
    other.add_tokens(["passkey"])  # one more token: "passkey" is now one id
    assert tokenizer_digest(tok) == tokenizer_digest(tiny_tokenizer())
    assert tokenizer_digest(other) != tokenizer_digest(tok)
    path = tmp_path / "records.jsonl"
    model = tiny_model("llama")
    first = passkey(model, tok, [128], trials=2, seed=1, max_new_tokens=3, records=path, progress=False)
    calls = _measured(monkeypatch)
    again = passkey(model, other, [128], trials=2, seed=1, max_new_tokens=3, records=path, resume=True, progress=False)
    assert len(calls) == 2
    assert again.records[0]["setting"] != first.records[0]["setting"]
    same = passkey(model, tok, [128], trials=2, seed=1, max_new_tokens=3, records=path, resume=True, progress=False)
    assert len(calls) == 2 and same.records[0]["setting"] == first.records[0]["setting"]
