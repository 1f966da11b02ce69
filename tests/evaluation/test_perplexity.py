import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rope_extend import RopeExtendError
from rope_extend.evaluation import perplexity
from rope_extend.evaluation.perplexity import window_nll, windows
from rope_extend.hf import head as H
from tests.evaluation.conftest import make_text
from tests.tiny import FAMILIES, tiny_model


def naive_ppl(model, docs, length, stride):
    """The transformers docs' loop: full logits, labels -100 on context tokens, token-weighted."""
    nll, count = 0.0, 0
    for ids in docs:
        ids = torch.tensor(ids)
        if stride is None:
            spans = [(0, min(length, len(ids)), None)]
        else:
            spans, prev_end = [], 0
            for begin in range(0, len(ids), stride):
                end = min(begin + length, len(ids))
                spans.append((begin, end, end - prev_end))
                prev_end = end
                if end == len(ids):
                    break
        for begin, end, trg_len in spans:
            x = ids[begin:end][None]
            labels = x.clone()
            if trg_len is not None:
                labels[:, :-trg_len] = -100
            with torch.no_grad():
                loss = model(input_ids=x, labels=labels).loss
            n = int((labels[:, 1:] != -100).sum())
            nll, count = nll + float(loss) * n, count + n
    return math.exp(nll / count)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("stride", [None, 48])
def test_equals_naive_full_logits(family, stride, tok):
    texts = [make_text(30, seed=i) for i in range(2)]  # ~350 tokens each: a few windows, fast
    model = tiny_model(family, seed=2)
    if family in ("gemma2", "gemma3"):
        model.config.final_logit_softcapping = 3.0  # make the softcap matter on random weights
    docs = [tok(t)["input_ids"] for t in texts]
    r = perplexity(model, tok, texts, [64, 128], stride=stride, chunk_size=7, progress=False)
    for length in (64, 128):
        ref = naive_ppl(model, docs, length, stride)
        assert r.perplexity[length] == pytest.approx(ref, rel=1e-5), (family, length)


def test_softcap_is_applied(tok, texts):
    model = tiny_model("gemma2", seed=2)
    model.config.final_logit_softcapping = 0.5
    capped = perplexity(model, tok, texts, [64], progress=False).perplexity[64]
    assert capped == pytest.approx(naive_ppl(model, [tok(t)["input_ids"] for t in texts], 64, None), rel=1e-5)
    assert 512 / math.e <= capped <= 512 * math.e  # logits in [-0.5, 0.5] over 512 tokens: near uniform


@given(n=st.integers(2, 300), length=st.integers(2, 64), stride=st.integers(1, 64))
def test_windows_score_every_token_once(n, length, stride):
    stride = min(stride, length)
    scored, starts = [], []
    for begin, end, score_from in windows(n, length, stride):
        assert end - begin <= length and begin < score_from <= end
        scored += range(score_from, end)
        starts.append(begin)
    if stride < length:  # overlapping windows: every token after the first is scored exactly once
        assert scored == list(range(1, n))
    else:  # disjoint windows (as in transformers' docs): a window's first token has no context in it
        assert scored == [t for t in range(1, n) if t not in starts]


def test_one_window_per_document_counts(llama, tok, texts):
    r = perplexity(llama, tok, texts, [100], progress=False)
    assert r.tokens == {100: 3 * 99} and [x["tokens"] for x in r.records] == [99] * 3
    assert r.skipped == {100: 0}


def test_short_documents_skipped_or_error(llama, tok, texts):
    short = "The sky is blue."
    r = perplexity(llama, tok, texts + [short], [64], progress=False)
    assert r.skipped == {64: 1} and len(r.records) == 3
    longest = max(len(tok(t)["input_ids"]) for t in texts)
    with pytest.raises(RopeExtendError, match=f"length 100000 cannot be reached.*{longest} tokens"):
        perplexity(llama, tok, texts, [64, 100000], progress=False)


def test_bad_arguments(llama, tok, texts):
    with pytest.raises(RopeExtendError, match="stride must be a positive integer"):
        perplexity(llama, tok, texts, [64], stride=0, progress=False)
    with pytest.raises(RopeExtendError, match="larger than the window"):
        perplexity(llama, tok, texts, [64], stride=65, progress=False)
    with pytest.raises(RopeExtendError, match="no texts"):
        perplexity(llama, tok, ["", "  "], [64], progress=False)
    from transformers import LlamaModel

    with pytest.raises(RopeExtendError, match="not a causal language model"):
        perplexity(LlamaModel(llama.config), tok, texts, [64], progress=False)


def test_unknown_logit_transform_is_caught(tok, texts):
    model = tiny_model("llama")
    original = model.forward

    def forward(*args, **kwargs):  # a family that scales its logits in a way hf.head does not know
        out = original(*args, **kwargs)
        out.logits = out.logits * 2
        return out

    model.forward = forward
    with pytest.raises(RopeExtendError, match="computes its logits differently"):
        perplexity(model, tok, texts, [64], progress=False)


def test_head_never_sees_more_than_a_chunk(llama, tok, texts, monkeypatch):
    seen = []
    logits = H.LMHead.logits

    def spy(self, h):
        seen.append(h.shape[0])
        return logits(self, h)

    monkeypatch.setattr(H.LMHead, "logits", spy)
    perplexity(llama, tok, texts, [200], chunk_size=32, progress=False)
    assert max(seen[1:]) == 32 and sum(seen[1:]) == 3 * 199  # seen[0]: the 16-token head check


def _windows(model):
    return [model.config.sliding_window] + [
        m.sliding_window for m in model.modules() if isinstance(getattr(m, "sliding_window", None), int)
    ]


def test_a_window_every_layer_uses_is_widened(tok, texts):
    """Mistral-style windows are a memory saving: by default the evaluation widens them (evaluation.md),
    so perplexity equals that of the same weights without a window, and the model is restored."""
    windowed, plain = tiny_model("mistral", sliding_window=8), tiny_model("mistral")
    before = _windows(windowed)
    auto = perplexity(windowed, tok, texts, [48], progress=False).perplexity[48]
    reference = perplexity(plain, tok, texts, [48], progress=False).perplexity[48]
    kept = perplexity(windowed, tok, texts, [48], sliding_window="keep", progress=False).perplexity[48]
    assert auto == pytest.approx(reference, rel=1e-6)
    assert abs(kept - reference) > 1e-3 * reference  # the window really changes the measurement
    assert _windows(windowed) == before == [8]


def test_interleaved_local_layers_are_kept_unless_full(tok, texts):
    gemma2 = tiny_model("gemma2", sliding_window=8)
    before = _windows(gemma2)
    ppl = {
        mode: perplexity(gemma2, tok, texts, [48], sliding_window=mode, progress=False).perplexity[48]
        for mode in ("auto", "keep", "full")
    }
    assert ppl["auto"] == ppl["keep"]
    assert abs(ppl["full"] - ppl["keep"]) > 1e-3 * ppl["keep"]
    assert _windows(gemma2) == before
    with pytest.raises(RopeExtendError, match="sliding_window must be one of auto, full, keep"):
        perplexity(gemma2, tok, texts, [48], sliding_window="off", progress=False)


def test_window_nll_needs_the_decoder():
    # a head taken without decoder=True used to fail with "'NoneType' object is not callable"
    head = H.LMHead(output=torch.nn.Linear(4, 10))
    with pytest.raises(RopeExtendError, match=r"lm_head\(model, decoder=True\)"):
        window_nll(head, torch.arange(5), 1)
