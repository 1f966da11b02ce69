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
