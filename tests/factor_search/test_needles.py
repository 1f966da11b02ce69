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
    with pytest.raises(RopeExtendError, match="fitness must be one of text, needle, got 'answers'"):
        N.documents(tok, texts, LENGTH, fitness="answers", seed=0)
    with pytest.raises(RopeExtendError, match="the needle fitness at 128 tokens: length 128 is too short for RULER"):
        N.needle_documents(tok, texts, 128, seed=0)
    with pytest.raises(RopeExtendError, match="at least one non-empty document"):
        N.needle_documents(tok, ["  "], LENGTH, seed=0)
