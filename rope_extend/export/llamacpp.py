"""llama.cpp: a GGUF file with the scaling in llama.cpp's own metadata keys, written with the ``gguf`` package.

The families it writes, each as its llama.cpp architecture with its own rules (rotation, rope tensors, norms,
sliding layers, experts) and refusals, are in ``gguf_families``; what follows holds for all of them.

Facts from llama.cpp at commit 0c1e57098 (the copy vendored by llama-cpp-python 0.3.36, which the parity tests
run); file references are to that tree:

- ``{arch}.rope.scaling.type`` must be ``none``, ``linear``, ``yarn`` or ``longrope`` (any other string aborts
  the loader, src/llama-model.cpp); no type means ``linear`` with the factor (1 when absent).
- YaRN: cos and sin are scaled by ``rope.scaling.attn_factor * (0.1 ln s + 1)`` (ggml ``rope_yarn``, and
  src/llama-context.cpp cancelling and re-applying the temperature), so a transformers ``attention_factor``
  ``A`` is written as ``A / (0.1 ln s + 1)``. The ramp ends are always ``floor``/``ceil`` (transformers'
  ``truncate=True``). The llama architecture reads no ``yarn_beta_*`` key: its betas are 32 and 1 unless given
  on the command line, so other betas are written as a frequency tensor instead.
- ``rope_freqs.weight`` (F32, ``n_rot / 2``): llama.cpp divides each frequency by it (src/models/llama.cpp
  loads it for the llama architecture; ggml ``theta_extrap = theta / ff``). llama.cpp's own converter stores
  Llama 3.1 scaling this way; here every static frequency scaling that the keys above cannot say exactly
  (llama3, YaRN with other betas or ``truncate=false``) goes this way: ``ff_i = theta_i / theta'_i``, with the
  attention scale in ``rope.scaling.attn_factor`` (type ``none``: cos and sin times ``attn_factor``).
- LongRoPE: type ``longrope``, ``rope_factors_long/short.weight`` and ``attn_factor``, no ``factor`` (it would
  apply ``1/factor`` on top). llama.cpp picks the long factors once, when the context it is started with is
  longer than ``original_context_length``, where transformers picks per forward by the sequence length.
- The llama architecture rotates adjacent pairs (``LLAMA_ROPE_TYPE_NORM``): the converter interleaves the two
  halves of every query and key head (``permute`` in conversion/llama.py), undone by transformers' GGUF reader.
- Self-Extend: ``--grp-attn-n`` / ``--grp-attn-w`` are accepted by ``llama-completion`` only (and
  ``llama-passkey``'s ``--grp-attn-n``); ``llama-cli`` and ``llama-server`` reject them (common/arg.cpp).
- ``{arch}.context_length`` and ``rope.scaling.original_context_length`` are uint32 keys: the ``gguf`` writer
  packs them as such (``add_context_length``, ``add_uint32``) and llama.cpp reads them into ``uint32_t``
  (``hparams.n_ctx_train``, ``n_ctx_orig_yarn``; ``get_key`` refuses any other type), so ``2^32 - 1`` tokens is
  the most a file can say (``check_context``).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import RopeExtendError, UnsupportedModelError
from ..hf.reading import text_config
from ..methods.engine_form import DEFAULT, LINEAR, LLAMA3, LONGROPE, YARN, Form
from . import gguf_spm
from .forms import yarn_attn_factor
from .gguf_families import LONG, ROPE_FREQS, SHORT, Family, check_rope, family, head_dim, problems, rotary_dim, shifted
from .gguf_name import gguf_name

LLAMACPP_VERSION = "llama.cpp 0c1e57098 (llama-cpp-python 0.3.36)"
UINT32_MAX = 2**32 - 1  # the context length keys' type in GGUF and in llama.cpp
YARN_BETAS = (32.0, 1.0)  # the llama architecture's fixed betas
DTYPES = ("f32", "f16", "bf16", "q8_0")
# llama.cpp names a BPE tokenizer's pre-tokenizer (tokenizer.ggml.pre); its converter recognises a tokenizer by
# hashing how it splits a test text. Here: by the SHA-256 of its vocabulary and merges (vocab_digest).
KNOWN_PRE = {
    "b847062bc5041a40fbec6efc177e947f8c533723a99840b601654cf615f20021": "smollm",  # SmolLM2 (smollm2-135m)
    # the bundled model's: digits one by one, then GPT-2's byte-level split, as SmolLM2's (its tokenizer.json)
    "121094e891ace888e9008f7eeb898980ec3f3a8796d1ddc18593021136d660e2": "smollm",
}


# ----------------------------------------------------------------------------------------------- rope
def rope_metadata(
    form: Form, plain_freqs: torch.Tensor, scaled_freqs: torch.Tensor, divisors: tuple[str, ...] = (ROPE_FREQS,)
) -> tuple[dict, dict, str]:
    """``(keys, tensors, how)``: the rope metadata (names without the ``{arch}.`` prefix), the extra tensors
    (``rope_freqs``, ``rope_factors_*``) and a one-line description, for a static ``form``.

    ``plain_freqs`` and ``scaled_freqs`` are the unscaled and scaled inverse frequencies (float32, ``d/2``):
    their ratio is written as each of ``divisors`` (the family's frequency-divisor tensors, ``gguf_families``)
    when the keys cannot say the scaling exactly."""
    keys: dict[str, Any] = {"rope.freq_base": float(form.base)}
    if form.kind == DEFAULT:
        keys["rope.scaling.type"] = "none"
        return keys, {}, f"rope.freq_base {form.base:g}"
    keys["rope.scaling.original_context_length"] = int(form.original_length)
    if form.kind == LINEAR:
        keys.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(form.factor)})
        return keys, {}, f"rope.scaling.type linear, factor {form.factor:g}"
    if (
        form.kind == YARN
        and (form.values["beta_fast"], form.values["beta_slow"]) == YARN_BETAS
        and form.values["truncate"]
    ):
        keys.update({"rope.scaling.type": "yarn", "rope.scaling.factor": float(form.factor)})
        attn = yarn_attn_factor(form)
        if attn != 1.0:
            keys["rope.scaling.attn_factor"] = attn
        return (
            keys,
            {},
            f"rope.scaling.type yarn, factor {form.factor:g}" + (f", attn_factor {attn:.6g}" if attn != 1.0 else ""),
        )
    if form.kind == LONGROPE:
        keys.update({"rope.scaling.type": "longrope", "rope.scaling.attn_factor": float(form.attention_scale)})
        tensors = {
            LONG: np.asarray(form.values["long_factor"], dtype=np.float32),
            SHORT: np.asarray(form.values["short_factor"], dtype=np.float32),
        }
        return keys, tensors, "rope.scaling.type longrope, rope_factors_long/short tensors"
    if form.kind in (YARN, LLAMA3):  # frequencies by tensor: exact whatever the betas or the blend
        ratio = (plain_freqs.double() / scaled_freqs.double()).float().numpy()
        keys["rope.scaling.type"] = "none"
        if form.attention_scale != 1.0:
            keys["rope.scaling.attn_factor"] = float(form.attention_scale)
        names = " and ".join(name.removesuffix(".weight") for name in divisors)
        how = f"{names} (frequency divisors)" + (
            f", attn_factor {form.attention_scale:.6g}" if form.attention_scale != 1.0 else ""
        )
        return keys, dict.fromkeys(divisors, ratio), how
    raise RopeExtendError(f"llama.cpp has no rope metadata for a {form.kind!r} scaling")


def check_context(length: int, factor: float | None, original: int | None) -> None:
    """Refuse, before anything is read or written, a context the file cannot say: ``length`` (the target,
    ``factor`` x ``original``, or the model's own when there is no scaling) past a uint32."""
    if length <= UINT32_MAX:
        return
    if factor is None or original is None:
        raise RopeExtendError(
            f"the model's context of {length} tokens does not fit GGUF's context_length, a uint32 in the file and in "
            f"llama.cpp (at most {UINT32_MAX})"
        )
    raise RopeExtendError(
        f"factor {factor:g} x L={original} gives a context of {length} tokens, past GGUF's context_length, a uint32 "
        f"in the file and in llama.cpp (at most {UINT32_MAX}): give a factor of at most {UINT32_MAX // original} "
        f"for L={original}"
    )


def self_extend_flags(group_size: int, window: int) -> list[str]:
    """``--grp-attn-n G --grp-attn-w W``; llama.cpp requires ``W`` to be a multiple of ``G``."""
    if window % group_size:
        lower = (window // group_size) * group_size
        raise RopeExtendError(
            f"llama.cpp's group attention needs --grp-attn-w to be a multiple of --grp-attn-n, got window={window}, "
            f"group_size={group_size}: use window={lower or group_size} or "
            f"window={lower + group_size}"
        )
    return ["--grp-attn-n", str(group_size), "--grp-attn-w", str(window)]


# ----------------------------------------------------------------------------------------------- model
def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise RopeExtendError(f"unknown GGUF dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    return dtype


def check_family(config, form: Form | None = None, length: int | None = None) -> Family:
    """The family's ``Family`` (``gguf_families``), or a refusal naming what llama.cpp's architecture for it
    would run differently (at ``length`` tokens, with the scaling ``form``); reads no weight."""
    if text_config(config) is not config:
        raise UnsupportedModelError(
            f"{config.model_type}: the GGUF writer writes text models only (llama.cpp keeps a vision or audio tower "
            "in a separate mmproj file): load the text model (AutoModelForCausalLM) and export that"
        )
    fam = family(config)
    found = problems(config, fam, int(length or config.max_position_embeddings))
    if found:
        raise UnsupportedModelError(
            f"{config.model_type}: cannot write llama.cpp's {fam.arch_name} architecture for a model with "
            f"{'; '.join(found)}"
        )
    if form is not None:
        check_rope(form, fam, config)
    return fam


def interleave_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head reordered from transformers' halves ``(j, j + hd/2)`` to llama.cpp's adjacent pairs
    ``(2j, 2j + 1)``: ``new[h, 2j + k] = old[h, k hd/2 + j]`` (biases too)."""
    rows = weight.shape[0]
    head = rows // heads
    return weight.reshape(heads, 2, head // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _encode(array: np.ndarray, dtype: str, gguf) -> tuple[np.ndarray, Any]:
    """The tensor as stored: norms and other 1-D tensors stay F32 (as llama.cpp's converter keeps them)."""
    q = gguf.GGMLQuantizationType
    if array.ndim == 1 or dtype == "f32":
        return array.astype(np.float32), q.F32
    if dtype == "f16":
        return array.astype(np.float16), q.F16
    if dtype == "bf16":  # rounded to nearest even, as torch's .to(torch.bfloat16)
        return gguf.quants.quantize(array.astype(np.float32), q.BF16), q.BF16
    if array.shape[-1] % 32:  # q8_0 blocks are 32 values along a row
        return array.astype(np.float16), q.F16
    return gguf.quants.quantize(array.astype(np.float32), q.Q8_0), q.Q8_0


def weight_tensors(model, fam: Family, dtype: str):
    """``(gguf name, array, ggml type)`` for every weight, in the names ``gguf`` gives ``fam``'s architecture."""
    import gguf

    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[fam.arch], config.num_hidden_layers)
    tied = getattr(config, "tie_word_embeddings", False)
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and tied:
            continue  # llama.cpp uses token_embd when output.weight is absent
        if "rotary_emb" in key:  # buffers, not weights
            continue
        for name, value in fam.tensors(key, tensor.detach().to(torch.float32).cpu()):
            target = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if target is None:
                raise UnsupportedModelError(
                    f"no llama.cpp {fam.arch_name} name for the weight {name!r}: the model is not a plain "
                    f"{config.model_type}"
                )
            value = shifted(fam, name, value)
            if fam.pairs and name.endswith(("q_proj.weight", "q_proj.bias")):
                value = interleave_halves(value, config.num_attention_heads)
            elif fam.pairs and name.endswith(("k_proj.weight", "k_proj.bias")):
                value = interleave_halves(value, config.num_key_value_heads)
            array, kind = _encode(value.numpy(), dtype, gguf)
            yield target, array, kind


# ----------------------------------------------------------------------------------------------- tokenizer
def vocab_digest(tokenizer) -> str:
    """SHA-256 of a BPE tokenizer's vocabulary and merges (what ``KNOWN_PRE`` is keyed by)."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    blob = json.dumps([sorted(model["vocab"].items(), key=lambda kv: kv[1]), merges], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def tokenizer_metadata(tokenizer, vocab_size: int, pre: str | None) -> dict[str, Any]:
    """llama.cpp's tokenizer keys from a transformers fast tokenizer: ``gpt2`` for a byte-level BPE, ``llama``
    (SPM) for a SentencePiece BPE with byte fallback (``gguf_spm``)."""
    data = gguf_spm.pipeline(tokenizer)
    model = data.get("model", {})
    if model.get("type") == "BPE" and "ByteLevel" in json.dumps(data.get("pre_tokenizer")):
        out = _gpt2_metadata(tokenizer, data, vocab_size, pre)
    elif pre is not None:
        raise RopeExtendError(
            f"tokenizer_pre={pre!r} (--tokenizer-pre) names how llama.cpp's gpt2 model splits text, and this "
            "tokenizer is not a byte-level BPE: leave it out"
        )
    else:
        out = gguf_spm.spm_metadata(tokenizer, data, vocab_size)
    for key, attr in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("unk", "unk_token_id"),
        ("pad", "pad_token_id"),
    ):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            out[f"{key}_token_id"] = int(value)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        out["chat_template"] = template
    return out


def _gpt2_metadata(tokenizer, data: dict, vocab_size: int, pre: str | None) -> dict[str, Any]:
    model = data["model"]
    if pre is None:
        pre = KNOWN_PRE.get(vocab_digest(tokenizer))
    if pre is None:
        raise RopeExtendError(
            "llama.cpp must be told how this tokenizer splits text before BPE (tokenizer.ggml.pre) and rope-extend "
            "does not know it: pass tokenizer_pre=NAME (--tokenizer-pre), the name llama.cpp's "
            "convert_hf_to_gguf.py prints for this model (e.g. llama-bpe, qwen2, smollm)"
        )
    by_id = {i: t for t, i in model["vocab"].items()}
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    for token in added.values():
        gguf_spm.check_added_flags(token)
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(3 if added[i].get("special") else 4)  # CONTROL / USER_DEFINED
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(1)  # NORMAL
        else:
            tokens.append(f"[PAD{i}]")
            types.append(5)  # UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    # what the tokenizer adds, found by running it: its add_bos_token attribute need not be what its
    # post-processor does (a tokenizer.json whose template adds BOS, with no add_bos_token in its config)
    bos, eos = gguf_spm.special_ends(tokenizer)
    return {
        "model": "gpt2",
        "pre": pre,
        "tokens": tokens,
        "token_type": types,
        "merges": merges,
        "add_bos_token": bos,
        "add_eos_token": eos,
    }


# ----------------------------------------------------------------------------------------------- writing
def write(
    path: Path,
    model,
    tokenizer,
    rope_keys: dict[str, Any],
    rope_tensors: dict[str, np.ndarray],
    *,
    context: int,
    dtype: str = "f32",
    tokenizer_pre: str | None = None,
    name: str = "",
) -> list[str]:
    """Write ``model`` (a transformers model of a family ``gguf_families`` knows) as a GGUF file at ``path``;
    returns what llama.cpp's tokenizer does differently from ``tokenizer`` (notes for the result)."""
    import gguf

    check_dtype(dtype)
    config = model.config
    fam = check_family(config, length=context)
    try:  # before anything is written
        vocab = tokenizer_metadata(tokenizer, config.vocab_size, tokenizer_pre)
    except UnsupportedModelError as exc:  # a tokenizer llama.cpp's converter writes: say how to add the rope
        raise UnsupportedModelError(f"{exc}, then {override_flags(fam.arch_name, rope_keys, rope_tensors)}") from None
    general_name, name_notes = gguf_name(config, gguf_spm.pipeline(tokenizer), name)
    writer = gguf.GGUFWriter(path, fam.arch_name)
    writer.add_name(general_name)
    _add_hparams(writer, config, fam, context, dtype)
    _add_rope(writer, fam.arch_name, rope_keys)
    writer.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:  # gpt2 only: llama.cpp's SPM tokenizer has no pre-tokenizer
        writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["token_type"])
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])
    if "scores" in vocab:
        writer.add_token_scores(vocab["scores"])
    writer.add_add_bos_token(vocab["add_bos_token"])
    if "add_eos_token" in vocab:
        writer.add_add_eos_token(vocab["add_eos_token"])
    if "add_space_prefix" in vocab:
        writer.add_add_space_prefix(vocab["add_space_prefix"])
    for key in ("bos", "eos", "unk", "pad"):
        if f"{key}_token_id" in vocab:
            getattr(writer, {"unk": "add_unk_token_id", "pad": "add_pad_token_id"}.get(key, f"add_{key}_token_id"))(
                vocab[f"{key}_token_id"]
            )
    if "chat_template" in vocab:
        writer.add_chat_template(vocab["chat_template"])
    for tensor_name, array in rope_tensors.items():
        writer.add_tensor(tensor_name, np.ascontiguousarray(array, dtype=np.float32))
    for tensor_name, array, kind in weight_tensors(model, fam, dtype):
        writer.add_tensor(tensor_name, array, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return list(vocab.get("notes", [])) + name_notes


def _add_hparams(writer, config, fam: Family, context: int, dtype: str) -> None:
    """The architecture's shape keys, and the family's own (``gguf_families``)."""
    import gguf

    writer.add_file_type(
        {
            "f32": gguf.LlamaFileType.ALL_F32,
            "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        }.get(dtype, gguf.LlamaFileType.MOSTLY_Q8_0)
    )
    writer.add_context_length(int(context))
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(rotary_dim(config, fam))
    dim = head_dim(config)
    if dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(dim)
        writer.add_value_length(dim)
    for key, value in fam.keys(config).items():
        getattr(writer, f"add_{key}")(value)


def _add_rope(writer, arch: str, rope_keys: dict[str, Any]) -> None:
    for key, value in rope_keys.items():
        full = f"{arch}.{key}"
        if isinstance(value, str):
            writer.add_string(full, value)
        elif isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        else:
            writer.add_float32(full, float(value))


def override_flags(arch: str, keys: dict[str, Any], tensors: dict[str, np.ndarray]) -> str:
    """How to give a file converted elsewhere this export's rope: llama.cpp's ``--override-kv KEY=TYPE:VALUE``
    flags (common/arg.cpp) for the keys; a rope tensor cannot be given that way."""
    kinds = {str: "str", bool: "bool", int: "int", float: "float"}
    flags = " ".join(f"--override-kv {arch}.{key}={kinds[type(value)]}:{value}" for key, value in keys.items())
    if tensors:
        names = ", ".join(name.removesuffix(".weight") for name in tensors)
        return f"serve it with {flags}; the {names} tensors this scaling needs cannot be given by a flag"
    return f"serve it with {flags}"


def serve_command(path: Path, context: int, extra: list[str] | None = None, tool: str = "llama-server") -> str:
    """The command that serves the file at ``context`` tokens (the rope settings come from the file)."""
    parts = [tool, "-m", str(path), "-c", str(math.ceil(context))]
    return " ".join(parts + list(extra or []))
