"""Family rules: every quirk of a model family that rope-extend must know, in one place.

One small rule per quirk, keyed by ``model_type`` or by a capability, in one ordered registry (``RULES``, a
``rope_extend.registry.Registry``); the rest of ``hf`` asks them (``ask(quirk, holder)``) instead of naming
families. A transformers upgrade that changes a family changes its rule here.

- ``rule``: ``Rule``, ``RULES``, ``ask``, and the questions a rule may answer (``QUIRKS``);
- ``attention_scale``: attention scales and query temperatures a family takes from elsewhere (PhiMoE's
  ``short_mscale`` / ``long_mscale``, Llama 4's temperature, the MLA families' softmax scale, Ministral 3's
  ``llama_4_scaling_beta``);
- ``context``: lengths and layer kinds a family says its own way (Gemma 3's ``linear`` within its context, the
  local layer types, M-RoPE's keys);
- ``longrope_only``: Phi-3's and Phi-4-multimodal's config classes, opened to the types rope-extend writes;
- ``recurrent``: the layers of hybrid families whose cache holds a recurrent or convolution state (linear
  attention, Mamba, short convolutions), which no eviction or rotation can change.

Adding a rule: a ``Rule(name, quirk, answer, model_types)`` registered with ``RULES.register`` (a built-in one is
a constant in one of these modules, listed by module path under ``RULES`` in ``rule``); ``tests/test_extension_points.py`` shows a toy one. Every change
``import rope_extend`` makes to transformers is in ``hf.transformers_changes``, not here.
"""

from __future__ import annotations

from . import attention_scale, context, longrope_only, recurrent
from .attention_scale import MSCALE_FUNCTION
from .context import LOCAL_LAYER_TYPES, MROPE_KEYS
from .rule import QUIRKS, RULES, Rule, ask, constant, model_types_for

__all__ = [
    "LOCAL_LAYER_TYPES",
    "MROPE_KEYS",
    "MSCALE_FUNCTION",
    "QUIRKS",
    "RULES",
    "Rule",
    "ask",
    "attention_scale",
    "constant",
    "context",
    "longrope_only",
    "model_types_for",
    "recurrent",
]
