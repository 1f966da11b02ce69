"""Exceptions rope-extend raises on bad input. All subclass ``RopeExtendException``, and each also the builtin
it was before (ValueError, TypeError, RuntimeError), so callers that already catch those keep working. Each
message names what was wrong and what is allowed."""

from __future__ import annotations

import difflib


class RopeExtendException(Exception):
    """The base of every exception rope-extend raises on bad input: catch this to catch them all."""


class RopeExtendError(RopeExtendException, ValueError):
    """A bad argument: an unknown method or parameter, or a value out of range."""


class UnsupportedModelError(RopeExtendException, TypeError):
    """The model has no rotary embedding module rope-extend knows how to scale, or a method cannot run on it."""


class NotPatchedError(RopeExtendException, RuntimeError):
    """`unpatch` was called on a model that `patch` never touched."""


def close_matches(name, allowed, cutoff: float = 0.6) -> list[str]:
    """Up to three of ``allowed`` that look like a misspelt ``name``."""
    return difflib.get_close_matches(str(name), [str(a) for a in allowed], n=3, cutoff=cutoff)


def closest(name, allowed) -> str:
    """A ' (did you mean ...?)' hint for a misspelt name, or ''."""
    near = close_matches(name, allowed)
    return f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else ""
