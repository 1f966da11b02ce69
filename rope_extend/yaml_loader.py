"""How rope-extend reads YAML (recipes, suites, ``--set`` values, a run's saved recipe): one loader, used by every read.

It is ``yaml.SafeLoader`` (no tag constructs an arbitrary object: ``!!python/...`` is an error) with five changes:

- YAML 1.2's floats, so that ``1e-3`` is a number as ``1.0e-3`` is (YAML 1.1, which PyYAML implements, reads an
  exponent without a dot as a string);
- a key given twice in one mapping is refused, naming the key and both lines (PyYAML keeps the later one
  silently: a recipe with ``max_steps`` twice would train with the second);
- nesting deeper than ``MAX_DEPTH`` levels is refused (PyYAML composes a document recursively: 20,000 levels
  end in a RecursionError);
- an integer past Python's 4300 digits of conversion is refused (``int`` raises a ValueError, not a YAML error);
- aliases (``*name``) may repeat at most ``MAX_ALIASED`` characters in all (a value counts its text, plus one). An
  alias repeats a node without copying it, so ten aliases of ten aliases of ... (an "alias bomb"), or ten thousand
  aliases of a long string, are a few lines that stand for gigabytes; read into a dataclass or printed in an error,
  they would take that much time and memory. Aliases are kept, within the bound, because a suite may share one
  block between entries (``<<: *common``); no shipped recipe or suite uses them, and the bound is far above what a
  hand-written file repeats.

Each refusal is a ``yaml.MarkedYAMLError`` (``LimitError``), so every caller's ``except yaml.YAMLError`` turns it
into its one-line message, with the line and column. A file is read by ``read_yaml``, through ``untrusted``: a
regular file of at most ``MAX_BYTES``, UTF-8.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from .errors import RopeExtendError, shown
from .untrusted import read_text

MAX_DEPTH = 64  # a recipe nests 3 levels; PyYAML's recursion would end near 300
MAX_ALIASED = 100_000  # characters (and values) repeated by aliases in one document
MAX_BYTES = 4 << 20  # a recipe or suite is a few kB
_MERGE = "tag:yaml.org,2002:merge"


class LimitError(yaml.MarkedYAMLError):
    """A document refused by one of the loader's bounds, or for a duplicate key (see the module docstring)."""


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):  # a scalar has none
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


class Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with YAML 1.2's floats, no duplicate keys and bounded depth and aliases."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._aliased = 0
        self._size: dict[int, int] = {}  # id(node) -> the characters and values it stands for, aliases expanded

    def compose_node(self, parent, index):
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            node = super().compose_node(parent, index)
            size = self._size.get(id(node))
            if size is None:  # the alias sits inside the node it names: a structure that contains itself
                raise LimitError(
                    problem="an alias inside the value it names (a value that contains itself)", problem_mark=mark
                )
            self._aliased += size
            if self._aliased > MAX_ALIASED:
                raise LimitError(
                    problem=f"aliases (*name) repeat more than {MAX_ALIASED} characters in this document: write "
                    "the values out, or share less",
                    problem_mark=mark,
                )
            return node
        if self._depth >= MAX_DEPTH:
            raise LimitError(problem=f"values nest deeper than {MAX_DEPTH} levels", problem_mark=mark)
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        own = len(node.value) if isinstance(node, yaml.ScalarNode) else 0
        self._size[id(node)] = 1 + own + sum(self._size[id(child)] for child in _children(node))
        return node

    def construct_yaml_int(self, node):
        """An integer, or a refusal of one past Python's 4300 digits (``int`` raises a ValueError there, which is
        not a ``yaml.YAMLError``: every caller would end in a traceback)."""
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            raise LimitError(
                problem=f"an integer of {len(node.value)} digits: more than any value rope-extend reads",
                problem_mark=node.start_mark,
            ) from None

    def construct_document(self, node):
        self._check_keys(node)
        return super().construct_document(node)

    def _check_keys(self, root: yaml.Node) -> None:
        """Refuse a key given twice in one mapping, anywhere in the document (before any mapping is built:
        building one resolves its merge keys in place). A key merged in (``<<: *base``) and then given is not
        twice: that is what a merge is for."""
        seen_nodes: set[int] = set()
        stack = [root]
        while stack:
            node = stack.pop()
            if id(node) in seen_nodes:
                continue
            seen_nodes.add(id(node))
            stack.extend(_children(node))
            if not isinstance(node, yaml.MappingNode):
                continue
            first: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE or not isinstance(key_node, yaml.ScalarNode):
                    continue  # a merge key may repeat; a collection as a key is refused when built (unhashable)
                key = self.construct_object(key_node)
                try:
                    earlier = first.get(key)
                except TypeError:  # unhashable: refused when the mapping is built
                    continue
                if earlier is not None:
                    raise LimitError(
                        problem=f"the key {shown(key, 60)} is given twice in one mapping (line "
                        f"{earlier.start_mark.line + 1} and line {key_node.start_mark.line + 1}): give it once",
                    )
                first[key] = key_node


Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)
_FLOAT = "tag:yaml.org,2002:float"
Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _FLOAT]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?   # 1.5, 1., 1.0e-3
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+                      # 1e-3, 5E4: a string in YAML 1.1
        |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?               # .5, .5e-3
        |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*           # 1:30.5 (YAML 1.1's base 60, kept)
        |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""",
        re.VERBOSE,
    ),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """``text`` read as ``yaml.safe_load`` reads it, with the module docstring's changes (a ``yaml.YAMLError``
    for what it refuses)."""
    return yaml.load(text, Loader=Loader)  # a SafeLoader subclass: no arbitrary objects


def yaml_problem(exc: yaml.YAMLError) -> str:
    """One line for a YAML error: a refusal of ``Loader``'s says what and where (line), PyYAML's own its text."""
    if isinstance(exc, LimitError):
        mark = exc.problem_mark
        return str(exc.problem) + (f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else "")
    return " ".join(str(exc).split())


def read_yaml(
    path: str | Path,
    *,
    what: str = "file",
    error: type[RopeExtendError] = RopeExtendError,
    follow_links: bool = True,
    fix: str | None = None,
) -> dict:
    """A YAML mapping from ``path`` (see ``load_yaml``); an empty file is ``{}``. ``follow_links=False`` for a
    file rope-extend wrote itself (a run's saved recipe): a link there is refused, not read through. ``fix``
    ends each refusal (default: what a ``what`` is)."""
    path = Path(path)
    if not os.path.lexists(path):
        raise error(f"{what} {str(path)!r}: no such file")
    # a regular file of at most MAX_BYTES, UTF-8 (a pipe or a device is refused, not waited on or read forever)
    fix = f"a {what} is a few kB of YAML" if fix is None else fix
    text = read_text(path, limit=MAX_BYTES, name=f"{what} {path}", follow_links=follow_links, fix=fix, error=error)
    try:
        data = load_yaml(text)
    except LimitError as exc:
        raise error(f"{what} {path}: {yaml_problem(exc)}") from None
    except yaml.YAMLError as exc:
        raise error(
            f"{what} {path} is not valid YAML (or uses a tag that safe loading refuses): {yaml_problem(exc)}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise error(f"{what} {path}: expected a mapping of keys at the top, got {type(data).__name__}")
    return data
