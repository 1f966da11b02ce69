"""Evaluation suites: one model under several scalings (``method: none`` included), several tasks, one report.

A suite is a YAML file read by the one strict loader (``rope_extend.schema``) onto the dataclasses below
(a section per registered task, ``evaluation.tasks``):
an unknown key names its closest valid ones, a wrong value names what is allowed, and command-line
overrides (``--set passkey.trials=2``) win. Shipped suites (``rope_extend/suites/``) can be named
(``rope-extend eval compare smoke``); relative paths in a suite file are relative to it when they exist there.

    model: meta-llama/Llama-2-7b-hf
    methods:
      - {method: none}
      - {method: yarn, factor: 4}
    passkey: {lengths: [4k, 8k, 16k], trials: 10}
    perplexity: {lengths: [4k, 8k, 16k], data: proof-pile.jsonl}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, make_dataclass
from pathlib import Path
from typing import Any, Literal, overload

from .. import resources, schema
from ..errors import RopeExtendError
from ..scaling import ScalingRequest
from ..schema import option
from ..yaml_loader import read_yaml
from .tasks.base import Task, tasks


@dataclass
class MethodSpec(ScalingRequest):
    """One scaling to compare (a ``ScalingRequest`` with a label). ``method: none`` is the model as loaded."""

    label: str | None = option(None, help="name in tables and plots (default: method and factor)")
    params_from: str | None = option(
        None,
        help="a JSON file of the method's parameters, e.g. the longrope.json a LongRoPE search writes "
        "(relative to the suite file); keys in params win",
    )

    def __post_init__(self):
        if self.params_from is None:
            self.check()  # the rest is checked against the model's config before any run
        # else read_params_from() fills params from the file, then checks

    def read_params_from(self, base: str | None = None) -> None:
        """Fill ``params`` from the JSON file ``params_from`` (relative to ``base``'s folder when it exists
        there), then ``check()``: ``ScalingRequest.read_params``, the reader every command shares."""
        if self.params_from is None:
            return
        if not self.scales:
            raise RopeExtendError("params_from given without a scaling method (method is none): name the method")
        located = resources.beside(base, self.params_from)  # a str for a str: None only for a None value
        path = Path(located if located is not None else self.params_from)
        self.read_params(path, f"methods[{self.name()}].params_from ({path})")

    def name(self) -> str:
        return self.label or self.describe()


@dataclass
class Suite:
    """A suite's model and methods; ``suite_class()`` adds one optional section per registered task."""

    model: str = option(help="saved model folder, a name rope-extend ships (bundled), or a hub name")
    methods: list[MethodSpec] = option(help="the scalings to compare, e.g. [{method: none}, {method: yarn, factor: 4}]")
    tokenizer: str | None = option(None, help="tokenizer folder or name (default: the model's)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option("auto", help="weights dtype")
    device: str | None = option(None, help="e.g. cuda, cuda:1, cpu (default: where the model loads)")
    trust_remote_code: bool = option(False, help="run the model repository's own code (off by default)")
    title: str | None = option(None, help="report title")
    out: str | None = option(None, help="report folder (default: runs/<suite name>)")
    path: str | None = option(None, help="the suite file", internal=True)

    def __post_init__(self):
        if not self.methods:
            raise RopeExtendError("methods must list at least one method (e.g. [{method: none}])")
        names = [m.name() for m in self.methods]
        if len(set(names)) != len(names):
            raise RopeExtendError(f"two methods have the same label ({names}); give them distinct `label`s")
        if not self.tasks():
            raise RopeExtendError(f"no task: give at least one of {', '.join(t.name for t in tasks())}")

    def tasks(self) -> list[tuple[Task, Any]]:
        """(task, options) for each task section the suite has, in registration order."""
        return [(t, getattr(self, t.name, None)) for t in tasks() if getattr(self, t.name, None) is not None]


_CLASSES: dict[tuple, type] = {}


def suite_class() -> type[Suite]:
    """``Suite`` with an optional section per registered task (``passkey: PasskeyOptions | None``, ...),
    built once per set of tasks: a task registered later is a suite section at once."""
    registered = tuple(tasks())
    key = tuple((t.name, t.options) for t in registered)
    if key not in _CLASSES:
        fields = [(t.name, t.options | None, option(None, help=t.help)) for t in registered]
        cls = make_dataclass("Suite", fields, bases=(Suite,), kw_only=True)
        cls.__module__ = __name__
        _CLASSES[key] = cls
    return _CLASSES[key]


def make_suite(**values) -> Suite:
    """A suite from Python: ``make_suite(model=..., methods=[...], passkey=PasskeyOptions(...))``."""
    suite = suite_class()(**values)
    for method in suite.methods:
        method.read_params_from(suite.path)
    return suite


def parse_suite(data: Any, *, path: str | Path | None = None, overrides: Sequence[str] = ()) -> Suite:
    """Check a suite mapping (after ``overrides``) and build the ``Suite``."""
    where = str(path) if path else "the suite"
    data = {} if data is None else data
    if isinstance(data, dict):
        data = schema.merge(data, schema.parse_overrides(list(overrides)))
    suite = schema.build(suite_class(), data, where=where)
    suite.path = str(path) if path else None
    for method in suite.methods:
        method.read_params_from(suite.path)
    return suite


def load_suite(path: str | Path, overrides: Sequence[str] = ()) -> Suite:
    """A suite file, or the name of a shipped suite (``smoke``)."""
    path = resources.find_suite(path)
    return parse_suite(read_yaml(path, what="suite"), path=path, overrides=overrides)


@overload
def resolve_path(suite: Suite, value: str) -> str: ...
@overload
def resolve_path(suite: Suite, value: None) -> None: ...
@overload
def resolve_path(suite: Suite, value: str | None) -> str | None: ...


def resolve_path(suite: Suite, value: str | None) -> str | None:
    """A relative path in a suite is relative to the suite file when it exists there (else left as is)."""
    return resources.beside(suite.path, value)


def default_out(suite: Suite) -> Path:
    if suite.out:
        return Path(suite.out)
    return Path("runs") / (Path(suite.path).stem if suite.path else "suite")
