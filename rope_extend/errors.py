"""Exceptions rope-extend raises on bad input, and the hint it gives for a misspelt name.

The hierarchy:

    Exception
    └── RopeExtendBaseError              catch this to catch every exception below
        ├── RopeExtendError              (also ValueError)   a bad argument: unknown name, value out of range
        ├── UnsupportedModelError        (also TypeError)    a model, cache or mode a method cannot run on
        └── NotPatchedError              (also RuntimeError) ``unpatch`` on a model ``patch`` never touched

Each also subclasses the builtin it was before, so callers that catch ``ValueError``, ``TypeError`` or
``RuntimeError`` keep working. ``RopeExtendError`` is the bad-argument error (its name predates the base class,
and callers catch it), so the base has a name of its own. ``RopeExtendException``, the base's earlier name, is
kept as a deprecated alias for one release. Each message names what was wrong and what is allowed."""

from __future__ import annotations

import difflib
import warnings
from typing import TYPE_CHECKING


class RopeExtendBaseError(Exception):
    """The base of every exception rope-extend raises on bad input: catch this to catch them all."""


class RopeExtendError(RopeExtendBaseError, ValueError):
    """A bad argument: an unknown method or parameter, or a value out of range."""


class UnsupportedModelError(RopeExtendBaseError, TypeError):
    """The model has no rotary embedding module rope-extend knows how to scale, or a method cannot run on it."""


class NotPatchedError(RopeExtendBaseError, RuntimeError):
    """`unpatch` was called on a model that `patch` never touched."""


# earlier names, kept one release; reading one warns
_DEPRECATED = {"RopeExtendException": "RopeExtendBaseError"}

if TYPE_CHECKING:
    RopeExtendException = RopeExtendBaseError


def __getattr__(name: str):
    if name in _DEPRECATED:
        new = _DEPRECATED[name]
        warnings.warn(
            f"rope_extend.{name} is deprecated; use rope_extend.{new} (the same class)",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def close_matches(name, allowed, cutoff: float = 0.6) -> list[str]:
    """Up to three of ``allowed`` that look like a misspelt ``name``."""
    return difflib.get_close_matches(str(name), [str(a) for a in allowed], n=3, cutoff=cutoff)


def closest(name, allowed) -> str:
    """A ' (did you mean ...?)' hint for a misspelt name, or ''."""
    near = close_matches(name, allowed)
    return f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else ""
