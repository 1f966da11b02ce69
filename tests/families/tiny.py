"""Tiny random models of every RoPE family in transformers' own registry (no hand-kept list).

``rope_families()`` lists the model types of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and
``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` whose (text) config has ``rope_parameters``; ``tiny_config(model_type)``
makes the family's own config class small (every size-like attribute of the config and of its sub-configs, the vision
and audio towers' included; token ids moved inside the tiny vocabulary) while keeping its layer pattern (sliding and
full, linear and full attention, NoPE, dense and MoE layers); ``build(model_type)`` instantiates the registry's model
class (the image-text-to-text one for a multimodal family) with a fixed seed, or raises ``Unbuildable`` for a family
that cannot be built here; ``text_inputs`` and ``forward_ok`` run a text-only forward.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import warnings

import torch

# size attributes, shrunk wherever a config (or one of its sub-configs) has them; a list of sizes (per layer, per
# stage, per modality) keeps its proportions, its largest entry taking the size
_SIZES = {
    # vocabularies and positions
    "vocab_size": 256,
    "vocab_size_per_layer_input": 256,
    "encoder_hash_byte_group_vocab": 256,
    "num_embeddings": 256,
    "codebook_size": 256,
    "max_position_embeddings": 128,
    "max_seq_len": 128,
    "sliding_window": 32,
    "attention_chunk_size": 32,
    # state-space layers of hybrids (Bamba, Granite 4.0-H, ...): without their kernels, transformers' torch path
    # builds chunk x chunk x state tensors per head (GBs at the defaults on transformers 5.17)
    "mamba_d_state": 16,
    "mamba_chunk_size": 32,
    "ssm_state_size": 16,
    # widths
    "hidden_size": 64,
    "hidden_sizes": 64,
    "d_model": 64,
    "embed_dim": 64,
    "out_hidden_size": 64,
    "projection_dim": 64,
    "projector_hidden_size": 64,
    "projector_input_dim": 64,
    "projector_output_dim": 64,
    "image_token_embed_dim": 64,
    "backbone_hidden_size": 64,
    "hidden_size_per_layer_input": 16,
    "downsample_hidden_size": 16,
    "base_channels": 32,  # no fewer: a VQ-GAN's group norms have 32 groups
    "channel_multiplier": 1,  # a VQ-GAN's channels, the same at every resolution
    "latent_channels": 32,
    "output_channels": 32,
    "downsample_channels": 64,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "o_lora_rank": 32,
    # feed-forward widths
    "intermediate_size": 96,
    "intermediate_size_mlp": 96,
    "dense_intermediate_size": 96,
    "alignment_intermediate_size": 96,
    "ffn_hidden_size": 96,
    "ffn_dim": 96,
    "encoder_ffn_dim": 96,
    "mlp_dim": 96,
    "moe_intermediate_size": 32,
    "moe_hidden_size": 32,
    "expert_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "share_expert_dim": 32,
    # heads
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_heads": 4,
    "n_heads": 4,
    "encoder_attention_heads": 4,
    "head_dim": 16,  # the smallest head dim of a config; the others (global, rope, nope, v, linear...) keep their ratio
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    # experts
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "zero_expert_num": 2,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "top_k_experts": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "n_group": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
    # depths (other than the decoder's, which keeps its layer pattern) and images
    "depth": 2,
    "encoder_layers": 2,
    "num_res_blocks": 1,
    "image_size": 28,
    "patch_size": 14,
    "vision_feature_layer": -1,
}
# size attributes whose default None the model cannot do without (None would mean "as many as the heads" for kv heads)
_NEEDED = {"head_dim", "num_key_value_heads", "num_experts_per_tok", "top_k_experts", "moe_intermediate_size"}
_NEEDED |= {"n_routed_experts", "n_shared_experts", "num_experts"}
# never more than before
_AT_MOST = {"num_experts_per_tok", "num_experts_per_token", "top_k_experts", "moe_topk", "n_shared_experts", "n_group"}
_AT_MOST |= {"num_shared_experts", "num_expert_group", "topk_group", "first_k_dense_replace", "num_dense_layers"}
_AT_MOST |= {"moe_k", "zero_expert_num", "hidden_size_per_layer_input", "vocab_size_per_layer_input", "vocab_size"}
_LAYERS = ("num_hidden_layers", "num_layers", "n_layers")  # the layer count, whatever the config calls it
# token ids: text specials, and the ids of image/video/audio placeholders and markers
_SPECIAL = re.compile(r"^_?(pad|bos|eos|eod|sep|cls|mask|unk)_token_id$")
_TOKEN = re.compile(r"(token_(id|ids|index)|_patch_id|^im_\w+_id)$")
# lists of layer indices (cross-attention, hybrid, MoE, full-attention layers...)
_INDICES = re.compile(r"layer|idx|ids|indices|indexes")
# other widths that equal one of the config's hidden sizes (adapters, projectors, global and encoder widths) follow it
_WIDTH = re.compile(r"hidden|_dim$|_size$|channel")

# arguments without which a config cannot even be constructed
_ARGS = {
    "gemma4_assistant": {  # the assistant's validator rejects the per-layer inputs its gemma4_text default has
        "text_config": {"model_type": "gemma4_text", "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}
    },
}
_LFM2 = ["conv", "conv", "full_attention", "conv"] * 8  # LFM2's conv and attention layers
# merged into the default config before it is shrunk (so that layer lists are full length): what the generic rules
# cannot know, mostly defaults that no real checkpoint has and that the model cannot run with
_OVERRIDES = {
    # defaults without a single attention layer (pure Mamba, which a RoPE test cannot use): Bamba-9B's attention layers
    "bamba": {"attn_layer_indices": [9, 18, 27]},
    # the same for Granite 4.0-H (9 mamba layers to 1 attention layer), with RoPE on (position_embedding_type=None)
    "granitemoehybrid": {
        "num_hidden_layers": 40,
        "layer_types": (["linear_attention"] * 9 + ["full_attention"]) * 4,
        "position_embedding_type": "rope",
    },
    # LFM2's defaults have no conv layer (lfm2) or no layer_types at all (lfm2_moe), which the model indexes
    "lfm2": {"layer_types": _LFM2},
    "lfm2_vl": {"text_config": {"layer_types": _LFM2}},
    "lfm2_moe": {"layer_types": _LFM2},
    # no default mlp_layer_types, which the model indexes: DeepSeek's first dense, then MoE layers
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense"] + ["sparse"] * 31}},
    # the model reads the image token from a vocabulary map that defaults to None (its ids move like token ids)
    "chameleon": {"vocabulary_map": {"<image>": 8711}},
    "emu3": {"vocabulary_map": {"<image>": 151851}},
    # HunYuan-VL rotates with 4 axes (xdrope) and has no section default
    "hunyuan_vl": {"text_config": {"rope_parameters": {"mrope_section": [16, 16, 16, 16]}}},
    # the forward builds a sliding-window mask even when no layer slides
    "step3p7": {"text_config": {"sliding_window": 512}},
    # the attention reads rope_theta from attn_config, which does not have one
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},  # and clamps with clip_qkv (DBRX's 8)
    # the vision projector needs its layer map
    "granite4_vision": {"deepstack_layer_map": [[-1, 0]], "downsample_rate": "1/4"},
}
# indexed-attention layers need the QSA indexer (no defaults): head as big as the attention's, budget under 24 tokens
_QSA = {
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 256,
    "indexer_budget": 16,
    "indexer_compress_ratio": 4,
}
_OVERRIDES |= {"qwen4_exp_text": _QSA, "qwen4_exp": {"text_config": _QSA}}
# families that transformers itself cannot build: tried anyway, Unbuildable(reason) if they fail
_BROKEN = dict.fromkeys(
    ("gemma4_assistant", "gemma4_unified_assistant"),
    "an assistant shares KV on every layer, which kv_sharing_modes rejects (transformers bug)",
)


def rope_families() -> list[str]:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    out = []
    for mt in sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)):
        try:
            config = _defaults(mt)
        except Exception:  # noqa: BLE001 - a config that cannot be built with defaults is reported by build()
            out.append(mt)
            continue
        text = config.get_text_config(decoder=True)
        if getattr(text, "rope_parameters", None):
            out.append(mt)
    return out


def _is_config_dict(value) -> bool:
    return isinstance(value, dict) and ("model_type" in value or "hidden_size" in value)


def _pattern_length(values: dict, layers: int) -> int:
    """The shortest prefix of the per-layer lists that holds every value each of them has (the pattern); 2 at least."""
    k = min(2, layers)
    for seq in values.values():
        need = set(map(repr, seq))
        k = max(k, next(n for n in range(1, len(seq) + 1) if set(map(repr, seq[:n])) == need))
    return k


def _is_index_list(value, layers: int) -> bool:
    """A list of layer indices (e.g. the cross-attention, the hybrid or the MoE layers)."""
    ints = isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    return bool(ints) and value == sorted(set(value)) and value[-1] < layers and (len(value) < layers or value[0] == 0)


def _token(key: str, value, tokens: dict):
    """A token id inside the tiny vocabulary: text specials (pad, bos, eos...) keep a small id that already fits,
    other ids (image, video, audio...) always move to the top of the vocabulary, away from the ids a text-only
    forward draws (3..199). One original id maps to one new id across sub-configs."""
    if isinstance(value, list):
        return [_token(key, v, tokens) for v in value]
    if not isinstance(value, int) or isinstance(value, bool) or (_SPECIAL.match(key) and value < 200):
        return value
    return tokens.setdefault(value, _SIZES["vocab_size"] - 1 - len(tokens))


def _mrope(rope: dict, rotary_dim: int) -> dict:
    """``rope_parameters`` (or its per-layer-type dicts) with ``mrope_section`` rescaled to sum to half the rotary dim."""
    if not isinstance(rope, dict):
        return rope
    rope = {k: _mrope(v, rotary_dim) for k, v in rope.items()}
    sections = rope.get("mrope_section")
    if sections:
        half = int(rotary_dim * rope.get("partial_rotary_factor", 1.0)) // 2
        new = [max(1, s * half // sum(sections)) for s in sections]
        odd = [i for i, s in enumerate(sections) if sections.count(s) == 1]  # equal sections stay equal
        new[odd[0] if odd else 0] += half - sum(new)
        rope["mrope_section"] = new
    return rope


def _shrunk(d: dict, tokens: dict, hidden: set, extra: int = 0) -> dict:
    """Shrunk keyword arguments for a config whose ``to_dict()`` is ``d`` (recursing into sub-configs); ``tokens``
    maps the token ids met so far, ``hidden`` holds the hidden sizes of the whole config, ``extra`` adds layers
    beyond the pattern where a layer kind derived from the layer count would otherwise go missing."""
    out = {}
    heads = d.get("num_attention_heads", d.get("num_heads"))
    for key, value in d.items():
        integer = isinstance(value, int) and not isinstance(value, bool)
        if _is_config_dict(value):  # a sub-config: all of its values, as the composite default made it
            out[key] = {**value, **_shrunk(value, tokens, hidden, extra)}
        elif _TOKEN.search(key):
            out[key] = _token(key, value, tokens)
        elif key == "vocabulary_map" and isinstance(value, dict):
            out[key] = {name: _token(key, i, tokens) for name, i in value.items()}
        elif key == "vision_feature_layer" and isinstance(value, list):
            out[key] = [-1 - i for i in range(len(value))]
        elif key in _SIZES and isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            out[key] = [max(1, _SIZES[key] * v // max(value)) for v in value]
        elif key in _SIZES and (integer or value is None and key in _NEEDED):
            new = _SIZES[key]
            if key == "num_key_value_heads" and value in (None, heads):  # keep multi-head attention where it is
                new = _SIZES["num_attention_heads"]
            out[key] = min(new, value) if key in _AT_MOST and value is not None else new
        elif integer and value in hidden and _WIDTH.search(key):
            out[key] = _SIZES["hidden_size"]
    dims = {k: v for k, v in d.items() if k.endswith("head_dim") and isinstance(v, int) and v > 0}
    out.update({k: max(1, v * _SIZES["head_dim"] // min(dims.values())) for k, v in dims.items()})
    if isinstance(d.get("rope_parameters"), dict):
        width, n_heads = out.get("hidden_size", d.get("hidden_size")), out.get("num_attention_heads", heads)
        out["rope_parameters"] = _mrope(d["rope_parameters"], out.get("head_dim") or (width or 0) // (n_heads or 1))
    key = next((k for k in _LAYERS if isinstance(d.get(k), int)), None)
    if key:
        _shrink_layers(d, out, key, extra)
    return out


def _shrink_layers(d: dict, out: dict, key: str, extra: int) -> None:
    """Into ``out``: the layer count ``key`` cut to one whole pattern of layer kinds (plus ``extra``), and every
    per-layer list, index list and per-layer config cut with it."""
    layers, per_layer = d[key], {int(i): o for i, o in (d.get("per_layer_config") or {}).items()}
    indices = {k: v for k, v in d.items() if _INDICES.search(k) and _is_index_list(v, layers)}
    lists = {k: v for k, v in d.items() if isinstance(v, list) and len(v) == layers and k not in indices}
    kinds = {**lists, **{k: [i in v for i in range(layers)] for k, v in indices.items()}}
    if per_layer:
        kinds["per_layer_config"] = [per_layer.get(i) for i in range(layers)]
    n = min(layers, _pattern_length(kinds, layers) + extra)
    if 0 < (d.get("num_kv_shared_layers") or 0) < layers:  # the last layers reuse the KV of a whole pattern
        out["num_kv_shared_layers"], n = n, min(layers, 2 * n)
    out[key] = n
    out.update({k: out.get(k, seq)[:n] for k, seq in lists.items()})
    out.update({k: [i for i in v if i < n] for k, v in indices.items()})

    def scaled(k, v):  # a per-layer size scaled like the global one (e.g. a bigger head_dim on full attention)
        return max(1, v * out[k] // d[k]) if k in out and isinstance(d.get(k), int) and d[k] else v

    if per_layer:
        out["per_layer_config"] = {i: {k: scaled(k, v) for k, v in o.items()} for i, o in per_layer.items() if i < n}


def _kinds(config) -> dict:
    """The per-layer lists of a config, its properties included (e.g. ``layers_block_type``): name -> set of values."""
    n, out = getattr(config, "num_hidden_layers", None), {}
    for name in dir(config):
        if ("layer" in name or "block" in name) and not name.startswith("_"):
            try:
                value = getattr(config, name)
            except Exception:  # noqa: BLE001,S112 - a property that does not apply to this config
                continue
            if isinstance(value, list | tuple) and n and len(value) == n and not _is_index_list(list(value), n):
                out[name] = set(map(repr, value))
    return out


def _items(d: dict):
    """(sub-config dict, key, value) for every value of a config dict and of its sub-configs."""
    for key, value in d.items():
        yield from _items(value) if _is_config_dict(value) else [(d, key, value)]


def _merged(base: dict, over: dict) -> dict:
    return {**base, **{k: _merged(base[k], v) if isinstance(base.get(k), dict) else v for k, v in over.items()}}


def _defaults(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CONFIG_MAPPING[model_type](**_ARGS.get(model_type, {}))


def _mrope_default(model_type: str, text) -> list[int] | None:
    """The ``mrope_section`` the modeling code of the family (or of its text model) falls back to when the config has
    none."""
    import importlib
    import importlib.util
    import inspect

    names = {model_class(model_type).__module__, type(text).__module__.replace(".configuration_", ".modeling_")}
    for name in sorted(n for n in names if importlib.util.find_spec(n)):
        found = re.search(r'get\("mrope_section", \[([\d, ]+)\]\)', inspect.getsource(importlib.import_module(name)))
        if found:
            return [int(x) for x in found.group(1).split(",")]
    return None


@functools.cache
def tiny_config(model_type: str):
    default = _defaults(model_type)
    cls, d = type(default), _merged(default.to_dict(), _OVERRIDES.get(model_type, {}))
    text = default.get_text_config(decoder=True)
    sub = next((v for v in d.values() if _is_config_dict(v) and v.get("model_type") == text.model_type), d)
    rope = sub.get("rope_parameters")
    unsectioned = isinstance(rope, dict) and "rope_theta" in rope and "mrope_section" not in rope
    if unsectioned and (section := _mrope_default(model_type, text)):  # spelled out, for the shrinker to rescale
        sub["rope_parameters"] = {**rope, "mrope_section": section}
    # the widths that other widths may copy (not the small ones, such as a VQ-GAN's, which coincide too easily)
    hidden = {v for _, k, v in _items(d) if k in ("hidden_size", "d_model") and isinstance(v, int) and v >= 256}
    top = {k: d[k] for k in {**_ARGS.get(model_type, {}), **_OVERRIDES.get(model_type, {})}}  # class defaults: the rest
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = _kinds(cls(**top).get_text_config(decoder=True))
        for extra in range(8):  # more layers while a layer kind of the default is missing (e.g. a repeated block list)
            config = cls(**{**top, **_shrunk(d, {}, hidden, extra)})
            got = _kinds(config.get_text_config(decoder=True))
            if all(values <= got.get(name, set()) for name, values in want.items()):
                break
    return config


def model_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type) or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    return getattr(transformers, name)


class Unbuildable(Exception):
    """A family that cannot be built here; the message says why in one line."""


def _instantiate(model_type: str, config, seed: int, attn_implementation: str):
    import copy

    torch.manual_seed(seed)
    return model_class(model_type)._from_config(copy.deepcopy(config), attn_implementation=attn_implementation)


def build(model_type: str, seed: int = 0, attn_implementation: str = "sdpa"):
    """The family's tiny random model; a family without sdpa support falls back to eager
    (``model.config._attn_implementation`` says which one it got)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = tiny_config(model_type)
            try:
                model = _instantiate(model_type, config, seed, attn_implementation)
            except ValueError as e:
                if attn_implementation != "sdpa" or "does not support an attention implementation" not in str(e):
                    raise
                model = _instantiate(model_type, config, seed, "eager")
    except ImportError as e:
        if "timm" in str(e) and importlib.util.find_spec("timm") is None:
            raise Unbuildable("needs timm") from e
        raise
    except Exception as e:
        if model_type in _BROKEN:
            raise Unbuildable(_BROKEN[model_type]) from e
        raise
    return model.eval()


def text_inputs(model_type: str, input_ids: torch.Tensor) -> dict:
    """The keyword arguments of a text-only forward of the family's model: ``input_ids`` and what it cannot do without."""
    config, kwargs = tiny_config(model_type), {"input_ids": input_ids}
    if config.is_encoder_decoder:
        kwargs["decoder_input_ids"] = input_ids
    if model_type == "idefics":  # every forward cross-attends to images: one blank image that no token attends to
        kwargs["image_encoder_embeddings"] = torch.zeros(len(input_ids), 1, 1, config.vision_config.embed_dim)
        kwargs["image_attention_mask"] = torch.zeros(*input_ids.shape, 1, dtype=torch.long)
    if model_type == "blt":  # its cache asks the top config for num_hidden_layers, which it has not (transformers bug)
        kwargs["use_cache"] = False
    return kwargs


def forward_ok(model, length: int = 24) -> bool:
    """Whether a text-only forward of a built model (on random ids of the shared vocabulary) gives finite logits; an
    error propagates."""
    input_ids = torch.randint(3, 200, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(**text_inputs(model.config.model_type, input_ids)).logits
    return bool(torch.isfinite(logits).all())
