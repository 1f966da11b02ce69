"""The model classes of rope-extend's vLLM plugin (``vllm_plugin``): vLLM's own architecture, rotary embeddings
replaced by one table of every segment (``adaptive``). Imported by vLLM's model registry only, never by
rope-extend itself (it imports vLLM at its top).

Refused before the model loads, each with the reason: a vLLM version the plugin was not checked with
(``vllm_plugin.CHECKED``: it wraps that release's internals),
another platform than CPU (checked there; on CUDA the positions buffer is captured by CUDA graphs, untried),
speculative decoding (the drafter reads positions too), the V2 model runner (another class), a max_model_len past
the largest bucket (rows past the table would be read), and what ``adaptive.check_config`` refuses at export (a
folder may have been edited since).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import torch
import vllm
from torch import nn
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.platforms import current_platform

from ..errors import UnsupportedModelError
from . import adaptive, vllm_plugin

OWN_KEYS = ("rope_type", "factor", "original_max_position_embeddings", "rope_theta")


class AdaptiveRotaryEmbedding(RotaryEmbedding):
    """vLLM's rotary embedding over ``table`` (every segment's cos/sin); positions arrive already shifted."""

    def __init__(self, like: RotaryEmbedding, table: torch.Tensor):
        super().__init__(
            like.head_size, like.rotary_dim, table.shape[0], like.base, like.is_neox_style, like.dtype, init_cache=False
        )
        self.register_buffer("cos_sin_cache", table.to(like.dtype), persistent=False)


def _refuse(why: str) -> NoReturn:
    raise UnsupportedModelError(f"rope-extend's adaptive dynamic_yarn in vLLM {vllm.__version__}: {why}")


def _check_engine(vllm_config, layout: adaptive.BucketLayout) -> None:
    problem = vllm_plugin.version_problem(vllm.__version__)
    if problem is not None:
        raise UnsupportedModelError(problem)
    if not current_platform.is_cpu():
        _refuse("checked on vLLM's CPU build only; on this platform it is not served yet")
    if vllm_config.speculative_config is not None:
        _refuse("speculative decoding reads the positions too (the drafter would see the shifted ones)")
    if vllm_config.use_v2_model_runner:
        _refuse("the V2 model runner is not wrapped: set VLLM_USE_V2_MODEL_RUNNER=0")
    if vllm_config.model_config.max_model_len > layout.longest:
        _refuse(
            f"max_model_len {vllm_config.model_config.max_model_len} is past the largest bucket "
            f"({layout.longest} tokens, x{layout.factors[-1]:g})"
        )


def _scaling(hf_config, layout: adaptive.BucketLayout):
    rope = dict(adaptive.global_rope(hf_config.rope_parameters or {}))
    if rope.get("rope_type") != adaptive.METHOD:
        _refuse(f"config rope_type is {rope.get('rope_type')!r}, not {adaptive.METHOD!r}")
    if float(rope.get("factor", 0)) != layout.factors[-1] or int(
        rope.get("original_max_position_embeddings", 0)
    ) != int(layout.original):
        _refuse(f"rope_parameters {rope} disagree with {adaptive.CONFIG_KEY} {layout.as_config()}")
    return adaptive.scaling(layout, {k: v for k, v in rope.items() if k not in OWN_KEYS})


if TYPE_CHECKING:  # the mixin's base for the type checker: at run time it comes before vLLM's class, an nn.Module
    _MixinBase = nn.Module
else:
    _MixinBase = object


class _Adaptive(_MixinBase):
    """Mixed in before vLLM's class: builds it with plain RoPE, then swaps every rotary embedding."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        hf_config = vllm_config.model_config.hf_config
        layout = vllm_plugin.layout_of(hf_config)
        if layout is None:
            _refuse(f"the config has no {adaptive.CONFIG_KEY} (export the model with rope-extend)")
        _check_engine(vllm_config, layout)
        own = type(self).__name__.removeprefix(adaptive.PREFIX)
        adaptive.check_config(hf_config, own)  # the export's checks again: a folder may have been edited since
        scaling = _scaling(hf_config, layout)
        rope = hf_config.rope_parameters
        # vLLM's get_rope knows no dynamic_yarn: the layers are built plain, then given the table
        hf_config.rope_parameters = adaptive.plain_rope(rope)
        try:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        finally:
            hf_config.rope_parameters = rope
        self._swap_rotary(hf_config, layout, scaling)
        vllm_plugin.wrap_runner()

    def _swap_rotary(self, hf_config, layout, scaling) -> None:
        """Every rotary embedding gets the table of every segment: the scaled one, or plain RoPE at its own base
        in each segment for the layers that are not scaled (Gemma 3's sliding ones), since all are handed the
        same shifted positions."""
        shared: dict[tuple, AdaptiveRotaryEmbedding] = {}
        swapped = 0
        for path, module in list(self.named_modules()):
            for name, child in list(module.named_children()):
                if not isinstance(child, RotaryEmbedding):
                    continue
                if type(child) is not RotaryEmbedding:
                    _refuse(f"{name} is a {type(child).__name__}, where plain RoPE was asked for")
                scaled = adaptive.scaled_layer(hf_config, f"{path}.{name}")
                key = (child.head_size, child.rotary_dim, float(child.base), child.is_neox_style, child.dtype, scaled)
                if key not in shared:
                    method = scaling if scaled else None
                    shared[key] = AdaptiveRotaryEmbedding(
                        child, adaptive.table(layout, method, child.rotary_dim, float(child.base))
                    )
                setattr(module, name, shared[key])
                swapped += 1
        if swapped == 0:
            _refuse(f"{type(self).__name__} has no rotary embedding to replace")


class RopeExtendAdaptiveLlamaForCausalLM(_Adaptive, LlamaForCausalLM):
    """``LlamaForCausalLM`` (SmolLM2, Llama 2, Llama 3 without its llama3 scaling) with per-request YaRN."""


class RopeExtendAdaptiveMistralForCausalLM(_Adaptive, MistralForCausalLM):
    """``MistralForCausalLM`` (Mistral 7B; its sliding window is on cache slots, which the plugin leaves alone)."""


class RopeExtendAdaptiveQwen2ForCausalLM(_Adaptive, Qwen2ForCausalLM):
    """``Qwen2ForCausalLM`` (Qwen2, Qwen2.5) with per-request YaRN."""


class RopeExtendAdaptiveQwen3ForCausalLM(_Adaptive, Qwen3ForCausalLM):
    """``Qwen3ForCausalLM`` (dense Qwen3) with per-request YaRN."""


class RopeExtendAdaptiveGemma3ForCausalLM(_Adaptive, Gemma3ForCausalLM):
    """``Gemma3ForCausalLM`` (text): YaRN on the global layers; the sliding ones keep their own base, unscaled."""
