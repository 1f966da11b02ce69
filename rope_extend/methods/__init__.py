"""The scaling methods as pure math: plain numbers in, ``(inv_freq, attention_scale)`` out.

One module per method family; each method is a frozen params dataclass that validates itself plus one
function. ``register`` adds a method (duplicates are refused); ``get`` looks one up by name.
"""

from ._common import (
    MAX_LENGTH,
    Geometry,
    Method,
    check_factor,
    check_int,
    check_length,
    check_number,
    check_original_length,
    check_partial_rotary_factor,
    rope_frequencies,
    rotary_dim,
)
from .registry import by_rope_type, get, inv_freq, names, register
from .resolved import Scaling, resolve

__all__ = [
    "MAX_LENGTH",
    "Geometry",
    "Method",
    "Scaling",
    "by_rope_type",
    "check_factor",
    "check_int",
    "check_length",
    "check_number",
    "check_original_length",
    "check_partial_rotary_factor",
    "get",
    "inv_freq",
    "names",
    "register",
    "resolve",
    "rope_frequencies",
    "rotary_dim",
]
