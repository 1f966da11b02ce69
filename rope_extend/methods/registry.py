"""The method registry and the ``inv_freq`` entry point (``rope_extend.method_names()`` is ``names`` here)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import RopeExtendError
from ..registry import Registry
from ._common import Geometry, Method, check_factor, check_length, rotary_dim
from .resolved import Scaling, resolve


def _new_rope_type(method: Method) -> None:
    """Two methods cannot write one ``rope_type``: a config naming it would not say which."""
    for other in METHODS.values():
        if other is not method and other.rope_type == method.rope_type:
            raise RopeExtendError(f"rope_type {method.rope_type!r} is already used by method {other.name!r}")


# the scaling methods; ``hf.transformers_changes`` listens, installing each one's rope type in transformers, so
# that after ``import rope_extend`` a config naming it validates, builds and reloads (the registry stays free of
# transformers). A method of one's own: ``METHODS.register(Method(...))``; its name and its ``rope_type`` must
# both be new (a clash with another method, or with a rope type transformers has, is refused and not registered).
METHODS: Registry[Method] = Registry("method", check=_new_rope_type)
for _name, _path in (  # the built-in methods, in the order of tables and help texts
    ("linear", "linear:METHOD"),
    ("ntk", "ntk:NTK"),
    ("dynamic", "ntk:DYNAMIC"),
    ("ntk_by_parts", "yarn:NTK_BY_PARTS"),
    ("yarn", "yarn:YARN"),
    ("dynamic_yarn", "yarn:DYNAMIC_YARN"),
    ("llama3", "llama3:METHOD"),
    ("longrope", "longrope:METHOD"),
    ("self_extend", "attention:SELF_EXTEND"),
    ("dual_chunk", "attention:DUAL_CHUNK"),
    ("rerope", "attention:REROPE"),
    ("leaky_rerope", "attention:LEAKY_REROPE"),
    ("string", "string:STRING"),
):
    METHODS.register_lazy(_name, f"{__package__}.{_path}")

# the names callers used before there was one registry (``rope_extend.get_method`` and ``method_names`` are
# ``get`` and ``names``): the registry's own methods, not functions wrapping them
register = METHODS.register
unregister = METHODS.unregister
names = METHODS.names
get = METHODS.get


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
    "register",
    "resolve",
    "unregister",
]
