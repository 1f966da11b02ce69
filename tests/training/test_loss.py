import pytest
import torch
import torch.nn.functional as F

from rope_extend.training.loss import chunked_loss, model_loss
from tests.tiny import tiny_model


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_linear_cross_entropy_matches_full_logits_with_gradients(softcap, bias):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=bias)
    h = torch.randn(2, 13, 16, requires_grad=True)
    t = torch.randint(0, 50, (2, 13))
    t[0, 3] = t[1, -1] = -100
    params = [h, head.weight] + ([head.bias] if bias else [])
    got = chunked_loss(h, head, t, chunk_size=5, softcap=softcap)
    g = torch.autograd.grad(got * 1.7, params)
    logits = head(h)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    ref = F.cross_entropy(logits.flatten(0, 1), t.flatten(), ignore_index=-100, reduction="sum")
    r = torch.autograd.grad(ref * 1.7, params)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    for a, b in zip(g, r, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_wrapped_head_uses_checkpointed_chunks_and_matches():
    torch.manual_seed(0)
    head = torch.nn.Sequential(torch.nn.Linear(16, 50))  # not a plain Linear: generic path
    h = torch.randn(1, 11, 16, requires_grad=True)
    t = torch.randint(0, 50, (1, 11))
    got = chunked_loss(h, head, t, chunk_size=4)
    (gh,) = torch.autograd.grad(got, [h])
    ref = F.cross_entropy(head(h).flatten(0, 1), t.flatten(), reduction="sum")
    (rh,) = torch.autograd.grad(ref, [h])
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(gh, rh)


@pytest.mark.parametrize("lora_head", [False, True])
def test_model_loss_equals_transformers_loss_and_gradients(lora_head):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model("llama").train(),
        LoraConfig(
            r=4,
            target_modules=["q_proj", "v_proj"] + (["lm_head"] if lora_head else []),
            init_lora_weights=False,
            modules_to_save=["norm"],
        ),
    )
    ids = torch.randint(3, 512, (2, 40))
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    loss_sum, n = model_loss(model, {"input_ids": ids, "targets": targets}, chunk_size=16)
    assert n == 78
    grads = torch.autograd.grad(loss_sum / n, [p for p in model.parameters() if p.requires_grad])
    ref = model(input_ids=ids, labels=ids).loss  # transformers shifts labels itself
    ref_grads = torch.autograd.grad(ref, [p for p in model.parameters() if p.requires_grad])
    torch.testing.assert_close(loss_sum / n, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert "forward" not in model.get_output_embeddings().__dict__  # the head is restored


@pytest.mark.parametrize("family", ["cohere", "granite", "gemma2"])
@pytest.mark.parametrize("lora_head", [False, True])
def test_model_loss_applies_the_family_logit_transform(family, lora_head):
    """Cohere scales its logits, Granite divides them, Gemma 2 soft-caps them: the chunked loss (through
    rope_extend.hf.head) must equal the model's own loss, with the same gradients, also through a LoRA head."""
    from peft import LoraConfig, get_peft_model

    from rope_extend.hf.head import check, lm_head

    extra = {"final_logit_softcapping": 2.0} if family == "gemma2" else {}
    model = tiny_model(family, **extra).train()
    if lora_head:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False))
    head = lm_head(model)
    assert head.multiplier != 1.0 or head.softcap  # the transform is really there
    ids = torch.randint(3, 512, (2, 24))
    check(model, head, ids[0].tolist())
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    params = [p for p in model.parameters() if p.requires_grad]
    loss_sum, n = model_loss(model, {"input_ids": ids, "targets": targets}, chunk_size=8, head=head)
    grads = torch.autograd.grad(loss_sum / n, params)
    ref = model(input_ids=ids, labels=ids).loss
    ref_grads = torch.autograd.grad(ref, params)
    torch.testing.assert_close(loss_sum / n, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_head_check_refuses_an_unknown_logit_transform():
    from rope_extend import RopeExtendError
    from rope_extend.hf.head import LMHead, check, lm_head

    model = tiny_model("granite")
    plain = LMHead(lm_head(model).output)  # as if the divisor were unknown
    with pytest.raises(RopeExtendError, match="computes its logits differently"):
        check(model, plain, list(range(3, 20)))


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: a soft cap applied to the head's output
def test_head_output_on_the_graph_adds_nothing_and_reaches_the_heads_output_in_backward(family):
    """What ZeRO-3 needs (``head_output_on_graph``): a backward hook on the head's output runs, and the loss and
    every gradient are exactly those of the detached empty output."""
    model = tiny_model(family).train()
    ids = torch.randint(3, 256, (2, 24))
    batch = {"input_ids": ids, "targets": torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)}
    head = model.get_output_embeddings()
    seen = []

    def hook(module, args, output):  # as a wrapper that acts in backward registers its hook on each module's output
        if output.requires_grad:
            output.register_hook(lambda grad: seen.append(tuple(grad.shape)))

    handle = head.register_forward_hook(hook)
    results = {}
    try:
        for on_graph in (False, True):
            loss, _ = model_loss(model, batch, chunk_size=8, head_output_on_graph=on_graph)
            results[on_graph] = (loss, torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad]))
            assert len(seen) == int(on_graph)
    finally:
        handle.remove()
    assert seen == [(2, 24, 0)]
    assert torch.equal(results[False][0], results[True][0])
    assert all(torch.equal(a, b) for a, b in zip(results[False][1], results[True][1], strict=True))
