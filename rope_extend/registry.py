"""One registry for every extension point: scaling methods, evaluation tasks and export targets.

A ``Registry[T]`` maps names to things of one kind, in registration order (the order of tables, reports and
help texts). ``register`` adds one (a call, or a decorator), refusing a duplicate, a reserved name and
whatever the registry's own ``check`` refuses; ``get`` returns one, or raises a ``RopeExtendError`` that names
the kind, the unknown name, the closest known name and every allowed one; ``unregister`` removes one (a test's
toy, a plugin unloading). Listeners hear of every registration from the moment they subscribe (the methods
registry installs each method's rope type in transformers this way); a listener that raises undoes the
registration, so a thing is registered everywhere or nowhere. Unregistration has listeners of its own
(``on_unregister``: the methods registry takes the rope type out of transformers again); they hear of an entry
only if the registration listeners did (a lazy entry never imported was installed nowhere), after it is gone,
so ``name in registry`` is already False for them.

An entry may be lazy, ``register_lazy(name, "package.module:attribute")``: its name is listed at once and its
module imported on first ``get``, so that a command line can list the export targets without loading torch
(as lm-evaluation-harness registers its model types by module path). Iterating a registry gives its names,
as a dict does, so ``name in registry`` and ``", ".join(registry)`` read as they did on the tuples before.

Every extension point uses it one way (``tests/test_structure.py`` holds them to it): scaling methods
(``methods.registry.METHODS``), family rules (``hf.families.rule.RULES``), evaluation tasks
(``evaluation.tasks.base.TASKS``) and export targets (``export.targets.TARGETS``) each have one registry, whose
built-in entries are module constants listed by path, in order, under its definition (lm-eval's lazy model
types), so that a name is known before its module is imported; an entry of one's own is ``register(entry)``
(peft's ``register_peft_method``). A module registers nothing when imported, so no import order holds the
registration order; and no function wraps a registry's methods (where an older name is kept for callers, it is
the registry's bound method itself).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .errors import RopeExtendError, closest

T = TypeVar("T")


@dataclass(frozen=True)
class _Lazy:
    """An entry not imported yet: ``module:attribute``."""

    path: str

    def load(self) -> Any:
        module, _, attribute = self.path.partition(":")
        return getattr(importlib.import_module(module), attribute)


class Registry(Generic[T]):
    """Names to things of one ``kind`` ("method", "evaluation task", "export target"; it starts every error).

    ``reserved``: names no entry may take (a suite's own keys, for tasks). ``identifiers``: names must be
    Python identifiers (a task's name is a YAML key and a command). ``check(item)``: raises on an entry that
    clashes with the registered ones in a way only this kind knows (two methods writing one ``rope_type``).
    """

    def __init__(
        self,
        kind: str,
        *,
        reserved: Iterable[str] = (),
        identifiers: bool = False,
        check: Callable[[T], None] | None = None,
    ):
        self.kind = kind
        self.reserved = frozenset(reserved)
        self.identifiers = identifiers
        self._check = check
        self._items: dict[str, T | _Lazy] = {}
        self._listeners: list[Callable[[T], None]] = []
        self._unlisteners: list[Callable[[T], None]] = []

    # ----------------------------------------------------------------------------------------- adding
    def register(self, item: T | None = None, /, *, name: str | None = None) -> Any:
        """Add ``item`` under ``name`` (default ``item.name``) and return it; without ``item``, a decorator that
        does so (``@registry.register`` or ``@registry.register(name="x")``)."""
        if item is None:
            return lambda thing: self.register(thing, name=name)
        key = self._check_name(getattr(item, "name", None) if name is None else name)
        if self._check is not None:
            self._check(item)
        self._items[key] = item
        try:
            for listener in self._listeners:
                listener(item)
        except Exception:
            del self._items[key]  # all or nothing: an entry a listener refuses is not registered
            raise
        return item

    def register_lazy(self, name: str, path: str) -> None:
        """Add ``name``, to be imported from ``path`` (``"package.module:attribute"``) on first ``get``. Listeners
        hear of it then; ``check`` runs then too."""
        self._check_name(name)
        self._items[name] = _Lazy(path)

    def _check_name(self, name: object) -> str:
        """``name``, once it is a name this registry can take (a string, and not taken)."""
        if (
            not isinstance(name, str)
            or not name
            or name in self.reserved
            or (self.identifiers and not name.isidentifier())
        ):
            shape = "an identifier" if self.identifiers else "a non-empty string"
            other = f" other than {', '.join(sorted(self.reserved))}" if self.reserved else ""
            raise RopeExtendError(f"the name of {_a(self.kind)} must be {shape}{other}, got {name!r}")
        if name in self._items:
            raise RopeExtendError(f"{_a(self.kind)} named {name!r} is already registered")
        return name

    def on_register(self, listener: Callable[[T], None]) -> None:
        """Call ``listener(item)`` for every entry registered after this call."""
        self._listeners.append(listener)

    def on_unregister(self, listener: Callable[[T], None]) -> None:
        """Call ``listener(item)`` for every loaded entry unregistered after this call, once it is gone."""
        self._unlisteners.append(listener)

    def remove_listener(self, listener: Callable[[T], None]) -> None:
        """Stop calling ``listener`` (one that ``on_register`` or ``on_unregister`` added; another is let be)."""
        for listeners in (self._listeners, self._unlisteners):
            if listener in listeners:
                listeners.remove(listener)

    def unregister(self, name: str) -> T | None:
        """Remove ``name`` and return what it named (None if nothing): a test's toy, a plugin unloading. The
        ``on_unregister`` listeners hear of it (not of a lazy entry never imported: nothing heard of it)."""
        item = self._items.pop(name, None)
        if item is None or isinstance(item, _Lazy):
            return None
        for listener in self._unlisteners:
            listener(item)
        return item

    # ---------------------------------------------------------------------------------------- reading
    def get(self, name: Any) -> T:
        """The entry called ``name``; an unknown name raises, naming the closest known one and all of them."""
        try:
            item = self._items[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name (a list from YAML) is unknown too
            raise RopeExtendError(
                f"unknown {self.kind} {name!r}{closest(name, self._items)}; allowed: {', '.join(self._items)}"
            ) from None
        if isinstance(item, _Lazy):
            item = self._load(name, item)
        return item

    def _load(self, name: str, lazy: _Lazy) -> T:
        item = lazy.load()
        if getattr(item, "name", name) != name:  # the path would name one thing and the registry another
            raise RopeExtendError(f"{_a(self.kind)} listed as {name!r} at {lazy.path} is named {item.name!r}")
        # in place before ``check`` runs, so that a check reading every entry (``values``) finds this one loaded
        # instead of loading it again; taken back if the check or a listener refuses it
        self._items[name] = item
        try:
            if self._check is not None:
                self._check(item)
            for listener in self._listeners:
                listener(item)
        except Exception:
            self._items[name] = lazy
            raise
        return item

    def names(self) -> list[str]:
        """The registered names, in registration order (lazy ones are not imported)."""
        return list(self._items)

    def values(self) -> list[T]:
        """The registered entries, in registration order (lazy ones are imported)."""
        return [self.get(name) for name in self._items]

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._items
        except TypeError:
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._items)})"


def _a(kind: str) -> str:
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"
