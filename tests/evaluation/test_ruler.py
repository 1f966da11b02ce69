import copy
import importlib
import json
import re

import pytest

from rope_extend import RopeExtendError, loading
from rope_extend.cli import main
from rope_extend.evaluation import retrieval, ruler
from rope_extend.evaluation.compare import run_suite
from rope_extend.evaluation.report import markdown, summarize
from rope_extend.evaluation.suite import parse_suite
from tests.evaluation.conftest import make_text

R = importlib.import_module("rope_extend.evaluation.ruler")  # the module (the package exports the function)

pytestmark = pytest.mark.skipif(not loading.bundled_available(), reason="the bundled model is not installed")

# every task at a length its prompt and its tokens to generate fit with the bundled tokenizer (vocab 1024: several
# tokens per word), and longer
LENGTHS = {
    "niah_single_1": [384, 905],
    "niah_single_2": [384, 905],
    "niah_single_3": [640, 1128],
    "niah_multikey_1": [640, 1128],
    "niah_multikey_2": [384, 905],
    "niah_multikey_3": [640, 1128],
    "niah_multivalue": [640, 1128],
    "niah_multiquery": [640, 1128],
    "vt": [1054, 1530],
    "cwe": [1536, 2048],
    "fwe": [562, 1050],
}


@pytest.fixture(scope="module")
def tok():
    return loading.load_tokenizer("bundled")


@pytest.fixture(scope="module")
def model():
    return loading.load_model("bundled")


@pytest.fixture(scope="module")
def essay():
    return [make_text(400, seed=i) for i in range(3)]


@pytest.mark.parametrize("task", R.TASKS)
def test_prompts_fill_the_budget_as_ruler_and_hold_every_answer(tok, essay, task):
    """RULER's length and sizing: the haystack is sized once per task and length on one draw (the most units that
    fit; one more would not; fwe steps by RULER's coarse budget // 32 words), and each sample takes that size less
    the fewest of RULER's steps that make its own draw fit."""
    hay = R.Haystack(essay)
    fmt = R.PromptFormat(tok)
    for length in LENGTHS[task]:
        budget = length - R.GENERATE[task]
        draft, _, _ = R._draft_fn(task, length, budget, hay, tok)

        def tokens(sample, n, draft=draft, length=length):
            return len(fmt.ids(draft(R.sample_rng(task, 3, length, sample)(), n)))

        grow = max(1, budget // 32) if task == "fwe" else 1
        step = R.ruler_step(task, length, budget)
        for sample in range(2):
            p = R.build_prompt(tok, task, length, seed=3, sample=sample, haystack=hay)
            sized = p.sized
            assert p.budget == budget and len(p.input_ids) <= budget and p.units <= sized
            if sized - step >= 1:  # RULER's step (halved only where it would leave no haystack)
                assert (sized - p.units) % step == 0, (task, length, sized, p.units, step)
            if (
                p.units < sized and p.units + step <= sized
            ):  # dropped: one step more would overflow this sample's own draw
                assert tokens(sample, p.units + step) > budget
            text = tok.decode(p.input_ids)
            head, _, tail = text.rpartition("\n")
            assert p.answers and all(a in head for a in p.answers), (task, p.answers)
            assert p.units >= 1
        assert tokens(-1, sized) <= budget < tokens(-1, sized + grow), (task, length, sized)
    # the answer prefix ends the prompt
    prefix = {"vt": "they are:", "cwe": "in the list are:", "fwe": "words are:"}.get(task, "provided text")
    assert prefix in tail


def test_answers_and_templates_follow_ruler(tok, essay):
    hay = R.Haystack(essay)
    single = tok.decode(R.build_prompt(tok, "niah_single_1", 512, haystack=hay).input_ids)
    assert single.startswith("A special magic number is hidden within the following text.")
    assert re.search(
        r"\nWhat is the special magic number for [a-z]+-[a-z]+ mentioned in the provided text\? "
        r"The special magic number for [a-z]+-[a-z]+ mentioned in the provided text is$",
        single,
    )
    assert re.search(r"One of the special magic numbers for [a-z]+-[a-z]+ is: \d{7}\.", single)  # needle: plural
    mv = R.build_prompt(tok, "niah_multivalue", 1000, haystack=hay)
    assert len(mv.answers) == 4 and all(re.fullmatch(r"\d{7}", a) for a in mv.answers)
    assert "What are all the special magic numbers for" in tok.decode(mv.input_ids)
    mq = R.build_prompt(tok, "niah_multiquery", 1000, haystack=hay)
    assert len(mq.answers) == 4 and ", and " in tok.decode(mq.input_ids).rsplit("\n", 1)[1]
    mk = R.build_prompt(tok, "niah_multikey_1", 1000, haystack=hay)
    mk_text = tok.decode(mk.input_ids)
    needles = re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.", mk_text)
    assert len({k for k, _ in needles}) == 4 and len(mk.answers) == 1  # four keys, one asked for
    asked = mk_text.rsplit("\n", 1)[1]
    assert [v for k, v in needles if k in asked] == mk.answers
    s3 = R.build_prompt(tok, "niah_single_3", 1000, haystack=hay)
    assert "special magic uuid for" in tok.decode(s3.input_ids).rsplit("\n", 1)[1]
    uu = R.build_prompt(tok, "niah_multikey_3", 1000, haystack=hay)
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", uu.answers[0])
    vt = R.build_prompt(tok, "vt", 1024, haystack=hay)
    assert len(vt.answers) == 5 and all(re.fullmatch(r"[A-Z]{5}", a) for a in vt.answers)
    text = tok.decode(vt.input_ids)
    assert text.count("Memorize and track") == 2  # the worked example, then the question
    assert f"VAR {vt.answers[1]} = VAR {vt.answers[0]}" in text
    cwe = R.build_prompt(tok, "cwe", 1536, haystack=hay)
    listing = tok.decode(cwe.input_ids).split("Memorize the ones that appear most often.\n")[-1].split("\nQuestion")[0]
    words = re.findall(r"\d+\. (\S+)", listing)
    counts = {w: words.count(w) for w in set(words)}
    assert len(cwe.answers) == 10 and all(counts[a] == 6 for a in cwe.answers)  # below 4096: 6 and 1
    assert all(c == 1 for w, c in counts.items() if w not in cwe.answers)
    fwe = R.build_prompt(tok, "fwe", 1000, haystack=hay)
    coded = tok.decode(fwe.input_ids).split("coded words. ")[1].split("\nQuestion")[0].split()
    top = sorted({w for w in coded if w != "...." and w != "..."}, key=coded.count, reverse=True)[:3]
    assert top == fwe.answers and R.fwe_counts(fwe.units, R.fwe_vocab(fwe.budget))[1:4] == [
        coded.count(a) for a in fwe.answers
    ]


def test_same_seed_same_prompts_other_seed_others(tok, essay):
    hay = R.Haystack(essay)
    for task in R.TASKS:
        n = LENGTHS[task][0]
        a = R.build_prompt(tok, task, n, seed=5, sample=1, haystack=hay)
        b = R.build_prompt(tok, task, n, seed=5, sample=1, haystack=R.Haystack(list(essay)))
        c = R.build_prompt(tok, task, n, seed=6, sample=1, haystack=hay)
        assert a == b and a.input_ids != c.input_ids, task


def test_string_match_all_on_hand_made_outputs():
    assert R.string_match_all(" 1234567.", ["1234567"]) == 1.0
    assert R.string_match_all("the numbers are 11, 22 and 33", ["11", "22", "33", "44"]) == 0.75
    assert R.string_match_all("ABC and def", ["abc", "DEF"]) == 1.0  # case-insensitive
    assert R.string_match_all("nothing here", ["x1", "y2"]) == 0.0
    assert R.postprocess("  a\tb\x00c  ") == "a\nb\nc"
    with pytest.raises(RopeExtendError):
        R.string_match_all("x", [])


def test_errors_name_the_bad_value(tok, model):
    with pytest.raises(
        RopeExtendError, match=r"unknown RULER task 'niah_single'.*did you mean.*allowed: niah_single_1"
    ):
        R.check_tasks("niah_single,vt")
    with pytest.raises(RopeExtendError, match="unknown RULER task 'qa_1'"):
        ruler(model, tok, [256], tasks=["qa_1"], progress=False)
    with pytest.raises(RopeExtendError, match="too short for RULER task vt"):
        R.build_prompt(tok, "vt", 256)
    with pytest.raises(RopeExtendError, match=r"essay haystack \(\d+ words\) cannot fill length 4096"):
        R.build_prompt(tok, "niah_multivalue", 4096, haystack=R.Haystack([make_text(20)]))
    with pytest.raises(RopeExtendError, match="answer is not unique"):
        R.build_prompt(tok, "fwe", 256)
    with pytest.raises(RopeExtendError, match="samples must be a positive integer"):
        ruler(model, tok, [256], tasks="vt", samples=0, progress=False)
    with pytest.raises(RopeExtendError, match="cannot fill length"):  # before any generation
        ruler(model, tok, [640, 4096], tasks="niah_multivalue", haystack=[make_text(20)], progress=False)


def fake_reader(monkeypatch, right=True):
    """generate() replaced: answers with the prompt's own needles (or nothing), so scores are known."""
    calls = []

    def fake(model, tokenizer, input_ids, max_new_tokens):
        calls.append((len(input_ids), max_new_tokens))
        text = tokenizer.decode(input_ids)
        if not right:
            return " no idea"
        found = re.findall(r"is: (\S+)\.", text)  # needles' values
        return " " + " ".join(found[-2:])

    monkeypatch.setattr(retrieval, "greedy", fake)
    return calls


def test_end_to_end_through_the_runner_with_resume(tok, model, tmp_path, monkeypatch):
    calls = fake_reader(monkeypatch)
    records = tmp_path / "records.jsonl"
    tasks = ["niah_single_1", "niah_multikey_2"]
    r = ruler(model, tok, [384, 450], tasks=tasks, samples=2, seed=1, records=records, progress=False)
    assert len(calls) == 8 and all(m == 128 for _, m in calls)
    assert sorted(n for n, _ in calls) == sorted(x["prompt_tokens"] for x in r.records)
    assert all(x["prompt_tokens"] + 128 <= x["length"] for x in r.records)  # the answer's budget is in the length
    assert r.accuracy["niah_single_1"] == {384: 1.0, 450: 1.0}  # the only needle is the answer
    assert set(r.accuracy) == set(tasks) and set(r.average) == {384, 450}
    rec = r.records[0]
    assert rec["task"] == "ruler" and rec["ruler_task"] == "niah_single_1" and rec["method"] == "none"
    assert {"answers", "output", "score", "correct", "sample", "length", "prompt_tokens"} <= set(rec)
    assert rec["task_version"] == R.VERSION == 3
    assert len(records.read_text().splitlines()) == 8
    calls.clear()
    again = ruler(model, tok, [384, 450], tasks=tasks, samples=3, seed=1, records=records, resume=True, progress=False)
    assert len(calls) == 4 and len(again.records) == 12  # only the new third sample of each cell
    assert [x["output"] for x in again.records if x["sample"] < 2] == [x["output"] for x in r.records]
    with pytest.raises(RopeExtendError, match="already holds results"):
        ruler(model, tok, [384], tasks=tasks, samples=1, records=records, progress=False)


def test_scores_are_the_mean_share_of_answers(tok, model, monkeypatch):
    fake_reader(monkeypatch, right=False)
    r = ruler(model, tok, [512], tasks=["niah_multivalue", "fwe"], samples=2, progress=False, max_new_tokens=3)
    assert r.accuracy == {"niah_multivalue": {512: 0.0}, "fwe": {512: 0.0}} and r.average == {512: 0.0}
    assert all(x["max_new_tokens"] == 3 for x in r.records)
    assert all(("haystack" in x) == (x["ruler_task"] == "niah_multivalue") for x in r.records)  # essay tasks only
    records = [dict(x, score=s) for x, s in zip(r.records, [1.0, 0.5, 0.25, 0.25], strict=True)]
    t = R.tables(records)
    assert t["accuracy"] == {"niah_multivalue": {512: 0.75}, "fwe": {512: 0.25}} and t["average"] == {512: 50.0}
    assert t["scores"] == {"niah_multivalue": {512: 75.0}, "fwe": {512: 25.0}} and t["tasks"] == 2
    rows = summarize(records)["ruler"]
    average = {"label": "none", "task": "average", "length": 512, "score": 50.0, "accuracy": 0.5, "tasks": 2}
    assert {**average, "ruler_tasks": 13} in rows
    text = markdown(summarize(records))
    assert "| niah_multivalue | 75.00 (n=2; 20-97; 2 empty) |" not in text  # " no idea" is not empty
    assert "| niah_multivalue | 75.00 (n=2; 20-97) |" in text
    assert "| **avg over 2 tasks; RULER's is over 13** | **50.00** |" in text
    both = records + [dict(x, label="yarn x2", score=1.0) for x in records]  # two runs: averages side by side
    text = markdown(summarize(both))
    assert "| length | none | yarn x2 |" in text and "| 512 | **50.00** | **100.00** |" in text
    assert "avg over 2 tasks; RULER's is over 13; not comparable to RULER's published averages" in text


def test_real_greedy_runs_and_the_cli_writes_the_report(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["eval", "ruler", "--model", "bundled", "--lengths", "256", "--tasks", "niah_single_1"]
    args += ["--samples", "1", "--max-new-tokens", "4", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    rec = json.loads((out / "records.jsonl").read_text().splitlines()[0])
    assert rec["ruler_task"] == "niah_single_1" and rec["score"] in (0.0, 1.0) and isinstance(rec["output"], str)
    assert (out / "ruler_heatmap_none.png").stat().st_size > 0
    assert "## RULER synthetic tasks" in (out / "report.md").read_text()
    assert main(args + ["--method", "yarn", "--factor", "2", "--resume", "--label", "yarn"]) == 0
    assert "### yarn" in (out / "report.md").read_text()
    capsys.readouterr()
    bad = ["eval", "ruler", "--model", "bundled", "--lengths", "256", "--tasks", "bogus", "--out", str(tmp_path / "x")]
    assert main(bad) != 0
    err = capsys.readouterr().err
    assert "unknown RULER task 'bogus'; allowed: niah_single_1" in err and "Loading weights" not in err


def test_suite_key_ruler(tmp_path, monkeypatch, tok, model):
    fake_reader(monkeypatch)
    raw = {
        "model": "bundled",
        "methods": [{"method": "none"}, {"method": "yarn", "factor": 2}],
        "ruler": {"lengths": [384], "tasks": ["niah_single_1"], "samples": 1},
    }
    suite = parse_suite(raw)
    result = run_suite(suite, out=tmp_path / "s", progress=False, model=model, tokenizer=tok)
    labels = {r["label"] for r in result["records"]}
    assert labels == {"none", "yarn x2"} and all(r["score"] == 1.0 for r in result["records"])
    assert (tmp_path / "s" / "ruler_heatmap_yarn_x2.png").is_file()
    with pytest.raises(RopeExtendError, match="unknown RULER task 'niah'"):
        parse_suite({**raw, "ruler": {"lengths": [256], "tasks": ["niah"]}})


CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_chat_template_wraps_the_task_and_counts_into_the_length(tok, essay):
    chat = copy.deepcopy(tok)
    chat.chat_template = CHAT
    hay = R.Haystack(essay)
    base = R.build_prompt(tok, "cwe", 1536, haystack=hay)
    wrapped = R.build_prompt(chat, "cwe", 1536, haystack=hay)
    assert base.answers == wrapped.answers and len(wrapped) <= wrapped.budget  # the markup is inside the budget
    text = chat.decode(wrapped.input_ids)
    # the worked example is an earlier turn; the answer prefix opens the assistant's turn, as RULER's templates
    assert text.startswith("<|user|>Below is a numbered list") and text.count("<|assistant|>") == 2
    assert text.endswith("<|end|><|assistant|>" + R.CWE_PREFIX)
    assert "<|assistant|>Answer: The top 10 words" in text
    assert R.build_prompt(chat, "cwe", 1536, haystack=hay, chat_template=False) == base  # the switch
    assert R.PromptFormat(chat).setting().startswith("chat:") and R.PromptFormat(tok).setting() == "base"
    with pytest.raises(RopeExtendError, match="chat_template must be true or false, got 'yes'"):
        R.PromptFormat(chat, "yes")


def test_scoring_edge_cases_as_rulers_metrics():
    assert R.string_match_part("it is 42", ["41", "42"]) == 1.0 and R.string_match_part("none", ["a1", "b2"]) == 0.0
    assert R.string_match_part("ABC", ["abc"]) == 1.0 and R.string_match_all("x 41", ["41", "42"]) == 0.5
    assert dict.fromkeys(R.TASKS, "all") == R.METRIC  # string_match_part is RULER's qa metric only
    assert R.is_empty(" \n\t\x00 ") and not R.is_empty(" 0")
    assert R.task_score([1.0, 0.0, 0.0]) == 33.33 and R.task_score([2 / 3]) == 66.67  # RULER's round(x, 2)
    with pytest.raises(RopeExtendError, match="string_match_part needs at least one expected string"):
        R.string_match_part("x", [])
    records = [
        {"ruler_task": "vt", "length": 512, "score": s, "output": o}
        for s, o in [(1.0, " A B"), (0.0, "  "), (0.0, "\x00")]
    ] + [
        {"ruler_task": "fwe", "length": 512, "score": 0.5, "output": "x"},
        {"ruler_task": "fwe", "length": 1024, "score": 1.0, "output": "y"},
    ]
    t = R.tables(records)
    assert t["empty"] == {"vt": {512: 2}, "fwe": {512: 0, 1024: 0}} and t["scores"]["vt"] == {512: 33.33}
    assert t["average"] == {
        512: round((33.33 + 50) / 2, 2)
    }  # the mean of the rounded scores, rounded; 1024 lacks vt: no average there
    assert R.average_label(11) == "avg over 11 tasks; RULER's is over 13"
    text = markdown(summarize([dict(r, task="ruler", method="none") for r in records]))
    assert "| vt | 33.33 (n=3; 6-79; 2 empty) |" in text
    assert "Effective length (RULER's rule" in text and "**none (no length reaches it)**" in text


def test_word_lists_are_rulers():
    from rope_extend.evaluation import ruler_words as W

    assert (len(W.nouns()), len(W.adjectives()), len(W.verbs()), len(W.common_words())) == (6782, 910, 1041, 8166)
    hyphenated = [(a, n) for a in W.adjectives() for n in W.nouns() if "-" in a or "-" in n]
    distinct = len(W.adjectives()) * len(W.nouns()) - sum(1 - 1 / W.splits(f"{a}-{n}") for a, n in hyphenated)
    assert round(distinct) == 6_171_620  # RULER's sorted(set(adjective-noun pairs))
    rng = __import__("random").Random(0)
    keys = [W.draw_key(rng) for _ in range(200)]
    assert all(W.splits(k) >= 1 for k in keys) and len(set(keys)) == 200
