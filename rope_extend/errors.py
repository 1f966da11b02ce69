"""Exceptions rope-extend raises on bad input, the hint it gives for a misspelt name, and how a message shows a
value (``shown``: a bounded ``repr``).

The hierarchy:

    Exception
    └── RopeExtendBaseError              catch this to catch every exception below
        ├── RopeExtendError              (also ValueError)   a bad argument: unknown name, value out of range
        ├── UnsupportedModelError        (also TypeError)    a model, cache or mode a method cannot run on
        └── NotPatchedError              (also RuntimeError) ``unpatch`` on a model ``patch`` never touched

Each also subclasses the builtin it was before, so callers that catch ``ValueError``, ``TypeError`` or
``RuntimeError`` keep working. ``RopeExtendError`` is the bad-argument error (its name predates the base class,
and callers catch it), so the base has a name of its own. ``RopeExtendException``, the base's earlier name, is
kept as a deprecated alias for one release. Each message names what was wrong and what is allowed.

``shown`` lives here, beside the exceptions, because every layer builds messages: the pure math of
``rope_extend.methods`` (whose argument checks see values from users' configs) as much as the readers of
untrusted files (``rope_extend.untrusted``, which re-exports it), and this module imports nothing of
rope-extend's."""

from __future__ import annotations

import difflib
import itertools
import reprlib
import warnings
from typing import TYPE_CHECKING, Any


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


def deprecated_aliases(module: str, public: str, renamed: dict[str, str], namespace: dict[str, Any]):
    """A module ``__getattr__`` that gives each old name of ``renamed`` (old -> new) as the new one from
    ``namespace``, warning once per read that ``{public}.{old}`` is deprecated; any other name is missing."""

    def __getattr__(name: str):
        if name in renamed:
            new = renamed[name]
            warnings.warn(
                f"{public}.{name} is deprecated; use {public}.{new} (the same class)", DeprecationWarning, stacklevel=2
            )
            return namespace[new]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


__getattr__ = deprecated_aliases(__name__, "rope_extend", _DEPRECATED, globals())


def close_matches(name, allowed, cutoff: float = 0.6) -> list[str]:
    """Up to three of ``allowed`` that look like a misspelt ``name``."""
    return difflib.get_close_matches(str(name), [str(a) for a in allowed], n=3, cutoff=cutoff)


def closest(name, allowed) -> str:
    """A ' (did you mean ...?)' hint for a misspelt name, or ''."""
    near = close_matches(name, allowed)
    return f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else ""


# ------------------------------------------------------------------------------- a value in a message
class _Repr(reprlib.Repr):
    """``reprlib.Repr`` whose mappings show their first items as they come: ``reprlib`` sorts every key first,
    which on a mapping of millions of keys takes seconds."""

    def repr_dict(self, x, level):
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [
            f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
            for k, v in itertools.islice(x.items(), self.maxdict)
        ]
        return "{" + ", ".join(items) + (", ..." if len(x) > len(items) else "") + "}"


_REPR = _Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 80, 80, 80
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8


def shown(value: Any, width: int = 300) -> str:
    """``repr(value)`` cut to ``width`` characters, computed without walking the whole value: a string is cut
    before it is quoted, a list shows its first few items, nesting its first levels (``reprlib``)."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # an int past Python's 4300-digit limit of conversion to text
        text = f"<an integer of {value.bit_length()} bits>" if isinstance(value, int) else type(value).__name__
    return text if len(text) <= width else text[: width - 3] + "..."
