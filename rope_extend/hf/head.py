"""The LM head of a causal LM, with each family's logit quirks, checked against the model's own logits.

Perplexity (no full-sequence logits) and the training loss (a chunked LM-head loss) both run the decoder
to hidden states and apply the head themselves, so both must do exactly what the model's forward does
after its decoder:

- Cohere multiplies the logits by ``logit_scale`` (an attribute of the model);
- Granite divides them by ``config.logits_scaling``;
- Gemma 2 and 3 soft-cap them: ``tanh(logits / c) * c`` with ``c = config.final_logit_softcapping``.

A family that transforms its logits some other way is caught by ``check``: it compares the decoder plus
this head with the model's own logits on a few tokens and raises on a mismatch, rather than letting a
wrong perplexity or a wrong loss through.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from ..errors import RopeExtendError
from .reading import text_config


def unwrap(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` inside DDP/FSDP wrappers (``.module``) and PEFT (``get_base_model``)."""
    inner = model
    while True:
        get_base = getattr(inner, "get_base_model", None)
        wrapped = getattr(inner, "module", None)
        if callable(get_base) and get_base() is not inner:
            inner = get_base()
        elif isinstance(wrapped, nn.Module):
            inner = wrapped
        else:
            return inner


@dataclass(frozen=True)
class LMHead:
    """The output embedding and the logit transform of a causal LM; ``decoder`` maps ids to hidden states."""

    output: nn.Module  # the output embedding: an nn.Linear, or a LoRA / modules_to_save wrapper of one
    decoder: nn.Module | None = None
    scale: float | None = None  # Cohere: logits * logit_scale
    divide: float | None = None  # Granite: logits / logits_scaling
    softcap: float | None = None  # Gemma 2/3: tanh(logits / softcap) * softcap

    @property
    def vocab_size(self) -> int:
        weight = getattr(self.output, "weight", None)
        if weight is not None:
            return int(weight.shape[0])
        # a wrapper without a weight of its own (torch types a module's attribute Tensor | Module)
        return int(cast(Any, self.output).out_features)

    @property
    def multiplier(self) -> float:
        """``scale / divide``: what multiplies the raw logits before the soft cap."""
        return (1.0 if self.scale is None else float(self.scale)) / (1.0 if self.divide is None else float(self.divide))

    def transform(self, logits: torch.Tensor) -> torch.Tensor:
        """The family's logit transform, in the order and dtype of its forward."""
        if self.scale is not None:
            logits = logits * self.scale
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of ``hidden``, computed as the model computes them (upcast last, as its loss does)."""
        return self.transform(self.output(hidden)).float()


def lm_head(model: nn.Module, *, decoder: bool = False) -> LMHead:
    """The head of ``model`` (a ``*ForCausalLM``, possibly wrapped); with ``decoder=True`` also its decoder."""
    inner = unwrap(model)
    get_output, get_decoder = getattr(inner, "get_output_embeddings", None), getattr(inner, "get_decoder", None)
    output = get_output() if get_output is not None else None
    body = get_decoder() if decoder and get_decoder is not None else None
    if output is None or (decoder and (body is None or body is inner)):
        raise RopeExtendError(
            f"{type(inner).__name__} is not a causal language model with a separate decoder and LM head: "
            "perplexity and the training loss need an AutoModelForCausalLM"
        )
    config = text_config(inner.config)
    scale = getattr(inner, "logit_scale", None)
    if isinstance(scale, nn.Module):  # not Cohere's number (some models keep a learned module of that name)
        scale = None
    return LMHead(
        output,
        body,
        scale=scale,
        divide=getattr(config, "logits_scaling", None),
        softcap=getattr(config, "final_logit_softcapping", None),
    )


@torch.no_grad()
def check(model: nn.Module, head: LMHead, ids: Sequence[int]) -> None:
    """Raise unless the decoder plus ``head`` gives the model's own logits on the first 16 of ``ids``."""
    inner = unwrap(model)
    decoder = head.decoder if head.decoder is not None else lm_head(inner, decoder=True).decoder
    assert decoder is not None  # lm_head(decoder=True) raises rather than return a head without one
    probe = torch.tensor([list(ids[:16])], device=next(inner.parameters()).device)
    was_training = inner.training
    inner.eval()  # dropout would make the two computations differ
    try:
        ref = inner(input_ids=probe, use_cache=False).logits.float()
        ours = head.logits(decoder(input_ids=probe, use_cache=False).last_hidden_state)
    finally:
        inner.train(was_training)
    if ours.shape != ref.shape or not torch.allclose(ours, ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()) + 1e-6):
        raise RopeExtendError(
            f"{type(inner).__name__} computes its logits differently from its decoder + LM head (an unknown logit "
            "scaling?): rope-extend's chunked perplexity and training loss would be wrong for it"
        )
