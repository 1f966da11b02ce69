"""``rope-extend card MODEL --method M --factor S --out DIR`` on the first try (``evaluation.card_measurements``): every
check made before the first measurement; defaults that fit the model, each task, length or step left out named in
one line with why; what was given measured exactly or refused."""

from __future__ import annotations

import json

import pytest

import rope_extend.evaluation.card as card_module
from rope_extend.cli import main
from rope_extend.errors import RopeExtendError
from rope_extend.evaluation import card_measurements
from rope_extend.evaluation.card_options import CardOptions
from rope_extend.evaluation.card_writing import figure, markdown
from rope_extend.loading import load_model, load_tokenizer
from rope_extend.patching import patch

NIAH = [f"niah_single_{i}" for i in (1, 2, 3)] + [f"niah_multikey_{i}" for i in (1, 2, 3)]
MORE = ["niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe"]
SERVED = "the served rows: llama-cpp-python not installed: pip install 'rope-extend[llama]', which builds llama.cpp"


@pytest.fixture
def no_llama_cpp(monkeypatch):
    """The served step's engine missing, wherever the tests run (CI's engines step has it)."""
    monkeypatch.setattr(card_measurements, "missing_serve_packages", lambda: ["llama-cpp-python"])


def _left_out(err: str) -> list[str]:
    return [line.removeprefix("rope-extend card: leaves out ") for line in err.splitlines() if "leaves out" in line]


@pytest.mark.slow
def test_the_default_card_of_the_bundled_model_runs_on_the_first_try(tmp_path, capsys, no_llama_cpp):
    """L = 256: RULER's answer budgets capped at L/4 = 64 tokens, niah_single_1 and niah_single_2 fit inside L
    (the others need more: vt 774 tokens, cwe 1262), so RULER runs with those two at L, 2L and 4L and retention
    and the relative effective length are measured at L. Said before the first bar, written into the card."""
    out = tmp_path / "c"
    assert main(["card", "bundled", "--method", "yarn", "--factor", "4", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    left = _left_out(err)
    assert left[0] == SERVED + " from source in minutes" and len(left) == 10
    assert [line.split(":")[0] for line in left[1:]] == [f"RULER task {t}" for t in NIAH[2:] + MORE]
    assert left[-3] == (
        "RULER task vt: length 256 is too short for RULER task vt: its smallest prompt already takes 744 tokens of "
        "this tokenizer, and 30 more are generated; use lengths >= 774"
    )
    assert left[1].endswith(
        "its smallest prompt already takes 207 tokens of this tokenizer, and 64 more are generated; use lengths >= 271"
    )
    assert err.index("leaves out") < err.index("ruler yarn")  # before anything is measured
    data = json.loads((out / "card.json").read_text())
    assert data["lengths"] == data["ruler_lengths"] == [256, 512, 1024]
    assert data["ruler_tasks"] == NIAH[:2] and data["answer_tokens"] == dict.fromkeys(NIAH[:2], 64)
    assert set(data["backends"]["transformers"]["ruler"]) == {"256", "512", "1024"}
    assert set(data["backends"]["original"]["ruler"]) == {"256"} and "ruler" in data["retention"]
    assert data["backends"]["transformers"]["effective"]["reference_length"] == 256
    text = (out / "card.md").read_text()
    assert (
        "RULER: average over 2 tasks: niah_single_1, niah_single_2 (5 samples each; answer tokens: RULER's per " in text
    )
    assert "capped at L/4 = 64" in text and "Left out (decided before measuring):" in text
    assert "- RULER task vt: length 256 is too short" in text
    assert {p.name for p in out.iterdir()} >= {"card.md", "card.json", "card.png", "records.jsonl"}


def test_the_default_card_of_a_tiny_saved_model_runs_on_the_first_try(tmp_path, capsys, no_llama_cpp):
    """A saved model whose context (128) holds no RULER prompt with its answer budget: the card leaves RULER out
    at both lengths, says so, and measures passkey and perplexity."""
    from tests.tiny import tiny_model, tiny_tokenizer

    saved = tmp_path / "tiny"
    tiny_model("llama", max_position_embeddings=128).save_pretrained(saved)
    tiny_tokenizer().save_pretrained(saved)
    out = tmp_path / "c"
    assert main(["card", str(saved), "--method", "yarn", "--factor", "2", "--out", str(out)]) == 0
    left = _left_out(capsys.readouterr().err)
    assert left[0].startswith(SERVED) and len(left) == 3
    # RULER's budgets capped at L/4 = 32 tokens: niah_single_1's smallest prompt (242) still fits neither length
    assert left[1].startswith("RULER at 128: no task fits (length 128 is too short for RULER task niah_single_1")
    assert left[2].startswith("RULER at 256: no task fits (length 256 is too short for RULER task niah_single_1")
    data = json.loads((out / "card.json").read_text())
    assert data["ruler_lengths"] == [] and data["ruler_tasks"] == [] and data["lengths"] == [128, 256]
    assert set(data["backends"]["transformers"]["passkey"]) == {"128", "256"}
    assert set(data["backends"]["transformers"]["perplexity"]) == {"128", "256"}
    text = (out / "card.md").read_text()
    assert "RULER: not measured (see what is left out)" in text
    assert "Effective length: not measured (no RULER task was measured)." in text


# ------------------------------------------------------------------ the measurements alone: nothing is measured here
@pytest.fixture(scope="module")
def bundled():
    model = load_model("bundled", attn_implementation="sdpa")
    patch(model, "yarn", factor=4)
    return model, load_tokenizer("bundled")


def test_lengths_no_text_reaches_are_left_out_for_perplexity_only(bundled, tmp_path):
    model, tok = bundled
    short = tmp_path / "short.txt"
    short.write_text("The grass is green and the sky is blue. " * 60)  # about 600 tokens
    measurements = card_measurements.decide_measurements(
        model, tok, "bundled", CardOptions(text=str(short), engine=False)
    )
    assert measurements.lengths == [256, 512, 1024] and measurements.perplexity_lengths == [256, 512]
    assert any(line.startswith("perplexity at 1024: no text of ") for line in measurements.left_out)
    with pytest.raises(RopeExtendError, match="reaches 1024 tokens .the longest has 6.."):
        card_measurements.decide_measurements(
            model, tok, "bundled", CardOptions(text=str(short), lengths=[256, 1024], engine=False)
        )


def test_given_tasks_start_ruler_where_they_all_fit_or_are_refused(bundled):
    model, tok = bundled
    measurements = card_measurements.decide_measurements(
        model, tok, "bundled", CardOptions(tasks=["vt", "niah_single_1"], engine=False)
    )
    assert measurements.ruler_lengths == [1024] and measurements.tasks == ["vt", "niah_single_1"]
    assert [line.split(" (")[0] for line in measurements.left_out] == [
        "RULER at 256: no given task fits",
        "RULER at 512: no given task fits",
    ]
    with pytest.raises(
        RopeExtendError,
        match=r"length 1024 is too short for RULER task cwe: .* 64 more are generated; use lengths >= 1264$",
    ):
        card_measurements.decide_measurements(model, tok, "bundled", CardOptions(tasks=["cwe"], engine=False))


def test_given_lengths_are_measured_at_every_length_or_refused(bundled):
    model, tok = bundled
    with pytest.raises(RopeExtendError, match="length 200 is too short for RULER task niah_single_1: .* >= 244$"):
        card_measurements.decide_measurements(model, tok, "bundled", CardOptions(lengths=[200, 512], engine=False))
    measurements = card_measurements.decide_measurements(
        model, tok, "bundled", CardOptions(lengths=[256, 512], answer_tokens=32, engine=False)
    )
    assert measurements.budgets == dict.fromkeys(measurements.tasks, 32)
    assert measurements.ruler_lengths == [256, 512] and measurements.tasks == [
        "niah_single_1",
        "niah_single_2",
        "niah_single_3",
        "niah_multikey_2",
    ]
    assert "RULER task fwe: length 256 is too short for RULER task fwe: " in measurements.left_out[-1]


def test_a_length_out_of_memory_is_left_out_by_default_and_refused_when_given(bundled, monkeypatch):
    model, tok = bundled

    def reachable(model, length, *, cache, generated=0):
        if length > 512:
            raise RopeExtendError(f"length {length} cannot be reached on cpu: (a test's limit)")

    monkeypatch.setattr(card_measurements, "check_reachable", reachable)
    measurements = card_measurements.decide_measurements(model, tok, "bundled", CardOptions(engine=False))
    assert measurements.lengths == [256, 512] and measurements.left_out[0] == (
        "length 1024: length 1024 cannot be reached on cpu: (a test's limit)"
    )
    with pytest.raises(RopeExtendError, match="length 1024 cannot be reached"):
        card_measurements.decide_measurements(model, tok, "bundled", CardOptions(lengths=[256, 1024], engine=False))


def test_engine_asked_for_without_llama_cpp_is_refused_before_anything_loads(
    tmp_path, capsys, monkeypatch, no_llama_cpp
):
    def refuse(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded before the bad input was refused")

    monkeypatch.setattr(card_module, "_model", refuse)
    monkeypatch.setattr(card_module, "load_tokenizer", refuse)
    argv = ["card", "bundled", "--method", "yarn", "--factor", "4", "--out", str(tmp_path / "c"), "--engine"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (
        "--engine: the served step needs llama-cpp-python, not installed here: pip install 'rope-extend[llama]'" in err
    )
    assert not (tmp_path / "c").exists()


def test_the_wording_counts_tasks_and_the_figure_names_lines_as_the_table(tmp_path):
    """'1 task' / '9 tasks'; the figure's legend names each backend as the table's columns do (``SHOWN``), the
    original too when it has no RULER point (RULER starting past L)."""
    backend = {
        "ruler": {},
        "passkey": {"256": 1.0},
        "passkey_interval": {"256": [0.7, 1.0]},
        "perplexity": {"256": 2.0},
    }
    patched = {**backend, "ruler": {"512": 10.0}, "ruler_tasks": 1, "effective": None}
    card = {
        "model": "m",
        "scaling": "yarn x4",
        "original_length": 256,
        "target_length": 1024,
        "lengths": [256, 512],
        "ruler_tasks": ["fwe"],
        "left_out": [],
        "options": {"samples": 5, "trials": 10},
        "backends": {"transformers": patched, "original": backend},
        "retention": {},
        "served": None,
        "hardware": {"cpu": "x", "cores": 2},
        "seconds": 1.0,
    }
    text = markdown(card)
    assert "RULER: average over 1 task: fwe (5 samples each;" in text and "(patched)" in text
    assert markdown({**card, "ruler_tasks": ["fwe", "vt"]}).count("average over 2 tasks: fwe, vt (") == 1
    assert figure(card, tmp_path / "card.png") == ["patched", "original"]
    # a model measured with the scaling its config ships (a fine-tune) is no patch: its column and title say so
    configured = markdown({**card, "scaling_from": "config"})
    assert "passkey (as configured)" in configured and "(patched)" not in configured
    assert configured.startswith("### Long context: m, yarn x4, from the config\n")
    assert figure({**card, "scaling_from": "config"}, tmp_path / "c.png") == ["as configured", "original"]


def test_ruler_budgets_are_capped_at_a_quarter_of_L_and_must_hold_the_answers(bundled, monkeypatch):
    from rope_extend.evaluation.ruler import GENERATE

    assert card_measurements.answer_budgets(256, None) == {**dict.fromkeys(GENERATE, 64), "vt": 30, "fwe": 50}
    assert card_measurements.answer_budgets(512, None) == card_measurements.answer_budgets(8192, None) == GENERATE
    assert card_measurements.answer_budgets(256, 16) == dict.fromkeys(GENERATE, 16)
    # a budget too small for a task's answer (a UUID: 36 tokens) leaves the task out rather than cut the answer
    monkeypatch.setattr(card_measurements, "answer_budgets", lambda original, given: dict.fromkeys(GENERATE, 8))
    model, tok = bundled
    measurements = card_measurements.decide_measurements(
        model, tok, "bundled", CardOptions(tasks=None, engine=False, lengths=[256, 512])
    )
    assert "niah_single_1" in measurements.tasks and "niah_single_3" not in measurements.tasks
    assert (
        "RULER task niah_single_3: the answers of RULER task niah_single_3 take 36 tokens of this tokenizer, more "
        "than the 8 it may generate (RULER's 128, capped at L/4 on this model)"
    ) in measurements.left_out
