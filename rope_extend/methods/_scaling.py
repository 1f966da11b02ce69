"""A resolved scaling: a method with its factor, original length and validated parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import RopeExtendError
from ._common import Geometry, Method, check_factor, check_int, check_number


@dataclass(frozen=True)
class Scaling:
    """``method`` at factor ``s`` relative to the original length ``L``, with its parameters."""

    method: Method
    factor: float
    original_max_position_embeddings: int
    params: Any
    logn: bool = False  # log-n attention temperature on top of the method (methods.attention.logn_scale)
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
        """``(inv_freq float32[d/2], attention_scale)`` for a rotary dim and base at length ``seq_len``."""
        geo = Geometry(dim, float(base), self.original_max_position_embeddings)
        freqs, scale = self.method.compute(self.params, geo, self.factor, seq_len)
        return freqs.to(torch.float32).contiguous(), float(scale)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.method.param_dict(self.params).items())
        return (
            f"Scaling({self.method.name!r}, factor={self.factor:g}, original_max_position_embeddings="
            f"{self.original_max_position_embeddings}, target_length={self.target_length}"
            f"{', ' + params if params else ''}{', logn=True' if self.logn else ''}"
            f"{f', kernel={self.kernel!r}' if self.kernel else ''})"
        )

    def describe(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.method.param_dict(self.params).items() if not isinstance(v, list))
        if self.logn:
            extra = f"{extra}, logn" if extra else "logn"
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
    """
    params = dict(params)
    logn = params.pop("logn", False)
    if not isinstance(logn, bool):
        raise RopeExtendError(f"{spell('params.logn')} must be true or false, got {logn!r}")
    made = method.make_params(params)  # its errors name the method and the parameter
    if not (method.attention and factor is None and target_length is None) and (factor is None) == (
        target_length is None
    ):
        raise RopeExtendError(
            f"give exactly one of {spell('factor')} (s >= 1, relative to the original length L) and "
            f"{spell('target_length')} (>= L), got factor={factor!r}, target_length={target_length!r}"
        )
    if target_length is not None:
        check_int(spell("target_length"), target_length)
    if factor is not None:
        check_number(spell("factor"), factor, minimum=1.0)  # check_factor, named as the caller writes it
    return made, logn


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
    length = check_int("original_max_position_embeddings", original_max_position_embeddings)
    made, logn = check_amounts(method, factor=factor, target_length=target_length, params=params)
    usable = getattr(made, "usable_length", None)
    if factor is None and target_length is None:  # an attention method (check_amounts allowed it)
        factor = usable(length) / length if usable is not None else 1.0
    if target_length is not None:
        target = check_int("target_length", target_length)
        if target < length:
            raise RopeExtendError(
                f"target_length must be >= the original length L={length} (factor >= 1), got {target}"
            )
        factor = target / length
    s = check_factor(factor)
    if usable is not None and s * length > usable(length) * (1 + 1e-9):
        formula, remedy = made.USABLE  # how the params class computes its reach, and what lengthens it
        raise RopeExtendError(
            f"{method.name} with these parameters reaches {usable(length)} tokens ({formula}), "
            f"less than the target {math.ceil(s * length)}; {remedy}"
        )
    return Scaling(method, s, length, made, logn)
