"""What a scaling is, written the way serving engines think of one: the engine-neutral ``Form``.

Serving engines compute RoPE frequencies once, from a config, for the context they serve; they know a few
rope types (linear, YaRN, Llama 3, LongRoPE) and the base. ``static_form`` turns a rope-extend ``Scaling``
into the one of those that computes the same cos/sin, or says there is none. Each method declares its own form
(``Method.engine_form``, ``methods.engine_form``: ``ntk`` is plain RoPE at a larger base, ``ntk_by_parts`` YaRN
with the attention factor 1, the dynamic methods their frequencies at the target, with what differs below it), so
a method of one's own reaches every engine that takes its form without a line here. What is left here is what
the export knows and the pure math does not: the length the patched model computes a dynamic method's
frequencies at (``patched_length``, on ``hf``'s re-rotation grid), so that the served model is the patched one at
the target. The attention methods keep plain frequencies and change positions inside attention: an engine needs
an attention kernel of its own for them (``routes``).

Plain numbers in, plain numbers out; nothing here reads a model.
"""

from __future__ import annotations

import math

from ..hf.rotary import bucket
from ..methods.engine_form import DEFAULT, LINEAR, LLAMA3, LONGROPE, YARN, Form
from ..methods.resolved import Scaling
from ..methods.yarn import mscale

# the kinds an engine config names (methods.engine_form), and transformers 4's own dynamic NTK (configs); the
# engines get static forms
DYNAMIC = "dynamic"

__all__ = [
    "DEFAULT",
    "DYNAMIC",
    "LINEAR",
    "LLAMA3",
    "LONGROPE",
    "YARN",
    "Form",
    "mscale",
    "patched_length",
    "static_form",
    "yarn_attn_factor",
]


def patched_length(scaling: Scaling) -> int:
    """The length rope-extend's patched model computes a dynamic method's frequencies at for a sequence of the
    target's length: the target rounded up to the re-rotation grid past ``L`` (``hf.rotary.bucket``)."""
    return bucket(scaling.target_length, scaling.original_max_position_embeddings)


def static_form(scaling: Scaling | None, dim: int, base: float) -> Form | None:
    """The static ``Form`` of ``scaling`` for a rotary dimension ``dim`` and base ``base`` (the method's own,
    ``Method.engine_form``); None for an attention method (plain frequencies, positions changed in attention),
    for ``logn`` and for a method that declares no form."""
    if scaling is None or scaling.method.name == "none":
        return Form(DEFAULT, float(base))
    if scaling.logn or scaling.method.attention or scaling.method.engine_form is None:
        return None
    return scaling.method.engine_form(scaling, dim, base, patched_length(scaling))


def yarn_attn_factor(form: Form) -> float:
    """The ``attn_factor`` of engines that multiply it by YaRN's own ``0.1 ln s + 1`` (vLLM, SGLang,
    llama.cpp): ``attention_scale / (0.1 ln s + 1)``, 1 for YaRN's default temperature."""
    ratio = form.attention_scale / mscale(form.factor)
    return 1.0 if math.isclose(ratio, 1.0, rel_tol=1e-12) else ratio
