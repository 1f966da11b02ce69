"""Exceptions rope-extend raises on bad input. All subclass ValueError or TypeError so callers that
already catch those keep working; each message names what was wrong and what is allowed."""

from __future__ import annotations

import difflib


class RopeExtendError(ValueError):
    """A bad argument: an unknown method or parameter, or a value out of range."""


class UnsupportedModelError(TypeError):
    """The model has no rotary embedding module rope-extend knows how to scale."""


class NotPatchedError(RuntimeError):
    """`unpatch` was called on a model that `patch` never touched."""


def close_matches(name, allowed, cutoff: float = 0.6) -> list[str]:
    """Up to three of ``allowed`` that look like a misspelt ``name``."""
    return difflib.get_close_matches(str(name), [str(a) for a in allowed], n=3, cutoff=cutoff)


def closest(name, allowed) -> str:
    """A ' (did you mean ...?)' hint for a misspelt name, or ''."""
    near = close_matches(name, allowed)
    return f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else ""
