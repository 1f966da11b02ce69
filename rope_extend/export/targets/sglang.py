"""SGLang 0.5.23: a model folder with the scaling in ``config.json``, served by ``sglang.launch_server``.

Read from SGLang's source at that version (the wheel on PyPI):

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
"""

from __future__ import annotations

from typing import Any

from ...methods.engine_form import LINEAR, LONGROPE, YARN, Form
from ...methods.resolved import Scaling
from ..configs import FolderTarget
from ..forms import yarn_attn_factor
from .base import REFUSED, Decision, longrope_switch, yarn_like


class SglangTarget(FolderTarget):
    name = "sglang"
    engine = "sglang 0.5.23"
    override_flag = "--json-model-override-args"
    linear_multiplies = True
    longrope_mscale = True

    def decide(self, scaling: Scaling | None, form: Form | None, base: float) -> Decision | None:
        if scaling is not None and scaling.method.name == "dual_chunk":
            lacks = "SGLang 0.5.23 reads dual_chunk_attention_config but ships no dual-chunk attention backend"
            return Decision(REFUSED, None, lacks, yarn_like(scaling))
        return longrope_switch(self.engine, form)

    def rope_dict(self, form: Form) -> dict[str, Any]:
        out = super().rope_dict(form)
        if form.kind == YARN and "attention_factor" in out:
            out["attn_factor"] = yarn_attn_factor(form)  # SGLang's multiplier on 0.1 ln s + 1
        return out

    def serve_command(self, model: str, form: Form | None, target_length: int, dtype: str | None) -> str:
        flag = f" --dtype {dtype}" if dtype else ""
        return f"python -m sglang.launch_server --model-path {model} --context-length {target_length}{flag}"

    def longer_note(self, form: Form, target_length: int) -> str | None:
        if form.kind in (LINEAR, LONGROPE):
            what = "unscaled positions" if form.kind == LINEAR else "no rows (LongRoPE's table is not extended)"
            return f"do not serve past {target_length} tokens: SGLang extends its rotary table past it with {what}"
        return (
            f"past {target_length} tokens (SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1) SGLang extends its rotary "
            "table with the same frequencies, as transformers does: the scaling past the length it was set for"
        )


TARGET = SglangTarget()
