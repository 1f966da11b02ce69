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
    assert "average over 1 tasks" in text and "not comparable" in text and "| 512 |" in text


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
        (["--method", "yarn", "--factor", "4", "--lengths", "120", "256"], "leaves no prompt for RULER"),
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
