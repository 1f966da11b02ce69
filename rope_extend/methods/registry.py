"""The method registry and the ``inv_freq`` entry point.

Import it as ``from rope_extend.methods import registry``: the package attribute ``rope_extend.methods`` is
the public function ``methods()`` (the earlier name of ``method_names()``, kept), so
``import rope_extend.methods as registry`` would not give this module.
"""

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
from ._common import Geometry, Method, check_factor, check_int, rotary_dim
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
_REGISTRY = METHODS._items  # the same dict, for code and tests that remove an entry with ``del``


def on_register(listener) -> None:
    """Call ``listener(method)`` for every method registered after this call (``hf.transformers_changes``
    listens)."""
    METHODS.on_register(listener)


def register(method: Method) -> Method:
    """Add a method. Its name and its config ``rope_type`` must both be new. After ``import rope_extend`` its
    rope type is installed in transformers at once (as the built-in ones are at import), so a config that
    names it validates, builds and reloads; one transformers cannot take is not registered."""
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


def names() -> list[str]:
    """The registered method names, in registration order."""
    return METHODS.names()


def get(name: Any) -> Method:
    """The method called ``name``; an unknown name raises, naming the closest known one and all of them."""
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

    ``factor`` is ``s = target / L`` with ``L = original_max_position_embeddings``; ``seq_len`` is the
    current length and matters for the dynamic methods only (None means ``L``).
    """
    m = get(method)
    p = m.make_params(params)
    geo = Geometry(rotary_dim(head_dim, partial_rotary_factor), base, original_max_position_embeddings)
    s = check_factor(factor)
    if seq_len is not None:
        check_int("seq_len", seq_len)
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
]
