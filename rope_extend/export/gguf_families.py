"""The transformers families the GGUF writer knows, each as llama.cpp's architecture for it plus a few rules.

One ``Family`` per transformers ``model_type``: the ``gguf`` package's architecture (its tensor names come from
``gguf.get_tensor_name_map``), how llama.cpp's graph for it rotates, which rope tensors it reads, and what it
cannot run (``problems``). Facts from llama.cpp at the commit ``llamacpp`` names (src/llama-model.cpp,
``llama_model_rope_type``; src/models/<arch>.cpp, each architecture's hparams, tensors and graph):

- Rotation: ``llama`` rotates adjacent pairs (NORM), so query and key rows are interleaved (``llamacpp``);
  ``qwen2``, ``qwen3``, ``qwen3moe``, ``gemma``, ``gemma2``, ``gemma3`` and ``phi3`` rotate the halves
  ``(j, j + n_rot/2)`` (NEOX) as transformers does: rows are written as they are.
- Rope tensors: ``llama`` reads ``rope_freqs`` (divisors of every frequency) and ``rope_factors_long/short``
  (LongRoPE); ``phi3`` reads only ``rope_factors_long/short`` (chosen once by the served context against
  ``original_context_length``), so a frequency divisor is written as both; the Qwen and Gemma graphs pass no
  factors to ``ggml_rope_ext``: they run plain, linear and YaRN (betas 32 and 1, truncated ramp) only.
- ``qwen2`` / ``qwen3`` / ``gemma`` / ``phi3`` assert ``n_rot == head_dim`` (``qwen2``/``qwen3``) or rotate
  ``rope.dimension_count`` dims (``phi3``); ``phi3`` ignores its sliding window (``n_swa = 0``, "Phi SWA is
  currently disabled"), and ``qwen2``/``qwen3`` have none.
- ``qwen3moe``: every layer is MoE, softmax routing with the top-k weights always renormalised
  (``build_moe_ffn(..., true, ...)``), experts stacked as ``ffn_{gate,up,down}_exps`` (``n_expert`` outermost).
- Gemma: RMSNorm weights are stored as ``1 + w`` (transformers' Gemma norms multiply by ``1 + w``; llama.cpp by
  the weight), embeddings are scaled by ``sqrt(n_embd)``, the query by ``1/sqrt(head_dim)`` (by
  ``1/sqrt(n_embd/n_head)`` for the 27B shapes, 46 layers for Gemma 2 and 62 for Gemma 3, recognised by the layer
  count), the output head is ``token_embd`` (Gemma, Gemma 2), GELU is the tanh form. Gemma 2 always soft-caps
  attention logits and final logits (defaults 50 and 30); Gemma 3 caps final logits only when the key is there.
- Sliding layers (``gemma2``, ``gemma3``): ``attention.sliding_window`` and a per-layer
  ``attention.sliding_window_pattern`` (true = sliding); a key at distance ``>= n_swa`` is masked
  (src/llama-hparams.h), as transformers' ``kv_idx > q_idx - window``. Gemma 2 scales its sliding layers as its
  global ones (``rope_freq_scale_train_swa = rope_freq_scale_train``); Gemma 3's sliding layers take
  ``rope.freq_base_swa`` and frequency scale 1 (src/llama-hparams.h default), but share YaRN's ``attn_factor``
  with the global layers (src/llama-context.cpp), so only YaRN's own temperature leaves them unscaled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedModelError
from ..hf.reading import rotary_geometry
from ..methods.engine_form import LLAMA3, LONGROPE, YARN, Form
from .forms import yarn_attn_factor

ROPE_FREQS, LONG, SHORT = "rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"
LOCAL, GLOBAL = "sliding_attention", "full_attention"  # transformers' layer types


def _nothing(config) -> dict[str, Any]:
    return {}


def _none(config) -> list[str]:
    return []


def _as_is(name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(name, value)]


@dataclass(frozen=True)
class Family:
    """llama.cpp's architecture for one transformers family, and what differs from a plain Llama.

    ``arch``: the ``gguf.MODEL_ARCH`` member; ``pairs``: NORM rotation (query/key rows interleaved);
    ``divisors``: the tensors a frequency divisor is written as (empty: the graph reads none); ``longrope``: it
    reads ``rope_factors_long/short``; ``partial``: it rotates ``rope.dimension_count`` dims of a longer head;
    ``norm_shift``: added to every RMSNorm weight; ``activation``: the MLP's
    activation as transformers names it; ``sliding``: it has sliding-window layers; ``local_rope``: its sliding
    layers keep their own base and no scaling (per-layer-type ``rope_parameters``); ``keys``: the family's own
    metadata (``GGUFWriter.add_<name>`` -> value); ``problems``: what llama.cpp would run differently;
    ``tensors``: rewrites one transformers weight into the ones llama.cpp names."""

    arch: str
    pairs: bool = False
    divisors: tuple[str, ...] = ()
    longrope: bool = False
    norm_shift: float = 0.0
    activation: tuple[str, ...] = ("silu",)
    partial: bool = False
    sliding: bool = False
    local_rope: bool = False
    keys: Callable[[Any], dict[str, Any]] = _nothing
    problems: Callable[[Any], list[str]] = _none
    tensors: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]] = _as_is

    @property
    def arch_name(self) -> str:
        import gguf

        return gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[self.arch]]


# ----------------------------------------------------------------------------------------------- per family
def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_types(config) -> list[str]:
    """Each layer's attention type; a config with a window and no per-layer list slides everywhere (Mistral)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    kind = LOCAL if getattr(config, "sliding_window", None) else GLOBAL
    return [kind] * config.num_hidden_layers


def rope_layer(fam: Family) -> str | None:
    """The layer type whose rope dict the export scales: the global one where sliding layers keep their own."""
    return GLOBAL if fam.local_rope else None


def rotary_dim(config, fam: Family) -> int:
    return rotary_geometry(config, rope_layer(fam))[0]


def _sliding_keys(config) -> dict[str, Any]:
    """Always both: without them llama.cpp's gemma2 assumes a 4096-token window on every other layer."""
    return {
        "sliding_window": int(getattr(config, "sliding_window", None) or 0),
        "sliding_window_pattern": [t == LOCAL for t in layer_types(config)],
    }


def _query_scale(config, big_layers: int) -> list[str]:
    """Gemma's ``query_pre_attn_scalar`` against llama.cpp's: ``head_dim``, or ``n_embd / n_head`` when the
    layer count is the 27B model's."""
    want = (
        config.hidden_size // config.num_attention_heads if config.num_hidden_layers == big_layers else head_dim(config)
    )
    got = getattr(config, "query_pre_attn_scalar", want)
    if got != want:
        return [f"query_pre_attn_scalar {got} (llama.cpp scales queries by 1/sqrt({want}) for this shape)"]
    return []


def _gemma2_keys(config) -> dict[str, Any]:
    return {
        **_sliding_keys(config),
        "attn_logit_softcapping": float(config.attn_logit_softcapping),
        "final_logit_softcapping": float(config.final_logit_softcapping),
    }


def _gemma2_problems(config) -> list[str]:
    problems = _query_scale(config, 46)
    for key, default in (("attn_logit_softcapping", 50), ("final_logit_softcapping", 30)):
        if getattr(config, key, None) is None:
            problems.append(f"no {key} (llama.cpp's gemma2 always soft-caps, at {default} without the key)")
    return problems


def _gemma3_keys(config) -> dict[str, Any]:
    local = (config.rope_parameters or {}).get(LOCAL) or {}
    keys = {**_sliding_keys(config), "rope_freq_base_swa": float(local.get("rope_theta", 10000.0))}
    if getattr(config, "final_logit_softcapping", None):
        keys["final_logit_softcapping"] = float(config.final_logit_softcapping)
    return keys


def _gemma3_problems(config) -> list[str]:
    problems = _query_scale(config, 62)
    if getattr(config, "attn_logit_softcapping", None):
        problems.append("attention soft-capping (llama.cpp's gemma3 has none)")
    local = (config.rope_parameters or {}).get(LOCAL) or {}
    if local.get("rope_type", "default") != "default":
        problems.append(
            f"a {local['rope_type']!r} rope on the sliding layers (llama.cpp's gemma3 gives them their base only)"
        )
    return problems


def _moe_keys(config) -> dict[str, Any]:
    return {
        "expert_count": int(config.num_experts),
        "expert_used_count": int(config.num_experts_per_tok),
        "expert_feed_forward_length": int(config.moe_intermediate_size),
    }


def _qwen3moe_problems(config) -> list[str]:
    problems = []
    if not getattr(config, "norm_topk_prob", True):
        problems.append("norm_topk_prob=false (llama.cpp's qwen3moe always renormalises the top-k weights)")
    if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
        problems.append("dense MLP layers among the MoE ones (llama.cpp's qwen3moe makes every layer MoE)")
    return problems


def _split_experts(name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """transformers 5 stacks each layer's experts as parameters without a ``.weight`` suffix: ``gate_up_proj``
    ``(E, 2F, D)`` (gate first) and ``down_proj`` ``(E, D, F)``; llama.cpp wants ``ffn_gate_exps`` and
    ``ffn_up_exps`` apart, ``(E, F, D)`` each (ggml ``{D, F, E}``), which ``gguf``'s map names from
    ``experts.gate_proj.weight`` / ``experts.up_proj.weight``."""
    if ".experts." not in name or name.endswith((".weight", ".bias")):
        return [(name, value)]
    if name.endswith("experts.gate_up_proj"):
        gate, up = value.chunk(2, dim=1)
        stem = name.removesuffix("gate_up_proj")
        return [(stem + "gate_proj.weight", gate), (stem + "up_proj.weight", up)]
    return [(name + ".weight", value)]


GEMMA_GELU = ("gelu_pytorch_tanh", "gelu_tanh")
LLAMA = Family("LLAMA", pairs=True, divisors=(ROPE_FREQS,), longrope=True)
FAMILIES: dict[str, Family] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": Family("QWEN2"),
    "qwen3": Family("QWEN3"),
    "qwen3_moe": Family("QWEN3MOE", keys=_moe_keys, problems=_qwen3moe_problems, tensors=_split_experts),
    "phi3": Family("PHI3", divisors=(LONG, SHORT), longrope=True, partial=True),
    "gemma": Family("GEMMA", norm_shift=1.0, activation=GEMMA_GELU),
    "gemma2": Family(
        "GEMMA2", norm_shift=1.0, activation=GEMMA_GELU, sliding=True, keys=_gemma2_keys, problems=_gemma2_problems
    ),
    "gemma3_text": Family(
        "GEMMA3",
        norm_shift=1.0,
        activation=GEMMA_GELU,
        sliding=True,
        local_rope=True,
        keys=_gemma3_keys,
        problems=_gemma3_problems,
    ),
}


# ----------------------------------------------------------------------------------------------- checks
def family(config) -> Family:
    kind = getattr(config, "model_type", None)
    found = FAMILIES.get(kind) if isinstance(kind, str) else None
    if found is None:
        raise UnsupportedModelError(
            f"the GGUF writer knows {', '.join(FAMILIES)}, not {kind!r}: export --to transformers4 and convert that "
            "folder with llama.cpp's convert_hf_to_gguf.py, then give it the rope keys this export prints"
        )
    return found


def problems(config, fam: Family, length: int) -> list[str]:
    """What llama.cpp's architecture for ``config`` would run differently at ``length`` tokens."""
    import gguf

    arch = gguf.MODEL_ARCH[fam.arch]
    rotary = rotary_dim(config, fam)
    found = list(fam.problems(config))
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in fam.activation:
        found.append(f"activation {act!r} (llama.cpp's {fam.arch_name} runs {fam.activation[0]})")
    if getattr(config, "mlp_bias", False):
        found.append("MLP biases")
    if rotary != head_dim(config) and not fam.partial:
        found.append(
            f"partial rotary ({rotary} of {head_dim(config)} dims; llama.cpp's {fam.arch_name} rotates the whole head)"
        )
    sliding = [t == LOCAL for t in layer_types(config)]
    window = getattr(config, "sliding_window", None)
    if any(sliding) and not fam.sliding and window is not None and window < length:
        found.append(
            f"a sliding window of {window} tokens, shorter than the {length} served (llama.cpp's {fam.arch_name} "
            "attends to every token)"
        )
    tied = getattr(config, "tie_word_embeddings", False)
    if not tied and gguf.MODEL_TENSOR.OUTPUT not in gguf.MODEL_TENSORS[arch]:
        found.append(f"an output head apart from the embeddings (llama.cpp's {fam.arch_name} reuses token_embd)")
    if any(t not in (LOCAL, GLOBAL) for t in layer_types(config)):
        found.append(f"layer types {sorted(set(layer_types(config)) - {LOCAL, GLOBAL})}")
    return found


def check_rope(form: Form, fam: Family, config) -> None:
    """Refuse a static scaling the architecture's rope cannot say: a frequency divisor where its graph reads
    none, LongRoPE where it reads no long/short factors, a YaRN scale on Gemma 3's unscaled sliding layers."""
    arch = fam.arch_name
    by_keys = form.kind == YARN and (form.values["beta_fast"], form.values["beta_slow"]) == (32.0, 1.0)
    by_keys = by_keys and form.values["truncate"]
    if form.kind in (YARN, LLAMA3) and not by_keys and not fam.divisors:
        what = "llama3" if form.kind == LLAMA3 else "yarn with betas other than 32/1 or truncate=false"
        raise UnsupportedModelError(
            f"{config.model_type}: llama.cpp's {arch} reads no rope_freqs tensor (its graph passes no frequency "
            f"factors), so {what} cannot be written; nearest that exports: yarn with the default betas"
        )
    if form.kind == LONGROPE and not fam.longrope:
        raise UnsupportedModelError(
            f"{config.model_type}: llama.cpp's {arch} reads no rope_factors_long/short tensors, so longrope "
            "cannot be written; nearest that exports: yarn"
        )
    if fam.local_rope and form.kind == YARN and yarn_attn_factor(form) != 1.0:
        raise UnsupportedModelError(
            f"{config.model_type}: llama.cpp's {arch} applies YaRN's attn_factor "
            f"({yarn_attn_factor(form):.6g}) to the sliding layers too, which transformers leaves unscaled; "
            "nearest that exports: yarn with its default attention factor"
        )


def shifted(fam: Family, name: str, value: torch.Tensor) -> torch.Tensor:
    """Gemma's norms multiply by ``1 + w``: stored as ``1 + w`` for llama.cpp's ``x * w``."""
    if fam.norm_shift and name.endswith("norm.weight"):
        return value + fam.norm_shift
    return value
