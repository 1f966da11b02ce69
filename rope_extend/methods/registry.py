"""The method registry and the ``inv_freq`` entry point (``rope_extend.method_names()`` is ``names`` here)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import RopeExtendError
from ..registry import Registry
from . import attention as _attention
from . import linear as _linear
from . import llama3 as _llama3
from . import longrope as _longrope
from . import ntk as _ntk
from . import string as _string
from . import yarn as _yarn
from ._common import Geometry, Method, check_factor, check_length, rotary_dim
from ._scaling import Scaling, resolve


def _new_rope_type(method: Method) -> None:
    """Two methods cannot write one ``rope_type``: a config naming it would not say which."""
    for other in METHODS.values():
        if other.rope_type == method.rope_type:
            raise RopeExtendError(f"rope_type {method.rope_type!r} is already used by method {other.name!r}")


# the scaling methods; ``hf.transformers_changes`` listens, installing each one's rope type in transformers, so
# that after ``import rope_extend`` a config naming it validates, builds and reloads (the registry stays free of
# transformers)
METHODS: Registry[Method] = Registry("method", check=_new_rope_type)


def on_register(listener) -> None:
    """Call ``listener(method)`` for every method registered after this call (``hf.transformers_changes``
    listens)."""
    METHODS.on_register(listener)


def on_unregister(listener) -> None:
    """Call ``listener(method)`` for every method unregistered after this call (``hf.transformers_changes`` listens)."""
    METHODS.on_unregister(listener)


def register(method: Method) -> Method:
    """Add a method. Its name and its config ``rope_type`` must both be new. After ``import rope_extend`` its
    rope type is installed in transformers at once (as the built-in ones are at import), so a config that
    names it validates, builds and reloads; one transformers cannot take is not registered.

    Args:
        method: the ``Method`` (name, parameters dataclass, frequency function, ``rope_type``).

    Returns:
        ``method``.

    Raises:
        RopeExtendError: the name or the ``rope_type`` is taken (by another method, or by transformers).
    """
    return METHODS.register(method)


for _m in (
    _linear.METHOD,
    _ntk.NTK,
    _ntk.DYNAMIC,
    _yarn.NTK_BY_PARTS,
    _yarn.YARN,
    _yarn.DYNAMIC_YARN,
    _llama3.METHOD,
    _longrope.METHOD,
    *_attention.METHODS,
    _string.STRING,
):
    register(_m)


def unregister(name: str) -> Method | None:
    """Remove a method; after ``import rope_extend`` its rope types leave transformers too (``hf.transformers_changes``),
    so a config naming it no longer builds.

    Args:
        name: the method's name.

    Returns:
        The method removed, or None if none was registered under ``name``.
    """
    return METHODS.unregister(name)


def names() -> list[str]:
    """The registered method names, in registration order."""
    return METHODS.names()


def get(name: Any) -> Method:
    """The method called ``name``.

    Args:
        name: a method name.

    Returns:
        The registered ``Method``.

    Raises:
        RopeExtendError: an unknown name; the message names the closest known one and all of them.
    """
    return METHODS.get(name)


def by_rope_type(rope_type: str) -> Method | None:
    """The method that writes ``rope_type`` into configs, or None."""
    for method in METHODS.values():
        if method.rope_type == rope_type:
            return method
    return None


def inv_freq(
    method: str,
    head_dim: int,
    base: float,
    factor: float,
    original_max_position_embeddings: int,
    *,
    seq_len: int | None = None,
    partial_rotary_factor: float = 1.0,
    **params: Any,
) -> tuple[torch.Tensor, float]:
    """Scaled inverse frequencies (float32, length ``rotary_dim // 2``) and the attention scale.

    Args:
        method: a method name (``names()``).
        head_dim: the attention head size; the rotary dimension is ``int(head_dim * partial_rotary_factor)``.
        base: RoPE's ``theta`` (``rope_theta``).
        factor: ``s = target / L`` with ``L = original_max_position_embeddings``.
        original_max_position_embeddings: ``L``, the pretraining length.
        seq_len: the current length; matters for the dynamic methods only (None means ``L``).
        partial_rotary_factor: the share of each head that rotates.
        **params: the method's own parameters.

    Returns:
        ``(inv_freq, attention_scale)``: float32 frequencies of length ``rotary_dim // 2``, and the factor the
        method scales cos and sin by (1.0 for most).

    Raises:
        RopeExtendError: an unknown method or parameter, or a value out of range.
    """
    m = get(method)
    p = m.make_params(params)
    geo = Geometry(rotary_dim(head_dim, partial_rotary_factor), base, original_max_position_embeddings)
    s = check_factor(factor)
    if seq_len is not None:
        check_length("seq_len", seq_len)
    freqs, scale = m.compute(p, geo, s, seq_len)
    return freqs.to(torch.float32).contiguous(), float(scale)


__all__ = [
    "METHODS",
    "Geometry",
    "Method",
    "Scaling",
    "by_rope_type",
    "get",
    "inv_freq",
    "names",
    "on_register",
    "on_unregister",
    "register",
    "resolve",
    "unregister",
]
