"""Patch a loaded model in place: swap its rotary frequencies, keep them float32, undo exactly.

``patch`` plans everything against the unpatched config (``hf.patch_plan``: raising before anything is touched)
and installs the plan (``hf.installed``: the config written, each rotary buffer recomputed on its device, rope-extend's
rotary runtime, float32 frequencies and dynamic methods, ``hf.rotary``). ``unpatch`` is the handle's ``undo``: it
puts back the config, every buffer and attribute, and the class's forward.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from .errors import NotPatchedError
from .hf.installed import install, installed
from .hf.patch_plan import Request, plan
from .hf.reading import attn_implementation, text_config
from .methods.resolved import Scaling


# ------------------------------------------------------------------------------------------ public
def patch(
    model: nn.Module, method: str, *, factor=None, target_length=None, original_max_position_embeddings=None, **params
) -> nn.Module:
    """Scale ``model``'s rotary embeddings with ``method``, in place, and return it.

    ``factor`` counts from the context the model ships with (``hf.config.shipped_context``): its pretraining
    length ``L`` (``original_max_position_embeddings`` if the config has it, else ``max_position_embeddings``),
    or, for a model that ships a scaling (Llama 3.1 ``llama3``, GPT-OSS ``yarn``, Phi-3 ``longrope``), the
    context that scaling gives. ``target_length`` is the alternative. The method replaces the shipped scaling
    on the plain RoPE frequencies, at ``target / L``, so a factor never shortens the usable context; a method
    whose reach is shorter than the shipped context (an attention method without a factor) is refused unless
    ``target_length`` asks for exactly that. A new patch replaces the previous one and never compounds. Gemma 3
    style models scale their global layers only; local sliding-window layers keep their rotary. Every argument
    is checked before the model is touched, and so is that the patch changes something: an attention method on
    a NoPE hybrid whose RoPE layers are all local (Cohere 2, EXAONE 4, Llama 4) has no layer to change and is
    refused; ``logn=True`` scales the NoPE layers' queries (alone: ``"linear"`` at ``factor=1``), and is
    refused on a model that applies its own temperature there (Llama 4's ``attn_temperature_tuning``). A
    frequency method on a model none of whose layers reads the rotary embedding (every layer linear attention
    or convolution, every attention layer NoPE: ``hf.rotary_reads.unread``, one probe forward) is refused too.

    ``keep_shipped=True`` (the attention methods, with or without ``logn``) keeps the shipped scaling instead:
    the rotary keeps its frequencies (``llama3``, ``yarn``, ``longrope`` switching at its ``L``, ``linear``) and
    its attention scale, times the method's own (STRING's factor, Dual Chunk's temperature), and the method
    re-rotates with them. Everything the method counts from ``L`` counts from the shipped context ``C``: its
    default parameters, reach, factor (``target / C``), log-n's ``ln L`` and Dual Chunk's temperature. That is the
    STRING authors' rule (HKUNLP/STRING, ``string_for_llama.py`` and its test scripts: Llama 3.1 keeps its llama3
    frequencies, ``L = max_position_embeddings = 131072``, ``shifted_offset = 0.33 L = 43253``), applied to every
    attention method. A frequency method with it is refused (it replaces the frequencies by definition); on a
    model that ships plain RoPE it changes nothing. The kept scaling is written into ``rope_parameters``
    (``shipped``), so a saved and reloaded model runs the same.

    Args:
        model: a loaded transformers model with rotary embeddings (a composite one included: its language model
            is patched).
        method: a registered method name (``rope_extend.method_names()``).
        factor: ``s = target / L``; give it or ``target_length``, not both (an attention method may take neither).
        target_length: the context to reach, in tokens.
        original_max_position_embeddings: ``L`` when the config's is not the pretraining length.
        **params: the method's own parameters (``beta_fast``, ``group_size``, ...), ``logn`` and
            ``keep_shipped``.

    Returns:
        ``model`` itself, patched in place.

    Raises:
        RopeExtendError: a bad argument (an unknown method or parameter, a value out of range).
        UnsupportedModelError: a model, layer or cache the method cannot run on exactly; nothing was changed.
    """
    previous = installed(model)
    request = Request(method, factor, target_length, original_max_position_embeddings, params)
    planned = plan(model, request, previous)  # raises before anything is touched
    if previous is not None:
        previous.undo()
    install(model, planned)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo ``patch``: the config, every rotary buffer and attribute as they were (bit-identical logits).

    Args:
        model: a model ``patch`` patched.

    Returns:
        ``model`` itself, as it was before ``patch``.

    Raises:
        NotPatchedError: ``patch`` never touched ``model``.
    """
    handle = installed(model)
    if handle is None:
        raise NotPatchedError(f"{type(model).__name__} was not patched by rope_extend.patch; nothing to undo")
    handle.undo()  # raises before changing anything, and then the patch stays in place and recorded
    return model


def patched(model: nn.Module) -> Scaling | None:
    """The scaling ``patch`` applied to ``model``, or None; its ``kernel`` names the attention that runs now (on
    the model's device): the model's own implementation for a frequency method (``'sdpa'``), and for an
    attention method the kernel of rope-extend's passes and what the layers it leaves alone keep
    (``'cpu_flash; other layers: sdpa'``; ``hf.attention.kernel``); for log-n alone the model's implementation,
    since it only scales the queries (of NoPE layers too) before it.

    Args:
        model: any model.

    Returns:
        The ``Scaling`` in force (method, parameters, factor, ``kernel``), or None for a model ``patch`` never
        touched (or one it undid).
    """
    handle = installed(model)
    if handle is None:
        return None
    if handle.attached.attention is None:
        kernel = attn_implementation(text_config(model.config))
    else:
        kernel = handle.attached.attention.kernel()
    return dataclasses.replace(handle.plan.scaling, kernel=kernel)
