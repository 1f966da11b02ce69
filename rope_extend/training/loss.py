"""Causal LM loss without full-sequence logits.

A sequence of ``T`` tokens with a vocabulary of ``V`` has ``T x V`` logits: at 64k tokens and V=128k that
is 32 GiB in float32, before the softmax and its gradient double it. Here the LM head and the
cross-entropy run ``chunk_size`` tokens at a time:

- ``ChunkedLinearCrossEntropy`` (the LM head is a plain ``nn.Linear``): the forward pass computes, chunk
  by chunk, the loss and already its gradients with respect to the hidden states (and the head's weight
  and bias if they are trained); backward only scales them. No recomputation, so it costs the same
  matmuls as ``model(labels=...)``; peak extra memory is a few ``chunk_size x V`` float32 blocks plus one
  ``T x H`` gradient. The family's logit transform (``hf.head``: Cohere's scale, Granite's divisor,
  Gemma's soft cap) is applied and differentiated.
- any other head (a LoRA- or modules_to_save-wrapped ``lm_head``): a loop of checkpointed chunks, each
  recomputed in backward.

``model_loss`` runs the model's own forward (so FSDP/DDP hooks and every model-specific detail before
the head apply) and swaps the head's ``forward`` for the duration of the call: the head receives the
final hidden states, computes the summed token loss into a side slot, and returns an empty
``[B, T, 0]`` tensor as the model's "logits".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..hf.head import LMHead, lm_head, unwrap

IGNORE = -100


@dataclass(frozen=True)
class Chunking:
    """How ``ChunkedLinearCrossEntropy`` walks the tokens: ``size`` tokens at a time, with the family's logit
    transform (``softcap``: Gemma's cap or None; ``multiplier``: Cohere's scale, Granite's 1 / divisor)."""

    size: int
    softcap: float | None = None
    multiplier: float = 1.0


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum over tokens of ``cross_entropy(softcap(m * (hidden @ weight.T + bias)), targets)``; targets -100
    skipped; ``m`` is the family's logit multiplier (1 for most)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, how: Chunking):
        chunk_size, softcap, multiplier = how.size, how.softcap, how.multiplier
        shape = hidden.shape
        h = hidden.reshape(-1, shape[-1])
        t = targets.reshape(-1)
        w = weight if weight.dtype == h.dtype else weight.to(h.dtype)
        want_w, want_b = weight.requires_grad, bias is not None and bias.requires_grad
        grad_h = torch.zeros_like(h) if hidden.requires_grad else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if want_b else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk_size):
            tc = t[start : start + chunk_size]
            keep = tc != IGNORE
            if not keep.any():
                continue
            hc = h[start : start + chunk_size]
            raw = (hc @ w.T).float()
            if bias is not None:
                raw = raw + bias.float()
            if multiplier != 1.0:
                raw = raw * multiplier
            if softcap:
                capped = torch.tanh(raw / softcap)
                logits = capped * softcap
            else:
                logits = raw
            del raw
            lse = torch.logsumexp(logits, dim=-1)
            safe = torch.where(keep, tc, 0)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            total += ((lse - picked) * keep).sum()
            # d loss / d logits = softmax - onehot, zero on ignored rows
            g = logits.sub_(lse[:, None]).exp_()
            g.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
            g.mul_(keep[:, None])
            if softcap:
                g.mul_(1 - capped * capped)
                del capped
            if multiplier != 1.0:
                g.mul_(multiplier)
            if grad_h is not None:
                grad_h[start : start + chunk_size] = (g.to(w.dtype) @ w).to(h.dtype)
            if grad_w is not None:
                grad_w.addmm_(g.T, hc.float())
            if grad_b is not None:
                grad_b += g.sum(0)
            del g, logits
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.shape = shape
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        gh = (grad_h * grad_out.to(grad_h.dtype)).view(ctx.shape) if grad_h is not None else None
        gw = (grad_w * grad_out).to(ctx.dtypes[0]) if grad_w is not None else None
        gb = (grad_b * grad_out).to(ctx.dtypes[1]) if grad_b is not None else None
        return gh, gw, gb, None, None


def chunked_loss(
    hidden: torch.Tensor,
    head: nn.Module | LMHead,
    targets: torch.Tensor,
    chunk_size: int = 1024,
    softcap: float | None = None,
    head_forward=None,
) -> torch.Tensor:
    """Summed token cross-entropy of ``head(hidden)`` against ``targets``, never all logits at once.

    ``head`` is an ``LMHead`` (its logit transform applied) or a bare output module (with ``softcap``)."""
    lm = head if isinstance(head, LMHead) else LMHead(head, softcap=softcap)
    module = lm.output
    if type(module) is nn.Linear:
        how = Chunking(chunk_size, lm.softcap, lm.multiplier)
        return ChunkedLinearCrossEntropy.apply(hidden, module.weight, module.bias, targets, how)
    forward = head_forward or module.forward
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)

    def piece(hc, tc):
        logits = lm.transform(forward(hc)).float()
        return F.cross_entropy(logits, tc, ignore_index=IGNORE, reduction="sum")

    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_size):
        tc = t[start : start + chunk_size]
        if (tc != IGNORE).any():
            total = total + checkpoint(piece, h[start : start + chunk_size], tc, use_reentrant=False)
    return total


@contextlib.contextmanager
def _loss_head(lm: LMHead, targets, chunk_size: int, slot: dict, on_graph: bool):
    head = lm.output
    original = head.__dict__.get("forward")
    bound = head.forward

    def forward(hidden):
        slot["loss"] = chunked_loss(hidden, lm, targets, chunk_size, head_forward=bound)
        # no logits; ``on_graph``: an empty view of the input, on the autograd graph (``model_loss`` adds its sum, 0,
        # to the loss), so that a backward hook on the head's output runs, as DeepSpeed ZeRO-3's re-gathering of the
        # head needs (without it: AssertionError in its release_sub_module)
        return hidden[..., :0] if on_graph else hidden.new_empty(*hidden.shape[:-1], 0)

    head.forward = forward
    try:
        yield
    finally:
        if original is None:
            del head.__dict__["forward"]
        else:
            head.forward = original


def model_loss(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    chunk_size: int = 1024,
    head: LMHead | None = None,
    *,
    head_output_on_graph: bool = False,
) -> tuple[torch.Tensor, int]:
    """``(summed token loss, number of target tokens)`` for one batch, through the model's own forward.

    ``head`` is the model's ``LMHead`` (found once, and checked with ``hf.head.check``, by the caller that
    trains; looked up here when not given). ``head_output_on_graph``: the head's empty output joins the loss
    (adding 0), for wrappers that act in backward through a hook on each module's output (DeepSpeed ZeRO-3)."""
    lm = head if head is not None else lm_head(model)
    slot: dict = {}
    inputs = {k: v for k, v in batch.items() if k != "targets"}
    with _loss_head(lm, batch["targets"], chunk_size, slot, head_output_on_graph):
        out = model(**inputs, use_cache=False)
    if "loss" not in slot:
        raise RuntimeError(
            f"{type(unwrap(model)).__name__}'s forward did not call its LM head; cannot compute the loss"
        )
    loss = slot["loss"]
    empty = getattr(out, "logits", None)  # the head's empty output, after the model's own logit steps
    if isinstance(empty, torch.Tensor) and empty.requires_grad and empty.numel() == 0:
        loss = loss + empty.sum().to(loss.dtype)  # + 0 exactly: it puts the head's output on the backward path
    return loss, int((batch["targets"] != IGNORE).sum())
