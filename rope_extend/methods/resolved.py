"""A resolved scaling: a method with its factor, original length and validated parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import RopeExtendError
from ._common import MAX_LENGTH, TOO_LONG, Geometry, Method, check_factor, check_length, check_original_length


@dataclass(frozen=True)
class Scaling:
    """``method`` at factor ``s`` relative to the original length ``L``, with its parameters.

    ``shipped`` (``keep_shipped=True``, attention methods only): the scaling the model ships with (Llama 3.1's
    ``llama3``, GPT-OSS's ``yarn``, Phi-3's ``longrope``), kept under the method. Its frequencies are the
    rotary's and the attention scales multiply (each one is carried by cos and sin); ``L`` is then the context
    the model ships with, ``C``, which the method's positions, defaults, reach and log-n count from, and
    ``shipped.original_max_position_embeddings`` its pretraining length.
    """

    method: Method
    factor: float
    original_max_position_embeddings: int
    params: Any
    logn: bool = False  # log-n attention temperature on top of the method (methods.attention.logn_scale)
    shipped: Scaling | None = None
    # the attention kernels of the patched model, as ``rope_extend.patched`` reports them (``hf.attention.kernel``);
    # not part of the scaling's identity
    kernel: str | None = field(default=None, compare=False)

    @property
    def target_length(self) -> int:
        """``s * L`` rounded up (to the nearest integer when it is one up to float error)."""
        exact = self.factor * self.original_max_position_embeddings
        nearest = round(exact)
        return nearest if abs(exact - nearest) <= 1e-9 * exact else math.ceil(exact)

    def compute(self, dim: int, base: float, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """``(inv_freq float32[d/2], attention_scale)`` for a rotary dim and base at length ``seq_len``; with
        ``shipped``, the shipped frequencies and the product of both attention scales."""
        geo = Geometry(dim, float(base), self.original_max_position_embeddings)
        freqs, scale = self.method.compute(self.params, geo, self.factor, seq_len)
        if self.shipped is not None:
            freqs, kept = self.shipped.compute(dim, base, seq_len)
            scale = scale * kept
        return freqs.to(torch.float32).contiguous(), float(scale)

    @property
    def dynamic(self) -> bool:
        """Whether the frequencies depend on the current length (the method's, or the shipped ones kept)."""
        return self.method.dynamic or (self.shipped is not None and self.shipped.dynamic)

    @property
    def pretraining_length(self) -> int:
        """The length the model was pretrained at: ``L``, or under ``keep_shipped`` (where ``L`` is the shipped
        context) the shipped scaling's own ``L``."""
        return (self.shipped or self).original_max_position_embeddings

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.method.param_dict(self.params).items())
        return (
            f"Scaling({self.method.name!r}, factor={self.factor:g}, original_max_position_embeddings="
            f"{self.original_max_position_embeddings}, target_length={self.target_length}"
            f"{', ' + params if params else ''}{', logn=True' if self.logn else ''}"
            f"{f', keep_shipped={self.shipped.describe()!r}' if self.shipped else ''}"
            f"{f', kernel={self.kernel!r}' if self.kernel else ''})"
        )

    def describe(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.method.param_dict(self.params).items() if not isinstance(v, list))
        if self.logn:
            extra = f"{extra}, logn" if extra else "logn"
        if self.shipped is not None:
            kept = f"over the shipped {self.shipped.describe()}"
            extra = f"{extra}, {kept}" if extra else kept
        return (
            f"{self.method.name} (factor {self.factor:g}, L={self.original_max_position_embeddings}, "
            f"target {self.target_length}{', ' + extra if extra else ''})"
        )

    @property
    def in_attention(self) -> bool:
        """Whether attention changes (an attention method, or log-n): ``hf.attention`` is installed."""
        return self.method.attention or self.logn

    def rules(self):
        """The position rules of an attention method (``methods.attention``), or None."""
        return self.params.rules(self.original_max_position_embeddings) if self.method.attention else None


def _same(key: str) -> str:
    return key


def check_amounts(
    method: Method, *, factor: Any = None, target_length: Any = None, params: dict[str, Any], spell=_same
) -> tuple[Any, bool]:
    """The checks that need no model: the method's parameters (through its dataclass), ``logn``, and the
    factor or target length. Returns ``(params, logn)``. ``spell(key)`` is how the caller writes a key
    (``--factor``, ``rope.factor``), so that the message names what the user typed.

    Exactly one of ``factor`` and ``target_length``, except for attention methods, which need neither.
    ``keep_shipped`` is checked here (true or false, attention methods only) and left to the caller that has
    the model's config (``hf.config.scaling_for``).
    """
    params = dict(params)
    logn = params.pop("logn", False)
    if not isinstance(logn, bool):
        raise RopeExtendError(f"{spell('params.logn')} must be true or false, got {logn!r}")
    check_keep_shipped(method, params.pop("keep_shipped", False), spell)
    made = method.make_params(params)  # its errors name the method and the parameter
    if not (method.attention and factor is None and target_length is None) and (factor is None) == (
        target_length is None
    ):
        raise RopeExtendError(
            f"give exactly one of {spell('factor')} (s >= 1, relative to the original length L) and "
            f"{spell('target_length')} (>= L), got factor={factor!r}, target_length={target_length!r}"
        )
    if target_length is not None:
        check_length(spell("target_length"), target_length, minimum=2)  # L >= 2 (check_original_length)
    if factor is not None:
        check_factor(factor, spell("factor"))
    return made, logn


def check_keep_shipped(method: Method, keep: Any, spell=_same) -> bool:
    """``keep_shipped`` must be true or false, and true only for an attention method: a frequency method
    replaces the model's frequencies by definition, so keeping them under it would compound two scalings."""
    if not isinstance(keep, bool):
        raise RopeExtendError(f"{spell('params.keep_shipped')} must be true or false, got {keep!r}")
    if keep and not method.attention:
        raise RopeExtendError(
            f"{spell('params.keep_shipped')} keeps the model's shipped rope scaling under an attention method "
            f"(self_extend, dual_chunk, rerope, leaky_rerope, string); {method.name} is a frequency method, which "
            "replaces the shipped frequencies by definition: leave keep_shipped out"
        )
    return keep


def resolve(
    method: Method,
    *,
    factor: Any = None,
    target_length: Any = None,
    original_max_position_embeddings: Any,
    params: dict[str, Any],
) -> Scaling:
    """Validate every argument and return the scaling; raises ``RopeExtendError`` naming the problem.

    ``check_amounts`` first (what needs no model); then, with the original length ``L``:
    ``factor = target_length / L``; attention methods (``method.attention``) given neither get the method's
    usable length over ``L`` (Self-Extend) or 1 (no length limit). ``params`` may hold ``logn`` (true/false)
    for any method.
    """
    length = check_original_length(original_max_position_embeddings)
    made, logn = check_amounts(method, factor=factor, target_length=target_length, params=params)
    if params.get("keep_shipped"):
        raise RopeExtendError(
            "keep_shipped is read against a model's config (rope_extend.patch, rope_extend.configure): the "
            "scaling the model ships with is what it keeps"
        )
    usable = getattr(made, "usable_length", None)
    if factor is None and target_length is None:  # an attention method (check_amounts allowed it)
        factor = usable(length) / length if usable is not None else 1.0
    if target_length is not None:
        target = check_length("target_length", target_length)
        if target < length:
            raise RopeExtendError(
                f"target_length must be >= the original length L={length} (factor >= 1), got {target}"
            )
        factor = target / length
    s = check_factor(factor)
    if s * length > MAX_LENGTH:  # both within the bound, their product not: the target is no length either
        raise RopeExtendError(f"factor {s:g} x L={length} is {s * length:.4g} tokens, past {TOO_LONG}")
    if usable is not None and s * length > usable(length) * (1 + 1e-9):
        formula, remedy = made.USABLE  # how the params class computes its reach, and what lengthens it
        raise RopeExtendError(
            f"{method.name} with these parameters reaches {usable(length)} tokens ({formula}), "
            f"less than the target {math.ceil(s * length)}; {remedy}"
        )
    return Scaling(method, s, length, made, logn)
