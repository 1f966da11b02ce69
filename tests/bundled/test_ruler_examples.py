"""The bundled model's RULER-format training examples (stage 4): the harness's own samples, answered, in the
window; and the mix without them unchanged (the shipped tokenizer is trained on it)."""

import random

import pytest

from rope_extend import bundled
from rope_extend.bundled.mix import training_documents
from rope_extend.bundled.ruler_examples import TAUGHT, answer_text, ruler_example
from rope_extend.errors import RopeExtendError
from rope_extend.evaluation.ruler import NIAH, score
from rope_extend.evaluation.ruler.subtasks import niah_draft

needs_model = pytest.mark.skipif(not bundled.available(), reason="bundled model not installed")


@needs_model
def test_examples_are_the_harness_samples_answered_and_fit_the_window():
    _, tok = bundled.load()

    def count(text: str) -> int:
        return len(tok(text)["input_ids"])

    seen = set()
    for seed in range(60):
        text = ruler_example(random.Random(seed), 256, count)
        assert count(text) <= 256
        prompt, answer = text.rsplit(" mentioned in the provided text is", 1)
        value = answer.strip().rstrip(".")
        # the needle the question asks about carries the answer, in RULER's words
        query = prompt.rsplit("What is the special magic ", 1)[1].split(" for ", 1)[1].split(" mentioned")[0]
        assert f"for {query} is: {value}." in prompt
        seen.add(text.split(" is hidden", 1)[0])
    assert seen == {"A special magic number", "A special magic uuid"}


def test_an_example_draws_what_the_harness_draws():
    """Same RNG state, same task and size: the text before the answer is the harness's draft (base format)."""
    rng, again = random.Random(5), random.Random(5)
    text = ruler_example(rng, 10_000, len)  # everything fits: the first draw is kept
    task = again.choice(TAUGHT)
    words = []
    if NIAH[task].haystack == "essay":
        from rope_extend.bundled.corpus import chronicle

        words = chronicle(again, 200).split(" ")
    most = len(words) if words else 8
    draft = niah_draft(task, again, again.randint(1, most), words)
    assert text == draft.user + draft.prefix + answer_text(draft.answers)
    assert score(task, answer_text(draft.answers), draft.answers) == 1.0  # RULER scores the answer as right


def test_a_window_too_small_is_refused():
    with pytest.raises(RopeExtendError, match="64-token window holds no RULER"):
        ruler_example(random.Random(0), 64, len)


def test_the_mix_without_ruler_is_unchanged_and_with_it_needs_a_counter():
    assert training_documents(3, 300) == training_documents(3, 300, ruler_share=0.0)
    with pytest.raises(RopeExtendError, match="need count"):
        training_documents(3, 10, ruler_share=0.3)
    docs = training_documents(3, 400, ruler_share=0.3, count=lambda t: len(t) // 4)
    share = sum("special magic" in d for d in docs) / len(docs)
    assert 0.22 < share < 0.38
