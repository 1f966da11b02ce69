"""The one YAML-to-dataclass loader, for recipes and evaluation suites.

A YAML mapping maps 1:1 onto a dataclass (as trl's TrlParser does): keys are field names, sections are
nested dataclasses, and ``key=value`` overrides (dotted keys for sections: ``rope.factor=8``) win over the
file. Loading is strict: an unknown key names its closest valid ones; a value of the wrong type, a value
outside a field's ``Literal`` choices, or a non-finite number names the key, the value and what is
allowed. Fields carry their help text in metadata (as PEFT's ``LoraConfig`` fields do), so errors and
``--check`` can print it:

    @dataclass
    class DataArgs:
        boundaries: Literal["eos", "mask"] = option("eos", help="how packed documents are kept apart")

YAML is read with ``load_yaml`` (``yaml_loader``): ``yaml.safe_load`` (no tag constructs an arbitrary object:
``!!python/...`` is an error) with YAML 1.2's floats (``1e-3`` is a number), no key given twice, and bounded
nesting and aliases. An error shows a value at most ``untrusted.shown``'s few hundred characters long, whatever
its size.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from typing import Any, Literal

import yaml

from .errors import RopeExtendError, close_matches, shown
from .yaml_loader import (
    load_yaml,
    read_yaml,  # noqa: F401  (recipes and suites read their files through schema)
    yaml_problem,
)

_MISSING = dataclasses.MISSING
MAX_PROBLEMS = 8  # problems listed in one error; the rest are counted


def option(default: Any = _MISSING, *, help: str, factory: Any = _MISSING, internal: bool = False):
    """A dataclass field with help text (``metadata["help"]``); ``internal`` fields are not read from YAML."""
    metadata = {"help": help, "internal": internal}
    if factory is not _MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def help_of(cls, name: str) -> str:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get("help", "")
    return ""


def public_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


# ------------------------------------------------------------------------------------------ types
def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def describe_type(hint: Any) -> str:
    """``int``, ``float``, ``a string``, ``true/false``, ``one of 'eos', 'mask'``, ``list[str] or null``..."""
    if hint is Any:
        return "any value"
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(hint))
    if _is_union(hint):
        return " or ".join(describe_type(h) for h in typing.get_args(hint))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return f"a mapping of {hint.__name__} keys"
    if isinstance(hint, type):
        return {"str": "a string", "bool": "true/false"}.get(hint.__name__, hint.__name__)
    return str(hint).replace("typing.", "").replace("NoneType", "null")


class _Mismatch(Exception):
    """A value does not fit a type hint; ``reason`` says why when it is more than the type."""

    def __init__(self, reason: str = ""):
        super().__init__(reason)
        self.reason = reason


def _exact(value: Any, hint: type) -> Any:
    if isinstance(value, hint):
        return value
    raise _Mismatch()


def _to_int(value: Any, hint: type) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _Mismatch()


def _to_float(value: Any, hint: type) -> float:
    if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            raise _Mismatch() from None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise _Mismatch("a finite number")
        return float(value)
    raise _Mismatch()


# the plain types a hint may name, each with its check (an int is never a bool; a float may come as a string)
_SCALARS = {type(None): _exact, bool: _exact, str: _exact, int: _to_int, float: _to_float}


def _coerce_union(value: Any, hint: Any, path: str, error: type[RopeExtendError], where: str | None) -> Any:
    """The first option of the union that ``value`` fits; else the first reason an option gave."""
    reasons = []
    for option_hint in typing.get_args(hint):
        try:
            return _coerce(value, option_hint, path, error, where)
        except _Mismatch as exc:
            reasons.append(exc.reason)
    raise _Mismatch(next((r for r in reasons if r), ""))


def _coerce(value: Any, hint: Any, path: str, error: type[RopeExtendError], where: str | None) -> Any:
    """``value`` checked against ``hint`` (nested dataclasses built), or ``_Mismatch``."""
    if hint is Any:
        return value
    if _is_union(hint):
        return _coerce_union(value, hint, path, error, where)
    if hint in _SCALARS:
        return _SCALARS[hint](value, hint)
    origin = typing.get_origin(hint)
    if origin is Literal:
        if any(value == v and type(value) is type(v) for v in typing.get_args(hint)):
            return value
        raise _Mismatch()
    if dataclasses.is_dataclass(hint):
        if isinstance(value, dict):
            return build(hint, value, where=where, error=error, prefix=path + ".")
        raise _Mismatch()
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise _Mismatch()
        return [_coerce(v, item, f"{path}[{i}]", error, where) for i, v in enumerate(value)]
    if origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise _Mismatch()
    if isinstance(hint, type) and isinstance(value, hint):
        return value
    raise _Mismatch()


def _check_value(
    value: Any, hint: Any, path: str, cls, name: str, *, error: type[RopeExtendError], where: str | None
) -> Any:
    """``value`` coerced to ``hint``, or ``error`` naming ``where``, the dotted ``path``, the value and what
    ``cls.name`` expects (its help text too)."""
    try:
        return _coerce(value, hint, path, error, where)
    except _Mismatch as exc:
        help_text = help_of(cls, name)
        expected = exc.reason or describe_type(hint)
        raise error(
            (f"{where}: " if where else "")
            + f"{path}: got {shown(value)} ({type(value).__name__}); expected {expected}"
            + (f" ({help_text})" if help_text else "")
        ) from None


# ------------------------------------------------------------------------------------------ building
def build(
    cls, data: Any, *, where: str | None = "the file", error: type[RopeExtendError] = RopeExtendError, prefix: str = ""
):
    """``cls(**data)`` after checking every key and value; errors name ``where`` and the dotted key."""
    head = f"{where}: " if where else ""
    section = prefix.rstrip(".") or "the top level"
    if not isinstance(data, dict):
        raise error(f"{head}{section} must be a mapping of {cls.__name__} keys, got {shown(data)}")
    hints = typing.get_type_hints(cls)
    fields = public_fields(cls)
    names = [f.name for f in fields]
    kwargs, problems = {}, []  # every bad key and value is reported, not only the first
    for key, value in data.items():
        if key not in names:
            near = close_matches(key, names, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(prefix + n) for n in near)}?" if near else ""
            problems.append(
                f"unknown key {shown(prefix + str(key))}{hint} (valid keys in {section}: {', '.join(names)})"
            )
            continue
        try:
            kwargs[key] = _check_value(value, hints[key], prefix + key, cls, key, error=error, where=where)
        except error as exc:  # a nested section's problems come back with the same head
            problems.append(str(exc).removeprefix(head))
    missing = [f.name for f in fields if f.name not in data and f.default is _MISSING and f.default_factory is _MISSING]
    if missing:
        problems.append(
            f"{section} is missing "
            + ", ".join(f"{m!r} ({help_of(cls, m)})" if help_of(cls, m) else repr(m) for m in missing)
        )
    if len(problems) == 1:
        raise error(head + problems[0])
    if problems:
        listed = " ".join(f"({i}) {p}" for i, p in enumerate(problems[:MAX_PROBLEMS], 1))
        more = f" (and {len(problems) - MAX_PROBLEMS} more)" if len(problems) > MAX_PROBLEMS else ""
        raise error(f"{head}{len(problems)} problems: {listed}{more}")
    try:
        return cls(**kwargs)
    except RopeExtendError as exc:  # a dataclass's own validation (__post_init__), named by its section
        raise error(f"{head}{section + ': ' if prefix else ''}{exc}") from None


def to_dict(obj: Any) -> Any:
    """A dataclass (nested) as plain YAML-friendly data, internal fields left out."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in public_fields(type(obj))}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def annotated(obj: Any, indent: int = 0) -> str:
    """``obj`` as YAML with each key's help as a comment (what ``--check`` prints)."""
    lines = []
    pad = " " * indent
    for f in public_fields(type(obj)):
        value = getattr(obj, f.name)
        note = f"  # {f.metadata['help']}" if f.metadata.get("help") else ""
        if dataclasses.is_dataclass(value):
            lines.append(f"{pad}{f.name}:{note}")
            lines.append(annotated(value, indent + 2))
        else:
            text = yaml.safe_dump(to_dict(value), default_flow_style=True, width=1 << 16).strip()
            text = text[:-4].strip() if text.endswith("\n...") else text.removesuffix("...").strip()
            lines.append(f"{pad}{f.name}: {text}{note}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ YAML, overrides
def parse_value(text: str, key: str = "value", error: type[RopeExtendError] = RopeExtendError) -> Any:
    """A command-line value read as YAML (``8`` -> 8, ``[1, 2]`` -> list, ``true`` -> True)."""
    try:
        return load_yaml(text)
    except yaml.YAMLError as exc:
        raise error(f"{key}: cannot read {shown(text)} as a YAML value ({yaml_problem(exc)})") from None


def parse_overrides(items: list[str] | None, error: type[RopeExtendError] = RopeExtendError) -> dict[str, Any]:
    """``["max_steps=10", "rope.factor=8"]`` -> ``{"max_steps": 10, "rope": {"factor": 8}}``."""
    tree: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise error(f"override {item!r}: expected key=value (dotted keys for sections: rope.factor=8)")
        *parents, last = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise error(f"override {key}: {part} is set to a value and cannot also be a section")
        node[last] = parse_value(value, key, error)
    return tree


def merge(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``, section by section (a non-mapping value replaces a whole section)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


# ------------------------------------------------------------------------------------------ command line
class _Items(argparse.Action):
    """A list option: one or more values, each split at commas (``--lengths 1k,2k 4k`` -> ``["1k", "2k",
    "4k"]``), each read as a YAML scalar (``"8"`` -> 8); one that cannot be read is argparse's usage error."""

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            items = [parse_value(item.strip()) for v in values for item in v.split(",") if item.strip()]
        except RopeExtendError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        setattr(namespace, self.dest, items)


class _FlagOrChoice(argparse.Action):
    """``--x`` (true) or ``--x VALUE`` (one of the field's Literal values, ``allowed``): a bool field that may
    also name which one (``card --engine``, ``--engine vllm``); ``add_arguments`` adds ``--no-x`` (false) as an
    option of its own, so that the help shows it without a value (argparse writes an action's value after each
    of its option strings: ``--no-engine [{llama.cpp,vllm}]``).

    argparse gives an optional value the next word whatever it is, so ``card --engine bundled`` read the model
    as an engine name; a word that is none of ``allowed`` is refused here, naming them and saying where the bare
    flag goes (a ``RopeExtendError``: one line, exit 2), rather than taken as a value or guessed to be a
    positional argument (a misspelt engine would then be read as a model)."""

    def __init__(self, option_strings, dest, allowed: tuple = (), **kwargs):
        super().__init__(option_strings, dest, nargs="?", **kwargs)
        self.allowed = tuple(allowed)

    def __call__(self, parser, namespace, values, option_string=None):
        if values is not None and values not in self.allowed:
            names = " or ".join(map(str, self.allowed))
            flag = option_string or self.option_strings[0]
            positionals = " ".join((a.metavar or a.dest).upper() for a in parser._actions if not a.option_strings)
            raise RopeExtendError(  # one line and exit 2 from the command line's main, as any bad value
                f"{flag} takes {names}, not {values!r}; {flag} without a value goes after the positional arguments "
                f"or before another option ({parser.prog} {positionals} {flag} ...), or name one "
                f"({flag} {self.allowed[0]})"
            )
        setattr(namespace, self.dest, True if values is None else values)


def _argument(hint: Any) -> dict[str, Any]:
    """argparse keywords for a field's type: choices for a Literal, --x/--no-x for a bool (and --x VALUE for a
    bool or a Literal), a list as one or more (comma-separated) values, a scalar typed; anything else (Any, a
    mapping) is passed on as text."""
    inner = [h for h in typing.get_args(hint) if h is not type(None)] if _is_union(hint) else [hint]
    literals = [h for h in inner if typing.get_origin(h) is Literal]
    if len(inner) == 2 and bool in inner and literals:
        allowed = typing.get_args(literals[0])
        return {"action": _FlagOrChoice, "allowed": allowed, "metavar": "{" + ",".join(map(str, allowed)) + "}"}
    hint = inner[0] if len(inner) == 1 else hint
    if typing.get_origin(hint) is Literal:
        return {"choices": typing.get_args(hint)}
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(hint) is list:
        return {"nargs": "+", "action": _Items}
    if hint in (int, float, str):
        return {"type": hint}
    if typing.get_origin(hint) is dict:
        return {"type": lambda text: parse_value(text, "value")}
    return {"type": str}


def add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One ``--field-name`` per public field of the dataclass ``cls``, with its help and default; fields
    without a default are required. ``arguments_data`` reads them back for ``build``, so the command line and
    a YAML section of the same dataclass accept the same values and give the same errors."""
    hints = typing.get_type_hints(cls)
    for f in public_fields(cls):
        keywords = _argument(hints[f.name])
        required = f.default is _MISSING and f.default_factory is _MISSING
        text = f.metadata.get("help", "")
        if not required:
            # a field that is not required has a default, or else a factory (MISSING is not callable)
            default = f.default_factory() if callable(f.default_factory) else f.default
            if default is not None and keywords.get("action") not in (argparse.BooleanOptionalAction, _FlagOrChoice):
                shown = ",".join(map(str, default)) if isinstance(default, list) else default
                text += f" (default: {shown})"
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(
            flag,
            dest=f.name,
            default=argparse.SUPPRESS,  # absent: the dataclass default applies
            required=required,
            help=text.replace("%", "%%"),
            **keywords,
        )
        if keywords.get("action") is _FlagOrChoice:
            off = "--no-" + flag[2:]
            parser.add_argument(
                off, dest=f.name, action="store_false", default=argparse.SUPPRESS, help=f"turn {flag} off"
            )


def arguments_data(args: argparse.Namespace, cls) -> dict[str, Any]:
    """The values of ``add_arguments(parser, cls)`` that were given, as data for ``build(cls, ...)``."""
    return {f.name: getattr(args, f.name) for f in public_fields(cls) if hasattr(args, f.name)}
