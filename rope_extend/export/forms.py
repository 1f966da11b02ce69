"""What a scaling is, written the way serving engines think of one: the engine-neutral ``Form``.

Serving engines compute RoPE frequencies once, from a config, for the context they serve; they know a few
rope types (linear, YaRN, Llama 3, LongRoPE) and the base. ``static_form`` turns a rope-extend ``Scaling``
into the one of those that computes the same cos/sin, or says there is none:

- ``ntk`` is plain RoPE with the base ``b * alpha ** (d / (d - 2))`` (bloc97 2023): every engine takes it;
- ``ntk_by_parts`` is YaRN with the attention factor 1 (Peng et al. 2023, section 3.2);
- ``dynamic`` and ``dynamic_yarn`` change with the length; their frequencies at the target length are the
  closest static scaling, different below ``L`` (where the dynamic methods are plain RoPE), so they are offered
  only on request (``approximate``); vLLM serves ``dynamic_yarn`` per request instead, through rope-extend's
  plugin (``adaptive``). ``dynamic``: the base the patched model uses for a sequence of the target's length, the
  same function at the same rounded length (``patched_length``: past ``L`` the patched model computes dynamic
  frequencies at the next length of its re-rotation grid, so at ``L = 256``, ``T = 1024`` its alpha is 13.44, not
  the 13.0 of ``s T / L - (s - 1)`` at ``T`` itself); the served model is the patched one at the target.
  ``dynamic_yarn``: YaRN at ``s``, the standard static form every engine and a model fine-tuned with YaRN at ``s``
  share, which is ``dynamic_yarn``'s ``l / L`` at ``l = T``; the patched model rounds ``l`` up to its grid there
  too (YaRN at ``1052 / 256 = 4.11`` for the same example), and the export's note says so;
- the attention methods keep plain frequencies and change positions inside attention: an engine needs an
  attention kernel of its own for them (``routes``).

Plain numbers in, plain numbers out; nothing here reads a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..hf.rotary import bucket
from ..methods import registry
from ..methods.llama3 import Llama3Params
from ..methods.longrope import LongRopeParams
from ..methods.ntk import dynamic_alpha, ntk_base
from ..methods.yarn import DynamicYarnParams, NTKByPartsParams, YarnParams, mscale, yarn_attention_scale

DEFAULT, LINEAR, YARN, LLAMA3, LONGROPE = "default", "linear", "yarn", "llama3", "longrope"
DYNAMIC = "dynamic"  # transformers 4's own dynamic NTK (configs); the engines get static forms
DYNAMIC_METHODS = ("dynamic", "dynamic_yarn")


@dataclass(frozen=True)
class Form:
    """A static scaling in the terms engines use.

    ``kind``: ``default`` (plain RoPE at ``base``), ``linear``, ``yarn``, ``llama3`` or ``longrope``.
    ``attention_scale`` is the factor on cos and sin (so every logit grows by its square), as transformers'
    ``attention_factor``. ``values`` holds the kind's own numbers: yarn ``beta_fast``, ``beta_slow``,
    ``truncate``; llama3 ``low_freq_factor``, ``high_freq_factor``; longrope ``short_factor``,
    ``long_factor``. ``changes`` says what differs from the rope-extend method (empty when exact).
    """

    kind: str
    base: float
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    attention_scale: float = 1.0
    values: dict[str, Any] = field(default_factory=dict)
    changes: str = ""

    @property
    def original_length(self) -> int:
        """``original_max_position_embeddings``, which every kind but ``default`` carries (``static_form``)."""
        if self.original_max_position_embeddings is None:
            raise ValueError(f"a {self.kind} form without original_max_position_embeddings")
        return self.original_max_position_embeddings

    @property
    def yarn_default_scale(self) -> float:
        """YaRN's own temperature at this factor, ``0.1 ln s + 1`` (engines apply it unless told otherwise)."""
        return mscale(self.factor)


def patched_length(scaling: registry.Scaling) -> int:
    """The length rope-extend's patched model computes a dynamic method's frequencies at for a sequence of the
    target's length: the target rounded up to the re-rotation grid past ``L`` (``hf.rotary.bucket``)."""
    return bucket(scaling.target_length, scaling.original_max_position_embeddings)


def static_form(scaling: registry.Scaling | None, dim: int, base: float) -> Form | None:
    """The static ``Form`` of ``scaling`` for a rotary dimension ``dim`` and base ``base``; None for an
    attention method (plain frequencies, positions changed in attention) and for ``logn``."""
    if scaling is None or scaling.method.name == "none":
        return Form(DEFAULT, float(base))
    if scaling.logn or scaling.method.attention:
        return None
    name, s, length, p = scaling.method.name, scaling.factor, scaling.original_max_position_embeddings, scaling.params
    target = scaling.target_length
    if name == "linear":
        return Form(LINEAR, float(base), s, length)
    if name == "ntk":
        alpha = s if p.alpha is None else p.alpha
        return Form(DEFAULT, ntk_base(float(base), alpha, dim), s, length)
    if name == "dynamic":
        at = patched_length(scaling)  # the patched model's own rounding, so the two are one model at the target
        alpha = dynamic_alpha(s, length, at)
        return Form(
            DEFAULT,
            ntk_base(float(base), alpha, dim),
            s,
            length,
            changes=f"dynamic NTK made static at the target {target} (base x {alpha:g}^(d/(d-2)), the patched "
            f"model's base at the target: it computes dynamic frequencies at {at}, the target rounded up to its "
            f"re-rotation grid): below the target every position uses this base, where rope-extend's dynamic is "
            f"plain RoPE up to L={length}",
        )
    if isinstance(p, NTKByPartsParams):  # ntk_by_parts, yarn, dynamic_yarn
        scale = yarn_attention_scale(p, s) if isinstance(p, YarnParams) else 1.0
        values: dict[str, Any] = {
            "beta_fast": float(p.beta_fast),
            "beta_slow": float(p.beta_slow),
            "truncate": bool(p.truncate),
        }
        changes = ""
        if name == "dynamic_yarn":
            changes = (
                f"dynamic YaRN made static at factor {s:g}: below the target every position uses YaRN at "
                f"{s:g}, where rope-extend's dynamic_yarn is plain RoPE up to L={length} "
                "(the same as finetuned=true from L on); at the target itself the patched model, which rounds "
                f"the length up to its re-rotation grid, runs YaRN at {patched_length(scaling) / length:.4g}"
                if not (isinstance(p, DynamicYarnParams) and p.finetuned)
                else ""
            )
        return Form(YARN, float(base), s, length, float(scale), values, changes)
    if isinstance(p, Llama3Params):
        values = {"low_freq_factor": float(p.low_freq_factor), "high_freq_factor": float(p.high_freq_factor)}
        return Form(LLAMA3, float(base), s, length, 1.0, values)
    if isinstance(p, LongRopeParams):
        scale = scaling.compute(dim, base, target)[1]
        if p.short_factor is None or p.long_factor is None:  # LongRopeParams refuses either missing when built
            raise ValueError("longrope parameters without short_factor or long_factor")
        values = {"short_factor": list(p.short_factor), "long_factor": list(p.long_factor)}
        return Form(LONGROPE, float(base), s, length, scale, values)
    return None  # a method registered later that no engine knows


def yarn_attn_factor(form: Form) -> float:
    """The ``attn_factor`` of engines that multiply it by YaRN's own ``0.1 ln s + 1`` (vLLM, SGLang,
    llama.cpp): ``attention_scale / (0.1 ln s + 1)``, 1 for YaRN's default temperature."""
    ratio = form.attention_scale / form.yarn_default_scale
    return 1.0 if math.isclose(ratio, 1.0, rel_tol=1e-12) else ratio
