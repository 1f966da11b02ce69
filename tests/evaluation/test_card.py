"""``rope-extend card`` end to end on the bundled testbed (L = 256), at the smallest settings that measure something:
the card's numbers are the harnesses' own, retention compares the same examples, a resumed card measures nothing
again, and (marker ``engines``) the GGUF export in llama.cpp agrees with transformers."""

from __future__ import annotations

import json

import pytest

from rope_extend.cli import main
from rope_extend.errors import RopeExtendError
from rope_extend.evaluation.card import CardOptions, card, default_lengths
from rope_extend.evaluation.records import RecordLog

SMALL = dict(lengths=[256, 512], samples=1, trials=3, tasks=["niah_single_1"], answer_tokens=16, docs=1)


def test_default_lengths():
    assert default_lengths(256, 1024) == [256, 512, 1024]
    assert default_lengths(8192, 32768) == [4096, 8192, 16384, 32768]
    assert default_lengths(4096, 12288) == [2048, 4096, 8192, 12288]  # the target itself ends the list


def test_options_are_checked_with_their_names():
    with pytest.raises(RopeExtendError, match="samples must be a positive integer, got 0"):
        CardOptions(samples=0)
    assert CardOptions(lengths="256,1k").lengths == [256, 1024]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("card") / "yarn"
    result = card(
        "bundled", out, method="yarn", scaling_kwargs={"factor": 4}, options=CardOptions(**SMALL, engine=False)
    )
    return out, result


def test_the_card_holds_the_harnesses_numbers(measured):
    out, result = measured
    assert {p.name for p in out.iterdir()} >= {"records.jsonl", "card.md", "card.json", "card.png"}
    assert json.loads((out / "card.json").read_text())["lengths"] == [256, 512]
    patched, original = result["backends"]["transformers"], result["backends"]["original"]
    assert set(patched["passkey"]) == {256, 512} and set(original["passkey"]) == {256}  # the original inside L only
    records = RecordLog(out / "records.jsonl", resume=True).records
    mine = [r for r in records if r["task"] == "passkey" and r["length"] == 512 and r["method"] == "yarn"]
    assert patched["passkey"][512] == sum(r["correct"] for r in mine) / len(mine) and len(mine) == 3
    # retention: the same trials and documents inside L, a ratio with its interval
    kept = result["retention"]
    assert kept["passkey"]["examples"] == 3 and kept["perplexity"]["examples"] == 1
    ppl = original["perplexity"][256] / patched["perplexity"][256]
    assert kept["perplexity"]["ratio"] == pytest.approx(ppl, rel=1e-9)
    assert result["served"] is None and result["agreement"] is None  # engine=False
    text = (out / "card.md").read_text()
    assert "average over 1 task: niah_single_1 (" in text and "not comparable" in text and "| 512 |" in text
    assert result["scaling_from"] == "patch" and "passkey (patched)" in text and "from the config" not in text


def test_a_resumed_card_measures_nothing_again(measured):
    out, first = measured
    before = (out / "records.jsonl").read_text()
    options = CardOptions(**SMALL, engine=False)
    again = card("bundled", out, method="yarn", scaling_kwargs={"factor": 4}, resume=True, options=options)
    assert (out / "records.jsonl").read_text() == before
    assert again["backends"] == first["backends"] | {
        k: {**v, "seconds": again["backends"][k]["seconds"]} for k, v in first["backends"].items()
    }


def test_existing_records_without_resume_are_refused(measured):
    out, _ = measured
    with pytest.raises(RopeExtendError, match="already holds a card's records"):
        card("bundled", out, method="yarn", scaling_kwargs={"factor": 4}, options=CardOptions(**SMALL, engine=False))


def test_cli_bad_option_is_one_line_exit_2(tmp_path, capsys):
    assert (
        main(["card", "bundled", "--method", "yarn", "--factor", "4", "--out", str(tmp_path / "c"), "--samples", "0"])
        == 2
    )
    err = capsys.readouterr().err
    assert "samples must be a positive integer" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "args, why",
    [
        (["--method", "yarn", "--factor", "4", "--lengths", "512", "1024"], "needs a length inside L=256"),
        (["--lengths", "128", "256"], "neither patched nor configured"),  # no --method: no scaling
        # L = 256: RULER's budgets capped at L/4 = 64 tokens (card_measurements.answer_budgets), which 60 cannot hold
        (["--method", "yarn", "--factor", "4", "--lengths", "60", "256"], "leaves no prompt for RULER"),
        (["--method", "yarn", "--factor", "4", "--lengths", "160", "256"], "too short for RULER"),
    ],
)
def test_cli_input_refused_after_loading_leaves_no_folder(tmp_path, capsys, args, why):
    """The folder is claimed only once the model, scaling, lengths and texts are checked: a bad input found after
    loading the model leaves nothing behind."""
    code = main(
        ["card", "bundled", *args, "--out", str(tmp_path / "c"), "--samples", "1", "--trials", "1", "--no-engine"]
    )
    assert code == 2
    assert why in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


@pytest.mark.engines
def test_the_served_gguf_agrees_with_transformers(tmp_path):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    result = card("bundled", tmp_path / "c", method="yarn", scaling_kwargs={"factor": 4}, options=CardOptions(**SMALL))
    served = result["backends"]["llama.cpp"]
    assert result["agreement"]["agree"], result["agreement"]
    assert result["agreement"]["perplexity_rel_diff"] < 1e-3
    assert set(served["passkey"]) == {256, 512}
    assert "served in llama.cpp" in (tmp_path / "c" / "card.md").read_text()


@pytest.mark.engines
def test_the_served_gguf_at_some_lengths_only(tmp_path):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    options = CardOptions(**SMALL, engine_lengths=[512])
    result = card("bundled", tmp_path / "c", method="yarn", scaling_kwargs={"factor": 4}, options=options)
    assert set(result["backends"]["llama.cpp"]["passkey"]) == {512} and result["served"]["lengths"] == [512]
    assert result["agreement"]["agree"], result["agreement"]
    assert "the same prompts at 512:" in (tmp_path / "c" / "card.md").read_text()


def test_engine_lengths_outside_the_lengths_are_refused(tmp_path):
    options = CardOptions(**SMALL, engine_lengths=[1024])
    with pytest.raises(RopeExtendError, match=r"engine_lengths \[1024\] are not among the card's lengths \[256, 512\]"):
        card("bundled", tmp_path / "c", method="yarn", scaling_kwargs={"factor": 4}, options=options)
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------------------------------ bad inputs, refused at once
def _planted_card_folder(tmp_path):
    """A card folder as an earlier card left it (its marker), with nothing measured yet."""
    out = tmp_path / "c"
    out.mkdir()
    (out / ".rope-extend").write_text(json.dumps({"kind": "card", "tool": "rope-extend"}))
    return out


def _nothing_loads(monkeypatch):
    import rope_extend.evaluation.card as card_module

    def refuse(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded before the bad input was refused")

    monkeypatch.setattr(card_module, "_model", refuse)
    monkeypatch.setattr(card_module, "load_tokenizer", refuse)


def _snapshot(folder):
    return {
        p.relative_to(folder): (p.is_dir(), p.is_symlink(), p.read_bytes() if p.is_file() else None)
        for p in sorted(folder.rglob("*"))
    }


def _resume_card(out, capsys):
    argv = ["card", "bundled", "--method", "yarn", "--factor", "4", "--out", str(out), "--resume", "--no-engine"]
    code = main([*argv, "--samples", "1", "--trials", "1"])
    return code, capsys.readouterr().err


def test_resume_with_a_folder_for_records_is_refused_before_anything_loads(tmp_path, capsys, monkeypatch):
    out = _planted_card_folder(tmp_path)
    (out / "records.jsonl").mkdir()
    (out / "records.jsonl" / "mine.txt").write_text("a user's file")
    before = _snapshot(out)
    _nothing_loads(monkeypatch)
    code, err = _resume_card(out, capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"{out / 'records.jsonl'} is a folder: it must be the records file rope-extend wrote (or absent)" in err
    assert _snapshot(out) == before


def test_resume_with_records_linked_to_a_users_file_is_refused(tmp_path, capsys, monkeypatch):
    out = _planted_card_folder(tmp_path)
    mine = tmp_path / "notes.jsonl"
    mine.write_text("mine\n")
    (out / "records.jsonl").symlink_to(mine)
    _nothing_loads(monkeypatch)
    code, err = _resume_card(out, capsys)
    assert code == 2 and err.count("\n") == 1
    assert "records.jsonl is a symbolic link: records are appended only to a plain file" in err
    assert mine.read_text() == "mine\n" and (out / "records.jsonl").is_symlink()


def test_resume_with_a_nan_score_names_the_file_and_line_before_anything_loads(tmp_path, capsys, monkeypatch):
    out = _planted_card_folder(tmp_path)
    good = {"task": "ruler", "setting": "abc", "length": 256, "sample": 0, "score": 1.0, "correct": True}
    text = json.dumps(good) + "\n" + json.dumps({**good, "sample": 1, "score": float("nan")}) + "\n"
    (out / "records.jsonl").write_text(text)
    _nothing_loads(monkeypatch)
    code, err = _resume_card(out, capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"{out / 'records.jsonl'}:2: the record's 'score' must be a number in [0, 1], got nan" in err
    assert (out / "records.jsonl").read_text() == text


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """MODEL (a tiny Llama, L = 512, vocabulary 512, and the tiny tokenizer: 467 tokens) and three candidates for its
    --original: the same, one whose embedding holds only 256 ids, one with another tokenizer."""
    from rope_extend.training.data import train_bpe_tokenizer
    from tests.tiny import TOKENIZER_TEXT, tiny_model, tiny_tokenizer

    root = tmp_path_factory.mktemp("originals")
    other = train_bpe_tokenizer(TOKENIZER_TEXT[:2] * 4, 300)
    folders = {}
    for name, vocab, tokenizer in (
        ("model", 512, tiny_tokenizer()),
        ("same", 512, tiny_tokenizer()),
        ("small", 256, tiny_tokenizer()),
        ("other", 512, other),
    ):
        folders[name] = root / name
        tiny_model("llama", vocab_size=vocab, max_position_embeddings=512).save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    return folders


@pytest.mark.parametrize(
    ("original", "why"),
    [
        (
            "small",
            "has a vocabulary of 256 tokens, fewer than the 467 of {model}'s tokenizer, which builds the prompts",
        ),
        ("other", "has another tokenizer (300 tokens) than {model} (467 tokens): retention compares both models on"),
    ],
)
def test_an_original_that_cannot_read_the_prompts_is_refused_before_anything_is_measured(
    tiny_models, tmp_path, capsys, monkeypatch, original, why
):
    import rope_extend.evaluation.card as card_module

    measured = []
    monkeypatch.setattr(card_module, "measure", lambda *a, **k: measured.append(a))
    model = tiny_models["model"]
    argv = ["card", str(model), "--original", str(tiny_models[original]), "--method", "yarn", "--factor", "4"]
    code = main([*argv, "--out", str(tmp_path / "c"), "--samples", "1", "--trials", "1", "--no-engine"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"--original {tiny_models[original]} " + why.format(model=model) in err
    assert measured == [] and not (tmp_path / "c").exists()


def test_an_original_with_the_same_tokenizer_is_measured(tiny_models, tmp_path):
    """A saved copy of MODEL (its own tokenizer files) reads the same prompts: the card measures it inside L."""
    options = CardOptions(
        lengths=[512, 1024], samples=1, trials=2, tasks=["niah_single_1"], answer_tokens=8, docs=1, engine=False
    )
    model, same = str(tiny_models["model"]), str(tiny_models["same"])
    result = card(model, tmp_path / "c", method="yarn", scaling_kwargs={"factor": 2}, original=same, options=options)
    assert result["original"] == same and set(result["backends"]["original"]["passkey"]) == {512}
    assert result["retention"]["perplexity"]["examples"] == 1 and result["retention"]["perplexity"]["ratio"] > 0


def test_a_model_carded_as_configured_is_not_called_a_patch(tmp_path):
    """A model whose config ships its scaling (a fine-tune), carded without --method: card.json says
    ``scaling_from: config`` and card.md names its column "as configured", not "patched"."""
    from tests.tiny import tiny_model, tiny_tokenizer

    folder = tmp_path / "tuned"
    model = tiny_model("llama", vocab_size=512, max_position_embeddings=1024)
    theta = model.config.rope_parameters["rope_theta"]
    model.config.rope_parameters = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": 2.0,
        "original_max_position_embeddings": 512,
    }
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    options = CardOptions(
        lengths=[512, 1024], samples=1, trials=1, tasks=["niah_single_1"], answer_tokens=8, docs=1, engine=False
    )
    result = card(str(folder), tmp_path / "c", options=options)
    text = (tmp_path / "c" / "card.md").read_text()
    assert result["scaling_from"] == "config" and result["scaling"].startswith("yarn (factor 2, L=512, target 1024")
    assert "passkey (as configured)" in text and "(patched)" not in text and ", from the config\n" in text
