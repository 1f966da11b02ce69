"""Deferred imports: registration with transformers when transformers' rope utilities are loaded, not at
``import rope_extend``, and packages whose public names import on first use (``lazy_exports``).

``import rope_extend`` must leave transformers knowing rope-extend's rope types (``hf.transformers_changes``), yet
importing transformers' model code takes seconds, which the command line's ``--help`` and a script that only
builds a recipe should not pay. So:

- if ``transformers.modeling_rope_utils`` is already imported, registration runs at once, as before;
- otherwise a finder at the front of ``sys.meta_path`` watches the imports of ``transformers`` modules. When the
  outermost of them has finished (no transformers module is half-executed, so registration can import what it
  needs) and ``transformers.modeling_rope_utils`` is loaded, the finder removes itself and registers.

Every path by which transformers reads a rope type (a config's ``rope_parameters`` validated by
``RotaryEmbeddingConfigMixin``, a rotary module built from ``ROPE_INIT_FUNCTIONS``, ``PreTrainedModel.post_init``)
imports ``transformers.modeling_rope_utils`` first, so registration is in place before any of them runs. The
finder only wraps a module's loader for the time of its execution: the module's ``__loader__`` and
``__spec__.loader`` are transformers' own. Standard library only: importing this module imports nothing else.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from collections.abc import Callable

TRIGGER = "transformers.modeling_rope_utils"
WATCHED = "transformers"


class _Loader(importlib.abc.Loader):
    """The real loader of a transformers module, counting how many such modules are executing (a ``Loader``
    subclass, as ``ModuleSpec.loader`` is typed; it adds only the legacy ``load_module``, which runs ours)."""

    def __init__(self, inner, finder: ReadyFinder):
        self.inner, self.finder = inner, finder

    def create_module(self, spec):
        return self.inner.create_module(spec) if hasattr(self.inner, "create_module") else None

    def exec_module(self, module) -> None:
        module.__loader__ = self.inner
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.inner
        self.finder.depth += 1
        try:
            self.inner.exec_module(module)
        finally:
            self.finder.depth -= 1
        if self.finder.depth == 0:
            self.finder.settle()

    def __getattr__(self, name):  # get_source, get_filename, is_package, ... of the real loader
        return getattr(self.inner, name)


class ReadyFinder:
    """A ``sys.meta_path`` finder that runs ``action`` once, after ``TRIGGER`` and every transformers import in
    progress have finished. It finds nothing itself: it asks the finders behind it and wraps their loader."""

    def __init__(self, action: Callable[[], None], watched: str = WATCHED, trigger: str = TRIGGER):
        self.action, self.watched, self.trigger = action, watched, trigger
        self.depth, self.asking, self.done = 0, False, False

    def find_spec(self, name, path=None, target=None):
        if self.asking or self.done or not (name == self.watched or name.startswith(self.watched + ".")):
            return None
        self.asking = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self.asking = False
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, self)
        return spec

    def settle(self) -> None:
        if self.done or self.trigger not in sys.modules:
            return
        self.disarm()
        self.action()

    def disarm(self) -> None:
        self.done = True
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def when_transformers_ready(action: Callable[[], None]) -> ReadyFinder | None:
    """Run ``action`` now if ``transformers.modeling_rope_utils`` is imported, else once it is (see the module
    docstring). Returns the armed finder, or None when ``action`` ran at once."""
    if TRIGGER in sys.modules:
        action()
        return None
    finder = ReadyFinder(action)
    sys.meta_path.insert(0, finder)
    return finder


def lazy_exports(package: str, table: dict[str, tuple[str, str | None]]) -> None:
    """Make the public names of ``package`` import on first use (PEP 562).

    ``table`` maps a name to ``(module relative to the package, attribute)``; attribute None exports the module
    itself. Any other submodule is imported when read as an attribute. A function that shares its name with a
    submodule (``rope_extend.evaluation.passkey``) keeps the name: the import system binds
    a submodule as an attribute of its package when it is imported, and that binding is refused for these
    names; the submodule is still in ``sys.modules`` (``from rope_extend.evaluation.passkey import ...``)."""
    shadowed = {name for name, (module, attribute) in table.items() if attribute and module == "." + name}

    class LazyPackage(types.ModuleType):
        def __getattr__(self, name: str):
            if name in table:
                module, attribute = table[name]
                value = importlib.import_module(module, package)
                value = value if attribute is None else getattr(value, attribute)
            elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
                value = importlib.import_module(f"{package}.{name}")
            else:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            self.__dict__[name] = value
            return value

        def __setattr__(self, name, value):
            if name in shadowed and isinstance(value, types.ModuleType):
                return
            super().__setattr__(name, value)

        def __dir__(self):
            return sorted(set(self.__dict__) | set(table))

    sys.modules[package].__class__ = LazyPackage
