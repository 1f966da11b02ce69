"""GPU checks of the core (skipped without CUDA): buffers live on the device, stay float32 in bf16."""

import pytest
import torch

import rope_extend
from tests.tiny import tiny_model

pytestmark = pytest.mark.gpu


def test_patch_on_cuda_keeps_float32_buffers_on_the_device():
    model = tiny_model().to("cuda", torch.bfloat16)
    rope_extend.patch(model, "yarn", factor=4)
    emb = model.model.rotary_emb
    assert emb.inv_freq.device.type == "cuda" and emb.inv_freq.dtype == torch.float32
    expected, _ = rope_extend.inv_freq("yarn", 16, 10000.0, 4, 256)
    assert torch.equal(emb.inv_freq.cpu(), expected)


@pytest.mark.parametrize("method", ["yarn", "dynamic_yarn"])
def test_bf16_generation_on_cuda(method):
    model = tiny_model().to("cuda", torch.bfloat16)
    rope_extend.patch(model, method, factor=4)
    prompt = torch.randint(3, 512, (1, 600), device="cuda")
    out = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 608)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def _method_arguments(name: str, model) -> dict:
    """The combination matrix's arguments for ``name`` (LongRoPE's factors for the model's shape)."""
    from tests.matrix.reference import patch_arguments

    return patch_arguments(name, model)


@pytest.mark.parametrize("method", rope_extend.method_names())
def test_every_method_on_cuda_matches_the_cpu(method):
    """float32 on both devices: the same weights, patched alike, give the same logits past L (the CUDA path runs
    the attention methods' passes on the plain-torch kernel, the CPU on aten's CPU flash kernel), and the same
    greedy tokens through generate's cached decoding."""
    torch.manual_seed(0)
    prompt = torch.randint(3, 512, (2, 600))
    got = {}
    for device in ("cpu", "cuda"):
        model = tiny_model().to(device)
        rope_extend.patch(model, method, **_method_arguments(method, model))
        with torch.no_grad():
            logits = model(input_ids=prompt.to(device)).logits.float().cpu()
        out = model.generate(prompt.to(device), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
        got[device] = logits, out.cpu()
    assert torch.allclose(got["cuda"][0], got["cpu"][0], atol=2e-4, rtol=1e-4), (
        (got["cuda"][0] - got["cpu"][0]).abs().max()
    )
    assert torch.equal(got["cuda"][1], got["cpu"][1])


@pytest.mark.parametrize("method", ["yarn", "self_extend", "dual_chunk", "string"])
def test_bf16_on_cuda_stays_near_float32(method):
    """bf16 on CUDA against float32 on CUDA: the passes accumulate in float32, so the logits differ by bf16's
    rounding of the weights and activations only (a bound measured on the unpatched model, doubled)."""
    torch.manual_seed(0)
    prompt = torch.randint(3, 512, (1, 600), device="cuda")

    def logits(dtype, name):
        model = tiny_model().to("cuda", dtype)
        if name != "none":
            rope_extend.patch(model, name, **_method_arguments(name, model))
        with torch.no_grad():
            return model(input_ids=prompt).logits.float()

    native = (logits(torch.bfloat16, "none") - logits(torch.float32, "none")).abs().max().item()
    patched = (logits(torch.bfloat16, method) - logits(torch.float32, method)).abs().max().item()
    assert patched <= 2 * native + 1e-3, (patched, native)
