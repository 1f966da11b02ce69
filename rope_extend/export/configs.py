"""The rope settings of a transformers-format config as vLLM, SGLang and transformers 4 read them.

Read from each engine's source at a pinned version (the wheels on PyPI):

- **vLLM 0.33.0** (``vllm/model_executor/layers/rotary_embedding/__init__.py``, ``get_rope``): reads transformers
  5's ``rope_parameters`` (``rope_theta`` inside it); ``yarn`` takes ``factor``,
  ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``,
  ``attention_factor`` (the final scale, as transformers) and ``truncate``; ``llama3`` and ``longrope`` as
  transformers (``longrope``'s scale from ``short_mscale`` / ``long_mscale``, and its long factors whenever
  ``max_model_len > original_max_position_embeddings``, ``phi3_long_rope_scaled_rope.py``); vLLM's own
  ``dynamic`` is plain RoPE (without ``max_trained_positions`` its NTK base factor is 1, and its table has only
  ``max_position_embeddings`` rows: ``get_rope``, ``dynamic_ntk_scaling_rope.py``; checked by the audit's engines
  test), so rope-extend never writes it: ``dynamic`` is exported as its static NTK form at the target. Its longest length (``vllm/config/model.py``,
  ``_get_and_verify_max_len``) is ``max_position_embeddings`` times the ``factor`` of every type but yarn,
  llama3 and longrope, whose ``max_position_embeddings`` is already the extended one.
  ``dual_chunk_attention_config`` is read by the Qwen2/Qwen3 families' rotary module, but no attention backend
  of 0.33.0 implements it (``vllm/v1/attention/backends``).
- **Serving past the export's length N in vLLM** (read in vLLM 0.32.0, whose rotary files say the same as
  0.33.0's here, and run in its CPU build, ``tests/export/test_vllm_engine.py``): its rotary table has N rows
  (``rotary_embedding/base.py`` line 97, ``torch.arange(self.max_position_embeddings)``; ``L x factor`` rows
  for linear (``linear_scaling_rope.py`` line 91) and yarn (``yarn_scaling_rope.py`` line 78); N for llama3
  and longrope's long table (``phi3_long_rope_scaled_rope.py`` line 118)), and nothing extends it: with
  ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` a longer ``--max-model-len`` starts, but every log-prob past N is NaN
  (vLLM's own warning says so, ``config/model.py`` lines 2651-2658). So the export says not to serve past N.
- **dtype**: vLLM (``config/model.py``, ``_resolve_auto_dtype``, line 2423) and SGLang (``model_config.py``,
  ``_get_and_verify_dtype``) load a float32 model in 16 bits unless ``--dtype`` says otherwise, which moves
  every log-prob (yarn x4 on SmolLM2 at 6144 tokens: perplexity 27.512 against 27.487 in vLLM 0.32, greedy
  tokens parting at the 6th): the command names the model's dtype.
- **SGLang 0.5.23** (``sglang/srt/layers/rotary_embedding/factory.py``): the same dict through
  ``config.rope_scaling`` (transformers 5 aliases it to ``rope_parameters``); its ``yarn`` reads ``attn_factor``,
  a multiplier on YaRN's own ``0.1 ln s + 1``, and ignores ``attention_factor``: a scale other than the default
  must be written as ``attn_factor = scale / (0.1 ln s + 1)``. No dual-chunk attention backend either.
  Past N (``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1``) it extends the rotary table to the context length
  at load (``sglang/srt/model_executor/model_runner.py`` line 1399, ``sglang/srt/utils/common.py``
  ``reserve_rope_cache_for_long_sequences``) with each class's ``_ensure_cos_sin_cache_length``: the base
  class (plain, ntk) and llama3 continue with their own frequencies and yarn with its own
  (``rotary_embedding/yarn.py`` line 163), as transformers would past the target; linear inherits the base
  class's, which computes unscaled positions (``base.py`` lines 268-296), and LongRoPE's class has none.
- **transformers 4** (4.45 onwards): ``rope_scaling`` with ``rope_type`` (and the older ``type``) and a top-level
  ``rope_theta``; ``yarn`` reads ``attention_factor``, ``beta_fast``, ``beta_slow`` and
  ``original_max_position_embeddings`` (``truncate`` from 4.56 on).
"""

from __future__ import annotations

from typing import Any

from .forms import DEFAULT, DYNAMIC, LINEAR, LLAMA3, LONGROPE, YARN, Form, yarn_attn_factor

VLLM_VERSION = "vllm 0.33.0"
SGLANG_VERSION = "sglang 0.5.23"


def rope_dict(form: Form, target: str) -> dict[str, Any]:
    """The ``rope_parameters`` / ``rope_scaling`` dict of ``form`` for ``target`` (``vllm``, ``sglang``,
    ``transformers4``), without ``rope_theta`` (where it goes differs)."""
    if form.kind == DEFAULT:
        return {"rope_type": "default"}
    out: dict[str, Any] = {"rope_type": form.kind, "factor": float(form.factor)}
    if target == "transformers4":
        out["type"] = form.kind  # transformers before 4.45 read "type"
    if form.kind in (LINEAR, DYNAMIC):
        return out
    out["original_max_position_embeddings"] = int(form.original_max_position_embeddings)
    if form.kind == YARN:
        out["beta_fast"], out["beta_slow"] = form.values["beta_fast"], form.values["beta_slow"]
        if not form.values["truncate"]:
            out["truncate"] = False
        if yarn_attn_factor(form) != 1.0:
            out["attention_factor"] = float(form.attention_scale)  # vLLM and transformers
            if target == "sglang":
                out["attn_factor"] = yarn_attn_factor(form)  # SGLang's multiplier on 0.1 ln s + 1
    elif form.kind == LLAMA3:
        out.update(form.values)
    elif form.kind == LONGROPE:
        out.update({k: list(v) for k, v in form.values.items()})
        if target in ("vllm", "sglang"):
            out["short_mscale"] = out["long_mscale"] = float(form.attention_scale)
        else:
            out["attention_factor"] = float(form.attention_scale)
    return out


def max_positions(form: Form, target_length: int, target: str) -> int:
    """``max_position_embeddings`` to write: engines that multiply it by ``factor`` (vLLM and SGLang for linear)
    get ``L``, so that their longest length is the target, not ``s`` times it."""
    if (target in ("vllm", "sglang") and form.kind == LINEAR) or form.kind == DYNAMIC:
        return int(form.original_max_position_embeddings)
    return int(target_length)


def config_updates(form: Form, target_length: int, target: str) -> dict[str, Any]:
    """The top-level config keys to set for ``target`` (the rest of the config is the model's own)."""
    rope = rope_dict(form, target)
    updates: dict[str, Any] = {"max_position_embeddings": max_positions(form, target_length, target)}
    if target == "transformers4":
        updates["rope_theta"] = float(form.base)
        updates["rope_scaling"] = None if form.kind == DEFAULT else rope
    else:
        updates["rope_parameters"] = {**rope, "rope_theta": float(form.base)}
    return updates


def serve_command(target: str, model: str, form: Form, target_length: int, dtype: str | None = None) -> str:
    """The command that serves the exported folder at ``target_length`` tokens, in ``dtype`` (the model's:
    ``float32``, ``bfloat16``, ``float16``; the engines load a float32 model in 16 bits unless told)."""
    flag = f" --dtype {dtype}" if dtype else ""
    if target == "vllm":
        return f"vllm serve {model} --max-model-len {target_length}{flag}"
    if target == "sglang":
        return f"python -m sglang.launch_server --model-path {model} --context-length {target_length}{flag}"
    return ""


def longer_note(target: str, form: Form, target_length: int) -> str | None:
    """What serving past ``target_length`` tokens gives in ``target`` (None for a target without a command)."""
    if target == "vllm":
        return (
            f"do not serve past {target_length} tokens: vLLM's rotary table ends there (max_position_embeddings "
            "rows), so VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 makes every log-prob past it NaN"
        )
    if target == "sglang":
        if form.kind in (LINEAR, LONGROPE):
            what = "unscaled positions" if form.kind == LINEAR else "no rows (LongRoPE's table is not extended)"
            return f"do not serve past {target_length} tokens: SGLang extends its rotary table past it with {what}"
        return (
            f"past {target_length} tokens (SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1) SGLang extends its rotary "
            "table with the same frequencies, as transformers does: the scaling past the length it was set for"
        )
    return None


OVERRIDE_FLAG = {"vllm": "--hf-overrides", "sglang": "--json-model-override-args"}
