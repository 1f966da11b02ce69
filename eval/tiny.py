"""Tiny random-weight models and an offline tokenizer for tests and the parity scripts (no hub, no downloads).

Here rather than in tests/ because scripts in eval/ build their models with it and must not depend on tests/;
``tests.tiny`` re-exports it for the tests.

``tiny_config(family)`` builds a few-layer config of a real architecture; ``tiny_model(family)`` the model
in eval mode with a fixed seed; ``tiny_tokenizer()`` a byte-level BPE trained in milliseconds on text
that covers the passkey filler, digits and common English, wrapped as a ``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

import functools

import torch
import transformers as T

# Small but real: 2-4 layers, GQA where the family has it, head_dim 16 (32 for Gemma's wider heads).
_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {"head_dim": 16}),
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, {"head_dim": 16}),
    "gemma2": (
        T.Gemma2Config,
        T.Gemma2ForCausalLM,
        {"head_dim": 16, "sliding_window": 64, "query_pre_attn_scalar": 16},
    ),
    "gemma3": (
        T.Gemma3TextConfig,
        T.Gemma3ForCausalLM,
        {
            "head_dim": 16,
            "sliding_window": 64,
            "num_hidden_layers": 4,
            "sliding_window_pattern": 2,
            "query_pre_attn_scalar": 16,
        },
    ),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, {"original_max_position_embeddings": 256}),
    "phi": (T.PhiConfig, T.PhiForCausalLM, {"partial_rotary_factor": 0.5}),
    "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, {"rotary_pct": 0.5, "num_key_value_heads": None}),
    # families whose logits are transformed after the LM head (rope_extend.hf.head)
    "cohere": (T.CohereConfig, T.CohereForCausalLM, {"logit_scale": 0.25}),
    "granite": (T.GraniteConfig, T.GraniteForCausalLM, {"logits_scaling": 4.0}),
}


def tiny_config(family: str = "llama", **overrides):
    config_cls, _, extra = FAMILIES[family]
    kwargs = {**_COMMON, **extra, **overrides}
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k == "sliding_window"}
    config = config_cls(**kwargs)
    config._attn_implementation = "sdpa" if family not in ("gemma2", "gemma3") else "eager"
    return config


def tiny_model(family: str = "llama", seed: int = 0, **overrides):
    _, model_cls, _ = FAMILIES[family]
    torch.manual_seed(seed)
    return model_cls(tiny_config(family, **overrides)).eval()


TOKENIZER_TEXT = [
    (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there."
    ),
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
    "The pass key is 12345. Remember it. 12345 is the pass key. What is the pass key? The pass key is",
    "0 1 2 3 4 5 6 7 8 9 10 42 100 2024 31415 27182",
    (
        "The quick brown fox jumps over the lazy dog. A needle hides in the haystack; what is the secret "
        "word? The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
    ),
]


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    """A byte-level BPE tokenizer (vocab 512, pad=0 bos=1 eos=2) with digits split one per token."""
    from rope_extend.training.data import train_bpe_tokenizer

    return train_bpe_tokenizer(TOKENIZER_TEXT * 4, 512)
