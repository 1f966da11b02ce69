"""Pieces every method shares: plain RoPE frequencies, argument checks, and the `Method` record."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import RopeExtendError, closest, shown


def rope_frequencies(dim: int, base: float) -> torch.Tensor:
    """Plain RoPE inverse frequencies, float32: ``theta_i = base ** (-2i/dim)``, ``i = 0 .. dim/2-1``.

    Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding". Computed with the
    same float32 operations as transformers, so an unscaled method reproduces its buffer bit for bit.
    """
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool); an int too large for a float (``10**400``) is none."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_number(name: str, value: Any, *, minimum: float | None = None, above: float | None = None) -> float:
    """Return ``value`` as a float, or raise naming the parameter and the allowed range. The value is shown bounded
    (``errors.shown``): it may come from a user's config or a file, and be a string of a gigabyte."""
    if not is_number(value):
        raise RopeExtendError(f"{name} must be a finite number, got {shown(value)}")
    if minimum is not None and value < minimum:
        raise RopeExtendError(f"{name} must be >= {minimum}, got {shown(value)}")
    if above is not None and value <= above:
        raise RopeExtendError(f"{name} must be > {above}, got {shown(value)}")
    return float(value)


# The largest multiplier of cos and sin (so of every logit, squared) the attention methods accept. The published
# values are 1.07 (STRING's 1 + 0.1 ln 2) to about 1.5 (YaRN's 0.1 ln s + 1 at s = 128); at 10 every logit is scaled
# by 100, which already makes softmax a hard maximum, and past about 1e19 the scores overflow float32 (NaN logits).
MAX_ATTENTION_FACTOR = 10.0
TOO_HOT = "a larger one makes attention a hard maximum and overflows the scores, giving NaN logits"


def check_int(name: str, value: Any, *, minimum: int = 1) -> int:
    """Return ``value``, an int (not a bool) >= ``minimum``, or raise naming the parameter (the value shown bounded,
    as ``check_number`` shows it)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RopeExtendError(f"{name} must be an integer >= {minimum}, got {shown(value)}")
    return value


# The longest sequence length rope-extend computes with: an original length ``L``, a target length ``s * L``, a
# context, a current length. 2**40 (1.1e12) tokens is five orders of magnitude past the longest context published
# (Llama 4 Scout's 10M, LongRoPE's 2M), and no such sequence can be run: its KV cache alone, at one 64-value head
# in 8 bits per layer, holds 2**40 * 128 bytes = 128 TiB a layer. Below it every length computation is exact: the
# target ``s * L`` is a float64 product (integers exact to 2**53), rounded; positions are int64. Above it a length
# is no model's, and 10**5000 was a traceback (``float(s * L)``: OverflowError), 1e300 x L an infinite target.
# (transformers multiplies float32 positions, integers only up to 2**24: that is the model's own precision, not a
# length rope-extend refuses. A GGUF file holds 32-bit lengths: the export checks that bound itself.)
MAX_LENGTH = 1 << 40
TOO_LONG = "2**40 = 1099511627776 tokens (longer than any sequence a model can be run on)"


def check_length(name: str, value: Any, *, minimum: int = 1) -> int:
    """A sequence length (``L``, a target length, a context): ``check_int``, and at most ``MAX_LENGTH``. Every
    reader of a length calls this one, so that all refuse the same values."""
    check_int(name, value, minimum=minimum)
    if value > MAX_LENGTH:
        raise RopeExtendError(f"{name} must be <= {TOO_LONG}, got {shown(value)}")
    return value


def check_original_length(value: Any, name: str = "original_max_position_embeddings") -> int:
    """The pretraining length ``L``: a length (``check_length``) of at least 2, since LongRoPE's attention scale
    and log-n divide by ``ln L`` (``ln 1 = 0``: a ZeroDivisionError, an infinite temperature); the audit holds a
    config's ``L`` to the same bound."""
    return check_length(name, value, minimum=2)


def check_factor(factor: Any, name: str = "factor") -> float:
    """The scale factor ``s = target / L``: a finite number >= 1 (1 means plain RoPE), and at most ``MAX_LENGTH``
    (with ``L >= 1`` a larger one reaches past it); ``name`` as the caller writes it (``--factor``)."""
    s = check_number(name, factor, minimum=1.0)
    if s > MAX_LENGTH:
        raise RopeExtendError(f"{name} must be <= 2**40: s x L would pass {TOO_LONG}, got {shown(factor)}")
    return s


def check_partial_rotary_factor(value: Any) -> float:
    """The share of each head that rotates: a finite number in (0, 1]."""
    prf = check_number("partial_rotary_factor", value, above=0.0)
    if prf > 1.0:
        raise RopeExtendError(f"partial_rotary_factor must be in (0, 1], got {shown(value)}")
    return prf


def rotary_dim(head_dim: Any, partial_rotary_factor: Any = 1.0) -> int:
    """``d = int(head_dim * partial_rotary_factor)``; must be even and >= 2."""
    check_int("head_dim", head_dim, minimum=2)
    prf = check_partial_rotary_factor(partial_rotary_factor)
    dim = int(head_dim * prf)
    if dim < 2 or dim % 2:
        raise RopeExtendError(
            f"the rotary dimension head_dim * partial_rotary_factor = {head_dim} * {prf} -> {dim} "
            "must be an even integer >= 2"
        )
    return dim


@dataclass(frozen=True)
class Geometry:
    """The plain numbers the math needs: rotary dimension ``d``, base ``b``, original length ``L``."""

    dim: int
    base: float
    original_max_position_embeddings: int

    def __post_init__(self):
        check_int("rotary dim", self.dim, minimum=2)
        check_number("base (rope_theta)", self.base, above=1.0)
        check_original_length(self.original_max_position_embeddings)


Compute = Callable[[Any, Geometry, float, "int | None"], "tuple[torch.Tensor, float]"]


@dataclass(frozen=True)
class Method:
    """One scaling method: its parameters, its math, and how it is written into a config.

    ``compute(params, geometry, factor, seq_len) -> (inv_freq float32[d/2], attention_scale)``.
    """

    name: str
    params: type
    compute: Compute
    rope_type: str  # the `rope_type` written into `config.rope_parameters`
    dynamic: bool = False  # frequencies depend on the current length
    in_transformers: bool = False  # `rope_type` is transformers' own type, with the same numbers
    attention: bool = False  # plain RoPE frequencies; the method changes positions in attention (methods.attention)
    source: str = ""
    # (scaling, dim, base, at) -> the methods.engine_form.Form serving engines compute it in, or None where none
    # does; None: no engine knows the method (an attention method: positions change inside attention)
    engine_form: Callable[..., Any] | None = None
    # an attention method, refused by every engine whose target says nothing of it (export.routes): what an engine
    # lacks to run it (None: "it has no attention that changes positions per query and key") and the nearest
    # choice that exports (None: yarn at the same reach)
    engine_lacks: str | None = None
    engine_instead: str | None = None

    def __repr__(self) -> str:
        return f"Method({self.name!r}, rope_type={self.rope_type!r})"

    def make_params(self, params: dict[str, Any]) -> Any:
        """Build the validated params dataclass; unknown names are errors that list the allowed ones."""
        allowed = [f.name for f in dataclasses.fields(self.params)]
        params = {k: v for k, v in params.items() if k != "logn"}  # any method takes logn (Scaling.logn)
        for key in params:
            if key not in allowed:
                hint = closest(key, allowed)
                listing = ", ".join(allowed) if allowed else "none"
                raise RopeExtendError(
                    f"unknown parameter {shown(key, 100)} for method {self.name!r}{hint}; its parameters are: {listing}"
                )
        return self.params(**params)

    def param_dict(self, params: Any) -> dict[str, Any]:
        """The parameters that are set (not None), as plain JSON-friendly values."""
        out = {}
        for f in dataclasses.fields(params):
            value = getattr(params, f.name)
            if value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out
