"""The needle fitness's documents: the harnesses' own passkey and RULER prompts, the answer last and scored alone."""

import pytest

from rope_extend import RopeExtendError
from rope_extend.evaluation.prompts import KEY_LINE, QUESTION
from rope_extend.factor_search import needles as N
from tests.evaluation.conftest import make_text
from tests.tiny import tiny_tokenizer

LENGTH = 256


@pytest.fixture(scope="module")
def made():
    tok, texts = tiny_tokenizer(), [make_text(40, seed=i) for i in range(2)]
    return tok, texts, N.needle_documents(tok, texts, LENGTH, seed=0)


def test_passkeys_at_their_depths_and_ruler_needles_each_ending_in_its_answer(made):
    tok, texts, docs = made
    where = []
    assert len(docs) == len(N.PASSKEY_DEPTHS) + N.RULER_NEEDLES == 6
    for k, (ids, start) in enumerate(docs):
        assert len(ids) <= LENGTH and 0 < start < len(ids) and len(ids) - start <= N.ANSWER_TOKENS
        answer = tok.decode(ids[start:]).strip()
        before = tok.decode(ids[:start])
        assert answer.isdigit()
        if k < len(N.PASSKEY_DEPTHS):
            assert len(ids) == LENGTH and before.endswith(QUESTION)
            key_at = before.index(KEY_LINE.format(key=answer))  # the needle holds the scored answer
            where.append(key_at / len(before))
        else:
            assert (
                len(answer) == 7 and f"is: {answer}." in before and before.endswith("mentioned in the provided text is")
            )
    assert where == sorted(where) and where[-1] - where[0] > 0.4  # deeper and deeper, at 0.1, 0.5 and 0.9
    assert N.needle_documents(tok, texts, LENGTH, seed=0) == docs  # a resume rebuilds the same documents
    assert N.needle_documents(tok, texts, LENGTH, seed=1) != docs


def test_text_documents_score_everything_after_the_first_token(made):
    tok, texts, _ = made
    docs = N.documents(tok, texts, 100, fitness="text", seed=0)
    assert [(len(ids), start) for ids, start in docs] == [(100, 1), (100, 1)]


def test_refusals(made):
    tok, texts, _ = made
    with pytest.raises(RopeExtendError, match="fitness must be one of text, needle, needle-multiquery, got 'answers'"):
        N.documents(tok, texts, LENGTH, fitness="answers", seed=0)
    with pytest.raises(RopeExtendError, match="the needle fitness at 128 tokens: length 128 is too short for RULER"):
        N.needle_documents(tok, texts, 128, seed=0)
    with pytest.raises(RopeExtendError, match="at least one non-empty document"):
        N.needle_documents(tok, ["  "], LENGTH, seed=0)


def test_one_multiquery_document_with_a_needle_at_each_fixed_depth_and_the_values_asked_last(made):
    import re

    from rope_extend.evaluation.ruler.subtasks import NEEDLE

    tok, texts, _ = made
    docs = N.documents(tok, texts, 1024, fitness="needle-multiquery", seed=0)
    assert len(docs) == 1
    ids, start = docs[0]
    assert 1024 - 40 < len(ids) <= 1024  # the most sentences that fit: a sentence of slack at most
    before, answer = tok.decode(ids[:start]), tok.decode(ids[start:])
    values = answer.strip().split(", ")
    assert len(values) == len(N.MULTIQUERY_DEPTHS) == 5 and all(len(v) == 7 and v.isdigit() for v in values)
    asked = re.search(r"The special magic numbers for (.*) mentioned in the provided text are$", before)
    assert asked is not None
    keys = asked.group(1).replace(", and ", ", ").split(", ")
    body = before[: before.index("What are all the special magic numbers")]
    placed = {}  # where each needle sits in the haystack, as a share of it
    for key, value in zip(keys, values, strict=True):
        placed[key] = body.index(NEEDLE.format(kind="numbers", key=key, value=value)) / len(body)
    depths = sorted(placed.values())
    assert all(abs(d - want) < 0.08 for d, want in zip(depths, N.MULTIQUERY_DEPTHS, strict=True)), depths
    assert sorted(placed, key=placed.get) != keys  # asked in another order than placed (seed 0)
    assert N.multiquery_documents(tok, texts, 1024, seed=0) == docs  # a resume rebuilds the same document
    assert N.multiquery_documents(tok, texts, 1024, seed=1) != docs


def test_multiquery_refusals(made):
    tok, texts, _ = made
    with pytest.raises(RopeExtendError, match="needle-multiquery fitness: length 512 is too short"):
        N.multiquery_documents(tok, texts, 512, seed=0)
    with pytest.raises(RopeExtendError, match="the texts have 2 sentences, it needs at least 10 around its needles"):
        N.multiquery_documents(tok, ["Short text. Only two sentences."], 1024, seed=0)
    with pytest.raises(RopeExtendError, match="needle-multiquery fitness: the texts .* cannot fill 4096 tokens"):
        N.multiquery_documents(tok, texts, 4096, seed=0)
