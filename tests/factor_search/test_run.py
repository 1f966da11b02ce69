"""The LongRoPE search on tiny models: deterministic, exactly resumable, and its result applies everywhere."""

import json

import pytest
import torch

import rope_extend
from rope_extend import RopeExtendError
from rope_extend.factor_search import run as R
from rope_extend.factor_search import state as S
from tests.evaluation.conftest import make_text
from tests.tiny import tiny_config, tiny_model, tiny_tokenizer

L = 64  # trained length of the tiny model; the search targets 2L = 128 tokens


@pytest.fixture(scope="module")
def setup():
    return tiny_model("llama", max_position_embeddings=L), tiny_tokenizer(), [make_text(40, seed=i) for i in range(2)]


def run(setup, **kw):
    model, tok, texts = setup
    options = {"max_evaluations": 10, "population": 4, "seed": 0, "progress": False, **kw}
    return R.search(model, tok, 2.0, texts, **options)


def test_deterministic_under_a_seed_and_better_than_its_seeds(setup):
    model = setup[0]
    with torch.no_grad():
        before = model(torch.arange(3, 40)[None]).logits
    a, b, c = run(setup), run(setup), run(setup, seed=1)
    assert a.long_factor == b.long_factor and a.history == b.history and a.evaluations == 10
    assert c.history != a.history
    assert set(a.seeds) == {"linear", "ntk", "yarn"}
    assert a.fitness <= min(a.seeds.values())  # elitism: never worse than the best seed
    assert [h[2] for h in a.history] == sorted((h[2] for h in a.history), reverse=True)  # best so far only falls
    assert rope_extend.patched(model) is None
    with torch.no_grad():
        assert torch.equal(model(torch.arange(3, 40)[None]).logits, before)  # the model is left as it was


def test_resume_after_an_interruption_ends_where_an_uninterrupted_search_does(setup, tmp_path, monkeypatch):
    whole = run(setup, max_evaluations=12)
    real, calls = R.window_nll, {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2 * 7 + 1:  # two texts per evaluation: dies inside the 8th evaluation
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(R, "window_nll", flaky)
    with pytest.raises(KeyboardInterrupt):
        run(setup, max_evaluations=12, out=tmp_path / "s")
    monkeypatch.setattr(R, "window_nll", real)
    state = json.loads((tmp_path / "s" / R.STATE).read_text())
    assert len(state["history"]) == 7  # saved after each finished evaluation
    assert len(state["pending"]) == 1  # the rest of generation 2, kept for the resume
    assert rope_extend.patched(setup[0]) is None  # unpatched even when interrupted
    resumed = run(setup, max_evaluations=12, out=tmp_path / "s", resume=True)
    assert resumed.long_factor == whole.long_factor and resumed.history == whole.history
    files = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert files == [
        ".rope-extend",
        ".rope-extend.lock",
        "longrope.json",
        "report.md",
        "search.png",
        "search_state.json",
    ]
    with pytest.raises(RopeExtendError, match=r"other settings \(seed: 0 there, 5 now\)"):
        run(setup, max_evaluations=12, out=tmp_path / "s", resume=True, seed=5)
    with pytest.raises(RopeExtendError, match="--resume"):
        run(setup, out=tmp_path / "s")  # an earlier search is never replaced without asking


def test_a_larger_budget_on_resume_continues_the_same_sequence(setup, tmp_path):
    # 9 evaluations stop inside generation 3 (4 + 2 + 2 + 1 of 2): the unevaluated candidate stays pending
    whole = run(setup, max_evaluations=12)
    first = run(setup, max_evaluations=9, out=tmp_path / "s")
    assert first.history == whole.history[:9]
    assert len(json.loads((tmp_path / "s" / R.STATE).read_text())["pending"]) == 1
    resumed = run(setup, max_evaluations=12, out=tmp_path / "s", resume=True)
    assert resumed.history == whole.history and resumed.long_factor == whole.long_factor


def test_a_resume_with_the_budget_spent_writes_the_result_without_evaluating(setup, tmp_path, monkeypatch):
    # a search killed between evaluations has its state but no result: a resume with --evals at the number
    # done writes longrope.json and the report from the state, evaluating nothing
    first = run(setup, max_evaluations=9, out=tmp_path / "s")
    for name in (R.RESULT, "report.md", "search.png"):
        (tmp_path / "s" / name).unlink()

    def no_evaluation(*args, **kwargs):
        raise AssertionError("evaluated although the budget was spent")

    monkeypatch.setattr(R, "window_nll", no_evaluation)
    again = run(setup, max_evaluations=9, out=tmp_path / "s", resume=True)
    assert again.history == first.history and again.long_factor == first.long_factor
    assert json.loads((tmp_path / "s" / R.RESULT).read_text())["evaluations"] == 9
    assert rope_extend.patched(setup[0]) is None


def test_a_time_budget_stops_after_the_seeds_and_resumes(setup, tmp_path):
    short = run(setup, max_evaluations=None, max_seconds=1e-9, out=tmp_path / "s")
    assert short.evaluations == 3 and set(short.seeds) == {"linear", "ntk", "yarn"}  # the seeds, then the clock
    state = json.loads((tmp_path / "s" / R.STATE).read_text())
    assert len(state["pending"]) == 1  # generation 0's fourth candidate
    resumed = run(setup, max_evaluations=10, out=tmp_path / "s", resume=True)
    assert resumed.history == run(setup, max_evaluations=10).history


def test_the_result_patches_configures_and_reloads_in_plain_transformers(setup, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok, texts = setup
    result = run(setup, max_evaluations=6)
    saved = json.loads(json.dumps(result.rope_parameters()))
    assert saved["rope_type"] == "longrope" and len(saved["long_factor"]) == 8
    ids = torch.tensor(tok(texts[0])["input_ids"][:128])[None]
    rope_extend.patch(model, "longrope", **result.patch_kwargs())
    try:
        with torch.no_grad():
            patched = model(ids).logits
    finally:
        rope_extend.unpatch(model)
    config = tiny_config("llama", max_position_embeddings=L)
    rope_extend.configure(config, "longrope", **result.patch_kwargs())
    plain = type(model)(config).eval()
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(tmp_path / "m")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert reloaded.config.rope_parameters["long_factor"] == result.long_factor
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, patched, atol=1e-5, rtol=1e-5)


def test_seeds_keep_their_names_when_two_give_the_same_factors(setup, monkeypatch):
    plain = run(setup, max_evaluations=4)
    real = R.seed_factors
    monkeypatch.setattr(R, "seed_factors", lambda name, *a: real("linear" if name == "ntk" else name, *a))
    merged = run(setup, max_evaluations=4)
    # NTK's factors are PI's here: both names get PI's fitness, YaRN keeps its own (not a mutation's)
    assert merged.seeds == {"linear": plain.seeds["linear"], "ntk": plain.seeds["linear"], "yarn": plain.seeds["yarn"]}
    assert merged.evaluations == 4 and plain.seeds["ntk"] != plain.seeds["linear"]


@pytest.mark.parametrize(("kw", "match"), [
    ({"max_evaluations": None}, "needs a budget"),
    ({"max_evaluations": 0}, "integer >= 3"),
    ({"max_evaluations": 2}, r"integer >= 3 \(the linear, ntk, yarn seeds are evaluated first\), got 2"),
    ({"max_seconds": -1.0}, "positive number"),
    ({"population": 3}, "population must be"),
])  # fmt: skip
def test_bad_options(setup, kw, match):
    with pytest.raises(RopeExtendError, match=match):
        run(setup, **kw)


def test_bad_texts_and_models(setup, tmp_path):
    model, tok, _ = setup
    with pytest.raises(RopeExtendError, match="needs texts"):
        R.search(model, tok, 2.0, ["", "  "], max_evaluations=4)
    with pytest.raises(RopeExtendError, match="no text reaches the target length 128"):
        R.search(model, tok, 2.0, ["short text."], max_evaluations=4)
    with pytest.raises(RopeExtendError, match="extension factor > 1"):
        R.search(model, tok, 1.0, [make_text(40)], max_evaluations=4)
    with pytest.raises(RopeExtendError, match="resume: no search state"):
        run(setup, out=tmp_path / "none", resume=True)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(RopeExtendError, match="mine"):
        run(setup, out=tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    rope_extend.patch(model, "yarn", factor=2)
    try:
        with pytest.raises(RopeExtendError, match="already patched"):
            run(setup)
    finally:
        rope_extend.unpatch(model)


def test_command_line_on_the_bundled_model(tmp_path, capsys):
    from rope_extend.cli import main

    out = tmp_path / "search"
    args = ["search", "--model", "bundled", "--factor", "2", "--evals", "6", "--population", "4", "--out", str(out)]
    assert main([*args, "--no-progress"]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["evaluations"] == 6 and first["fitness"] <= min(first["seeds"].values())
    assert main([*args[:6], "8", *args[7:], "--resume", "--no-progress"]) == 0
    result = json.loads((out / "longrope.json").read_text())
    assert result["evaluations"] == 8 and result["rope_type"] == "longrope" and len(result["long_factor"]) == 32
    assert "searched" in (out / "report.md").read_text()


DAMAGED_STATES = {
    "truncated": lambda text: text[: len(text) // 2].encode(),
    "empty": lambda text: b"",
    "not UTF-8": lambda text: b"\xff\xfe" + text.encode()[2:],
    "a list": lambda text: b"[]",
    "no rng": lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "rng"}).encode(),
    "pool a string": lambda text: json.dumps({**json.loads(text), "pool": "oops"}).encode(),
    "short factors": lambda text: json.dumps({**json.loads(text), "pending": [[1.0]]}).encode(),
    "rng of strings": lambda text: json.dumps({**json.loads(text), "rng": [3, ["x"] * 625, None]}).encode(),
}
DAMAGE_MESSAGES = {
    "truncated": "not valid JSON",
    "empty": "not valid JSON",
    "not UTF-8": "not UTF-8",
    "a list": "a JSON list, not an object",
    "no rng": "no 'rng'",
    "pool a string": "'pool' is not a list",
    "short factors": "'pending' is not a list of 32 factors",
    "rng of strings": "'rng' is not a random generator's state",
}


@pytest.fixture(scope="module")
def saved_search(tmp_path_factory):
    from rope_extend.cli import main

    out = tmp_path_factory.mktemp("search") / "s"
    args = ["search", "--model", "bundled", "--factor", "2", "--evals", "4", "--population", "4", "--out", str(out)]
    assert main([*args, "--no-progress"]) == 0
    return args, out


@pytest.mark.parametrize("damage", list(DAMAGED_STATES))
def test_a_damaged_state_is_one_line_exit_2(saved_search, damage, capsys):
    from rope_extend.cli import main

    args, out = saved_search
    path = out / R.STATE
    good = path.read_text(encoding="utf-8")
    try:
        path.write_bytes(DAMAGED_STATES[damage](good))
        capsys.readouterr()
        assert main([*args, "--resume", "--no-progress"]) == 2
        err = capsys.readouterr().err  # transformers' "Loading weights" bar comes first
        message = err.strip().splitlines()[-1]
        assert "Traceback" not in err and message.startswith("rope-extend: error: resume:") and str(path) in message
        assert DAMAGE_MESSAGES[damage] in message, message
    finally:
        path.write_text(good, encoding="utf-8")
    assert main([*args[:6], "5", *args[7:], "--resume", "--no-progress"]) == 0  # the good state resumes


@pytest.mark.parametrize(
    ("plant", "said"),
    [
        ("link", "is a symbolic link: rope-extend never reads a file it wrote through a link"),
        ("fifo", "is a named pipe, not a regular file"),
        ("huge", f"is larger than {S.MAX_STATE} bytes"),
    ],
)
def test_a_state_that_is_not_the_file_the_search_wrote_is_one_line(saved_search, tmp_path, capsys, plant, said):
    """The state is read as hostile (``untrusted``): a link (here to the search's own state, copied elsewhere) is
    never read through, a named pipe is not waited on, a huge file is not read; the search resumes after."""
    import os
    import shutil

    from rope_extend.cli import main

    args, out = saved_search
    path = out / R.STATE
    kept = tmp_path / "kept.json"
    shutil.copy(path, kept)
    path.unlink()
    if plant == "link":
        path.symlink_to(kept)
    elif plant == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(b"")
        os.truncate(path, S.MAX_STATE + 1)
    try:
        capsys.readouterr()
        assert main([*args, "--resume", "--no-progress"]) == 2
        message = capsys.readouterr().err.strip().splitlines()[-1]
        assert message.startswith(f"rope-extend: error: resume: the search state {path} {said}"), message
        assert message.endswith("start the search again into a new --out, or with --overwrite")
    finally:
        path.unlink()
        shutil.copy(kept, path)
    assert main([*args[:6], "6", *args[7:], "--resume", "--no-progress"]) == 0


# ------------------------------------------------------------------------------------------ LongRoPE2
@pytest.fixture(scope="module")
def needle_setup(setup):
    return setup[0], setup[1], [make_text(40, seed=i) for i in range(2)]


def needle_run(setup, **kw):
    model, tok, texts = setup
    options = {"max_evaluations": 10, "population": 4, "seed": 0, "progress": False, "fitness": "needle", **kw}
    return R.search(model, tok, 4.0, texts, **options)  # 4 x 64 = 256 tokens: RULER's prompt fits


def test_the_needle_fitness_is_the_perplexity_of_the_answer_tokens_alone(needle_setup):
    import math

    import torch.nn.functional as F

    from rope_extend.factor_search import evolution, needles

    model, tok, texts = needle_setup
    result = needle_run(needle_setup, max_evaluations=3)
    assert result.objective == "needle" and result.critical == 6  # head dimension 16, base 10000, L 64: 2.02 -> 3 pairs
    docs = needles.needle_documents(tok, texts, 256, seed=0)
    space = evolution.Space.for_factor(8, 4.0)
    factors = evolution.repair(space, R.seed_factors("yarn", 16, 10000.0, 4.0, L))
    rope_extend.patch(model, "longrope", factor=4.0, short_factor=[1.0] * 8, long_factor=factors)
    total = count = 0
    try:
        with torch.no_grad():
            for ids, start in docs:
                logits = model(torch.tensor(ids)[None]).logits[0]  # the model's own logits, every position
                targets = torch.tensor(ids[start:])
                total += float(F.cross_entropy(logits[start - 1 : -1], targets, reduction="sum"))
                count += len(targets)
    finally:
        rope_extend.unpatch(model)
    assert count < 6 * 16  # answers only, never the haystack
    assert result.seeds["yarn"] == pytest.approx(math.exp(total / count), rel=1e-5)
    text = run(needle_setup, max_evaluations=3)
    assert text.seeds["yarn"] != pytest.approx(result.seeds["yarn"], rel=1e-3)


def test_a_needle_search_resumes_exactly_and_refuses_another_fitness(needle_setup, tmp_path, monkeypatch):
    whole = needle_run(needle_setup, max_evaluations=8)
    real, calls = R.window_nll, {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6 * 5 + 2:  # six needle documents per evaluation: dies inside the 6th
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(R, "window_nll", flaky)
    with pytest.raises(KeyboardInterrupt):
        needle_run(needle_setup, max_evaluations=8, out=tmp_path / "s")
    monkeypatch.setattr(R, "window_nll", real)
    state = json.loads((tmp_path / "s" / R.STATE).read_text())
    assert len(state["history"]) == 5 and state["settings"]["fitness"] == "needle"
    with pytest.raises(
        RopeExtendError, match=r"run with fitness 'needle', not 'text': resume it with --fitness needle"
    ):
        needle_run(needle_setup, max_evaluations=8, out=tmp_path / "s", resume=True, fitness="text")
    resumed = needle_run(needle_setup, max_evaluations=8, out=tmp_path / "s", resume=True)
    assert resumed.history == whole.history and resumed.long_factor == whole.long_factor
    saved = json.loads((tmp_path / "s" / R.RESULT).read_text())
    assert saved["settings"]["fitness"] == "needle" and saved["critical_dimension"] == 6
    assert "answer tokens" in (tmp_path / "s" / "report.md").read_text()


def test_a_state_saved_before_fitness_was_recorded_resumes_as_a_text_search(setup, tmp_path):
    whole = run(setup, max_evaluations=12)
    run(setup, max_evaluations=9, out=tmp_path / "s")
    path = tmp_path / "s" / R.STATE
    state = json.loads(path.read_text())
    assert (state["settings"].pop("fitness"), state["settings"].pop("space")) == ("text", "longrope")
    path.write_text(json.dumps(state))  # as the search wrote it before --fitness and --space
    resumed = run(setup, max_evaluations=12, out=tmp_path / "s", resume=True)
    assert resumed.history == whole.history
    with pytest.raises(RopeExtendError, match=r"other settings \(space: 'longrope' there, 'longrope2' now\)"):
        run(setup, max_evaluations=12, out=tmp_path / "s", resume=True, space="longrope2")


def test_the_longrope2_bounds_hold_every_candidate(setup):
    result = run(setup, max_evaluations=10, space="longrope2")  # critical pair 3 of 8 (dimension 6 of 16)
    assert result.evaluations == 10 and result.critical == 6
    # from the critical pair on in [s, 2 s] (LongRoPE2's search space), below it NTK scaling from its factor
    top = result.long_factor[3]
    assert all(2.0 <= f <= 4.0 for f in result.long_factor[3:])
    assert result.long_factor[:3] == pytest.approx([top ** (i / 3) for i in range(3)], abs=1e-6)
    assert result.history != run(setup, max_evaluations=10).history  # other bounds, other candidates
    with pytest.raises(RopeExtendError, match="space must be one of longrope, longrope2, got 'yarn'"):
        run(setup, space="yarn")


def test_command_line_needle_search_on_the_bundled_model(tmp_path, capsys):
    from rope_extend.cli import main

    out = tmp_path / "search"
    args = ["search", "--model", "bundled", "--factor", "2", "--evals", "4", "--population", "4", "--out", str(out),
            "--fitness", "needle", "--space", "longrope2", "--no-progress"]  # fmt: skip
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "critical dimension (LongRoPE2): 34 of 64 (frequency pair 17; rotary base 1600, trained length 256)" in (
        captured.err
    )
    last = json.loads(captured.out.strip().splitlines()[-1])
    assert last["objective"] == "needle" and last["critical_dimension"] == 34 and last["evaluations"] == 4
    result = json.loads((out / "longrope.json").read_text())
    assert all(f >= 2.0 for f in result["long_factor"][17:]) and all(f <= 2.0 for f in result["long_factor"][:17])
    assert main([*args[:-1], "--fitness", "text", "--resume", "--no-progress"]) == 2
    assert "was run with fitness 'needle', not 'text'" in capsys.readouterr().err


def test_the_multiquery_fitness_is_the_perplexity_of_one_document_s_answers(needle_setup):
    import math

    import torch.nn.functional as F

    from rope_extend.factor_search import evolution, needles

    model, tok, texts = needle_setup
    options = {"population": 4, "progress": False, "fitness": "needle-multiquery"}  # 16 x 64 = 1024 tokens
    result = R.search(model, tok, 16.0, texts, max_evaluations=3, **options)
    assert result.objective == "needle-multiquery"
    [(ids, start)] = needles.multiquery_documents(tok, texts, 1024, seed=0)
    factors = evolution.repair(evolution.Space.for_factor(8, 16.0), R.seed_factors("ntk", 16, 10000.0, 16.0, L))
    rope_extend.patch(model, "longrope", factor=16.0, short_factor=[1.0] * 8, long_factor=factors)
    try:
        with torch.no_grad():
            logits = model(torch.tensor(ids)[None]).logits[0]
    finally:
        rope_extend.unpatch(model)
    nll = F.cross_entropy(logits[start - 1 : -1], torch.tensor(ids[start:]), reduction="mean")
    assert len(ids) - start > 5 * 7  # five 7-digit values
    assert result.seeds["ntk"] == pytest.approx(math.exp(float(nll)), rel=1e-5)


def test_a_critical_pair_given_moves_the_split_and_is_part_of_the_settings(setup, tmp_path):
    result = run(setup, max_evaluations=6, space="longrope2", critical_pair=2, out=tmp_path / "s")
    top = result.long_factor[2]  # searched in [s, 2 s] from pair 2 on (the computed split is pair 3)
    assert all(2.0 <= f <= 4.0 for f in result.long_factor[2:])
    assert result.long_factor[:2] == pytest.approx([top ** (i / 2) for i in range(2)], abs=1e-6)
    assert result.critical == 6  # the computed one, still reported
    assert json.loads((tmp_path / "s" / R.RESULT).read_text())["settings"]["critical_pair"] == 2
    with pytest.raises(RopeExtendError, match=r"other settings \(critical_pair: 2 there, None now\)"):
        run(setup, max_evaluations=8, space="longrope2", out=tmp_path / "s", resume=True)
    resumed = run(setup, max_evaluations=8, space="longrope2", critical_pair=2, out=tmp_path / "s", resume=True)
    assert resumed.history[:6] == result.history
    with pytest.raises(RopeExtendError, match="the longrope space has no split"):
        run(setup, critical_pair=2)
    with pytest.raises(RopeExtendError, match=r"critical_pair must be an integer >= 0 and < 8 .*, got 8"):
        run(setup, space="longrope2", critical_pair=8)
    with pytest.raises(RopeExtendError, match=r"critical_pair must be an integer >= 0, got -1"):
        run(setup, space="longrope2", critical_pair=-1)
