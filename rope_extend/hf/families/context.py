"""Families whose config says its lengths and layer kinds in their own way.

- Gemma 3 ships a ``linear`` factor on its global layers with ``max_position_embeddings`` already the extended
  context (pretrained at 32k, linear x8, 131072 in the config). A plain ``linear`` dict says nothing of which
  length it extends (Vicuna-16k ships linear x4 with 4096, the length before it), so the rule is the family's
  (``linear_within_context``).
- The attention layer types that keep their own rotary (local windows and chunks: Gemma 2/3, Llama 4, Cohere 2,
  EXAONE 4, GPT-OSS, ...): rope-extend scales every other type (``LOCAL_LAYER_TYPES``).
- M-RoPE's rope keys (``mrope_section``, ``mrope_interleaved``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V), which
  transformers 5.17's ``RopeParameters`` does not declare yet: a family's keys, never a method's.
"""

from __future__ import annotations

from .rule import Rule, constant

LOCAL_LAYER_TYPES = ("sliding_attention", "chunked_attention", "local_attention", "hybrid_sliding", "window_attention")
MROPE_KEYS = frozenset({"mrope_section", "mrope_interleaved"})

GEMMA3_LINEAR_WITHIN_CONTEXT = Rule(
    "gemma3_linear_within_context", "linear_within_context", constant(True), ("gemma3_text",)
)
