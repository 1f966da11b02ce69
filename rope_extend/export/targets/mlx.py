"""MLX (mlx-lm 0.32.2): a model folder mlx-lm loads as it is (config.json, the safetensors, the tokenizer), with
the scaling in the keys its model classes read, served by ``mlx_lm.server`` / ``mlx_lm.generate``.

Read from mlx-lm 0.32.2's source (the wheel on PyPI, with ``mlx[cpu]==0.32.4``):

- **Where the keys are** (``models/llama.py``, ``qwen2.py``, ``qwen3.py``, ``ModelArgs``): a top-level
  ``rope_theta`` (default 10000 for llama, 1e6 for qwen2; qwen3 falls back to ``rope_parameters``) and
  ``rope_scaling``; llama (and mistral, which ``utils.MODEL_REMAPPING`` loads as llama) and qwen2 never read
  transformers 5's ``rope_parameters``, so a folder saved by transformers 5 is served at base 10000 with no
  scaling. The export writes the top-level keys (transformers 5 reads them too, as legacy keys).
- **What each rope type computes** (``models/rope_utils.py``, ``initialize_rope``): ``default`` and ``linear``
  are ``nn.RoPE`` with ``scale = 1 / factor`` (transformers' linear); ``llama3`` is transformers' formula with the
  band edges open (``wavelen > high`` and ``< low`` is smoothed, where transformers' band is closed: the two
  differ only for a wavelength exactly at ``L / low_freq_factor``); ``yarn`` (``YarnRoPE``) always floors and
  ceils the ramp ends (``truncate`` is not read) and multiplies q and k by
  ``mscale(s, mscale) / mscale(s, mscale_all_dim)`` with ``mscale(s, m) = 0.1 m ln s + 1`` (1 for ``s <= 1``),
  defaults ``mscale = 1``, ``mscale_all_dim = 0``; ``attention_factor`` is not read, so transformers' scale ``a``
  is written as ``mscale = (a - 1) / (0.1 ln s)`` (exact for ``s > 1``; transformers reads ``attention_factor``,
  written beside it); ``longrope`` (``SuScaledRoPE``) uses the long factors for every sequence, and scales q and k
  by ``sqrt(1 + ln(N / L) / ln L)`` with ``N = max_position_embeddings`` (it reads neither ``attention_factor``
  nor ``short_mscale`` / ``long_mscale``: ``initialize_rope`` passes none); ``dynamic``
  (``DynamicNTKScalingRoPE``) recomputes the base from the length of each forward and never turns cached keys,
  so rope-extend never writes it: ``dynamic`` goes as its static NTK form, as for the other engines.
- **Families**: llama, mistral, qwen2 and qwen3 build their rope with ``initialize_rope`` from those keys; gemma,
  gemma2, qwen3_moe, mixtral and starcoder2 use ``nn.RoPE(base=rope_theta)`` and read no scaling at all, phi3
  its own LongRoPE class, gemma3 per layer type: refused here (``FAMILIES`` names the ones checked).
- mlx-lm computes in the weights' dtype (a float32 export stays float32) and has no context limit: past the
  export's length it goes on with the same frequencies.
"""

from __future__ import annotations

import math
from typing import Any

from ...errors import RopeExtendError, UnsupportedModelError
from ...hf.names import SHIPPED_ATTR
from ...methods.engine_form import DEFAULT, LINEAR, LLAMA3, LONGROPE, YARN, Form
from ...methods.longrope import longrope_attention_scale
from ...methods.resolved import Scaling
from ...methods.yarn import mscale
from ..configs import FolderTarget
from .base import REFUSED, Decision, ExportJob, ExportResult, longrope_switch

ENGINE = "mlx-lm 0.32.2"
# model_type: the mlx-lm 0.32.2 module that loads it; each builds its rope with rope_utils.initialize_rope from the
# top-level rope_theta and rope_scaling (checked in mlx-lm itself: tests/export/test_mlx_engine.py)
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
SLIDING = "sliding_attention"


def yarn_mscale(scale: float, factor: float) -> float:
    """The ``mscale`` whose ``0.1 mscale ln s + 1`` is ``scale`` (``mscale_all_dim`` 0): how mlx-lm's YarnRoPE
    says transformers' ``attention_factor``; defined for ``s > 1`` only."""
    return (scale - 1.0) / (0.1 * math.log(factor))


class MlxTarget(FolderTarget):
    name = "mlx"
    engine = ENGINE
    dropped = (SHIPPED_ATTR,)

    def decide(self, scaling: Scaling | None, form: Form | None, base: float) -> Decision | None:
        if form is None or scaling is None:
            return None  # plain RoPE, or an attention method: the rules every engine shares
        if form.kind == YARN:
            if not form.values["truncate"]:
                lacks = "its YarnRoPE always floors and ceils the ramp ends (truncate is not read)"
                return Decision(REFUSED, None, lacks, f"{scaling.method.name} with truncate=true")
            if form.factor <= 1.0 and not math.isclose(form.attention_scale, 1.0, rel_tol=1e-12):
                lacks = f"its YaRN scale is 1 at factor {form.factor:g} (mscale(s) = 1 for s <= 1)"
                return Decision(REFUSED, None, lacks, f"{scaling.method.name} without attention_factor")
        if form.kind == LONGROPE:
            own = longrope_attention_scale(form.factor, form.original_length)
            if not math.isclose(form.attention_scale, own, rel_tol=1e-9):
                lacks = (
                    f"its SuScaledRoPE scales by sqrt(1 + ln(N / L) / ln L) = {own:.6g} at this factor and reads "
                    f"no attention_factor ({form.attention_scale:.6g} here)"
                )
                return Decision(REFUSED, None, lacks, "longrope without attention_factor")
        return longrope_switch(self.engine, form)

    def rope_dict(self, form: Form) -> dict[str, Any]:
        """``rope_scaling`` in the keys ``initialize_rope`` reads (plus transformers' own where it reads others)."""
        out: dict[str, Any] = {"rope_type": form.kind, "factor": float(form.factor)}
        if form.kind == LINEAR:
            return out
        out["original_max_position_embeddings"] = int(form.original_length)
        if form.kind == YARN:
            out["beta_fast"], out["beta_slow"] = form.values["beta_fast"], form.values["beta_slow"]
            if not math.isclose(form.attention_scale, mscale(form.factor), rel_tol=1e-12):
                out["mscale"] = yarn_mscale(form.attention_scale, form.factor)  # what mlx-lm reads
                out["attention_factor"] = float(form.attention_scale)  # what transformers reads
        elif form.kind == LLAMA3:
            out.update(form.values)
        elif form.kind == LONGROPE:
            out.update({k: list(v) for k, v in form.values.items()})
        return out

    def config_updates(self, form: Form, target_length: int) -> dict[str, Any]:
        """A top-level ``rope_theta`` and ``rope_scaling`` (None for plain RoPE); ``max_position_embeddings`` the
        target (LongRoPE's scale is computed from it)."""
        return {
            "max_position_embeddings": int(target_length),
            "rope_theta": float(form.base),
            "rope_scaling": None if form.kind == DEFAULT else self.rope_dict(form),
        }

    def serve_command(self, model: str, form: Form | None, target_length: int, dtype: str | None) -> str:
        return f"mlx_lm.server --model {model}"

    def longer_note(self, form: Form, target_length: int) -> str | None:
        return (
            f"mlx-lm has no context limit: past {target_length} tokens it goes on with the same frequencies (the "
            "scaling past the length it was set for)"
        )

    def write(self, job: ExportJob) -> ExportResult:
        check_family(job.text, job.length)
        if job.source is None and job.tokenizer is None:  # mlx_lm.load reads the tokenizer from the folder
            raise RopeExtendError("mlx-lm loads the tokenizer from the folder: pass tokenizer= with the model")
        return super().write(job)


def check_family(config, length: int) -> None:
    """Refuse a model mlx-lm 0.32.2 would not build its rope for from the exported keys (``FAMILIES``), or one
    whose sliding-window layers it would not mask as transformers does."""
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        raise UnsupportedModelError(
            f"{ENGINE} exports are checked for {', '.join(FAMILIES)} (whose mlx-lm classes read rope_theta and "
            f"rope_scaling through initialize_rope), not {kind!r}"
        )
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ([SLIDING] * config.num_hidden_layers if window else [])
    if window and SLIDING in types and int(window) < length:
        raise UnsupportedModelError(
            f"{kind} with a {window}-token sliding window shorter than the served length {length}: mlx-lm's {kind} "
            "is not checked to mask it as transformers does; export a model without one"
        )


TARGET = MlxTarget()
