"""Mixed context window training (LongRoPE2, Shang et al. 2025, "LongRoPE2: Near-Lossless LLM Context Window
Scaling", section 3.3): the long sequences train with the rescaled rope, the short ones with the original rope,
so the model learns the long context without leaving its short-context self behind.

The saved model's config holds one scaling, which engines apply at every length, so the scaling must compute
the original rope within ``L`` (``check_served``: ``longrope`` with ``attention_factor: 1``, whose short factors
are all 1, or a dynamic method; a static method such as yarn is refused). Here the switch is per micro-batch,
exact, and needs no second copy of the weights: a micro-batch whose
positions all lie within the model's original length ``L`` runs inside ``hf.installed.original_rope`` (the rotary
modules compute exactly as before ``patch``: original frequencies, attention scale 1 where it was), every other
one with the patched rope (``rope``: searched LongRoPE factors, say). Of the micro-batches
of the run, numbered ``i = step x G + micro``, those with ``floor((i + 1) f) > floor(i f)`` are short, a share
``f = mixed.short_share`` spread evenly, so with ``G >= 2`` and ``f = 1/2`` every step holds both kinds. A short
micro-batch is a window of the same data without PoSE, cut to ``L`` tokens, drawn in its own order
(seed + 1); the loss normalisation of the step counts its target tokens like any other's.

The authors switch by the same rule: their training example (microsoft/nnscaler, examples/longrope2) packs short
documents (at most ``L`` tokens) and long ones into separate 128k sequences, and its rotary module takes the long
factors when the batch's largest position id reaches ``L`` (rope_modifier.py). Their rotary module keeps
transformers' LongRoPE attention scale at every length, short sequences included; here the short micro-batches
keep the original scale (docs/methods.md, LongRoPE2).
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..hf.head import unwrap
from ..hf.installed import original_rope
from ..hf.reading import original_length, text_config
from .args import RecipeError, TrainArgs
from .data import Batches


class MixedBatches:
    """``Batches`` whose short micro-batches (see the module docstring) come from a second order of the same
    windows; ``rope(batch)`` is the rope the batch trains with."""

    def __init__(self, long: Batches, short: Batches, *, model, length: int, share: float, accumulation: int):
        self.long, self.short, self.model = long, short, model
        self.length, self.share, self.G = length, share, accumulation
        self.packed = long.packed

    @property
    def windows(self) -> int:
        return self.long.windows

    def is_short(self, step: int, micro: int) -> bool:
        i = step * self.G + micro
        return math.floor((i + 1) * self.share) > math.floor(i * self.share)

    def get(self, step: int, micro: int, rank: int) -> dict[str, torch.Tensor]:
        if not self.is_short(step, micro):
            return self.long.get(step, micro, rank)
        return {k: v[:, : self.length] for k, v in self.short.get(step, micro, rank).items()}

    def rope(self, batch: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager:
        """The original rope for a batch whose positions all lie within ``L``, the patched one otherwise."""
        if int(batch["position_ids"].max()) < self.length:
            return original_rope(self.model)
        return contextlib.nullcontext()


def check_served(model, length: int, name: str) -> None:
    """Refuse a scaling whose rope within ``L`` is not the original one. The saved model's config holds one
    scaling, and engines compute it at every length: a short window trained with the original rope must be
    served with it too, which holds for ``longrope`` with ``attention_factor: 1`` (its short factors are all 1)
    and for the dynamic methods within ``L``, not for a static method (yarn, linear) nor for LongRoPE's default
    attention scale ``sqrt(1 + ln s / ln L)``, which engines apply at every length (``name``: the scaling, for the
    message). Checked on the model's own
    logits for a probe of ``min(L, 32)`` tokens, patched against ``original_rope``, to the bit."""
    probe = torch.arange(min(length, 32))[None] % int(text_config(model.config).vocab_size)
    training = model.training
    model.eval()  # no dropout: the two forwards must be comparable
    try:
        with torch.no_grad():
            served = model(input_ids=probe, use_cache=False).logits
            with original_rope(model):
                trained = model(input_ids=probe, use_cache=False).logits
    finally:
        model.train(training)
    if not torch.equal(served, trained):
        raise RecipeError(
            f"mixed.enabled: rope.method {name} computes another rope than the original one for "
            f"sequences within the original length {length}, and the saved model would be served with it there, "
            "not with the original rope its short windows trained with; use rope.method longrope with "
            "rope.params.attention_factor: 1.0 (short factors all 1), or a dynamic method"
        )


def mixed_batches(args: TrainArgs, long: Batches, model) -> MixedBatches:
    """``long`` (the recipe's batches) mixed with short ones, for ``model`` as ``rope`` patched it."""
    base = unwrap(model)
    length = original_length(text_config(base.config))
    if long.pose_target_length is None and args.data.max_seq_length <= length:
        raise RecipeError(
            f"mixed.enabled: every window (data.max_seq_length {args.data.max_seq_length}) lies within the original "
            f"length {length}, so none would train the scaled rope; use longer windows or pose.enabled"
        )
    check_served(base, length, args.rope.describe())
    short = Batches(
        long.packed,
        seed=args.seed + 1,
        batch_size=long.B,
        accumulation=long.G,
        num_processes=long.P,
    )
    return MixedBatches(
        long,
        short,
        model=base,
        length=length,
        share=args.mixed.short_share,
        accumulation=args.gradient_accumulation_steps,
    )


def rope_for(batches, batch: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager:
    """The rope ``batch`` trains with: ``MixedBatches.rope``, or the patched rope as it is."""
    return batches.rope(batch) if isinstance(batches, MixedBatches) else contextlib.nullcontext()
