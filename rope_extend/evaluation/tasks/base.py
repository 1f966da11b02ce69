"""The task interface and registry (see the package docstring); imports neither torch nor transformers, nor any
task."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, TypedDict

from ...documents import SampleBy
from ...errors import RopeExtendError, closest
from ...registry import Registry
from ...schema import option
from ..data import default_texts, load_texts, parse_depths, parse_lengths

Summary = dict[str, list[dict]]

WINDOW_HELP = (
    "sliding-window attention: auto widens a window every layer uses, keeps interleaved local layers; "
    "full widens all; keep none"
)


class Common(TypedDict):
    """The keywords every harness takes from the run (see ``Context``), typed for ``**`` unpacking."""

    records: str | Path | None
    resume: bool
    progress: bool
    run: dict[str, Any]


@dataclass
class Context:
    """What a task's ``run`` gets besides the model and its options."""

    texts: list[str] | None = None  # the documents, for options that subclass TextOptions
    records: str | Path | None = None  # the JSONL file every record is appended to
    resume: bool = True  # skip the trials already in ``records``
    progress: bool = True  # progress bars
    run: dict[str, Any] = field(default_factory=dict)  # fields added to every record (the label)

    def documents(self, task: str) -> list[str]:
        """``texts``, checked: a task whose options read texts cannot run on none (a caller that built the
        context without loading them fails here, by name, not inside the harness)."""
        if self.texts is None:
            raise RopeExtendError(f"the {task} task reads texts, but its context holds none (load_task_texts)")
        return self.texts

    def common(self) -> Common:
        """The keywords every harness takes from the run (``records``, ``resume``, ``progress``, ``run``)."""
        return Common(records=self.records, resume=self.resume, progress=self.progress, run=self.run)


def _no_plots(summary: Summary, out: Path) -> dict[str, Path]:
    return {}


@dataclass(frozen=True)
class Task:
    """One evaluation task (see the module docstring)."""

    name: str
    help: str  # one line: the suite section's and the subcommand's help
    title: str  # report title of a single run ("Passkey retrieval")
    options: type
    run: Callable[[Any, Any, Any, Context], list[dict]]
    summarize: Callable[[list[dict]], Summary]
    render: Callable[[Summary], list[str]]
    plot: Callable[[Summary, Path], dict[str, Path]] = _no_plots

    @property
    def reads_texts(self) -> bool:
        return issubclass(self.options, TextOptions)


# ``rope-extend eval compare`` and the keys of a suite besides its tasks
RESERVED = frozenset(
    (
        "compare",
        "model",
        "methods",
        "tokenizer",
        "dtype",
        "device",
        "trust_remote_code",
        "title",
        "out",
        "path",
        "tasks",
    )
)


# the tasks, in registration order (the order of the report's sections); a name is a suite key and a command.
# A task of one's own: ``TASKS.register(Task(...))``; its name must be new, a Python identifier and not one of
# ``RESERVED``. The built-in tasks are one module each, above this package (each holds its options, its harness and
# its ``TASK``, and imports this registry; the registry names them by path only, so it never imports one).
TASKS: Registry[Task] = Registry("evaluation task", reserved=RESERVED, identifiers=True)
for _name, _module in (
    ("passkey", "passkey"),
    ("niah", "niah"),
    ("perplexity", "perplexity"),
    ("ruler", "ruler.harness"),
):
    TASKS.register_lazy(_name, f"rope_extend.evaluation.{_module}:TASK")

# the names callers used before there was one registry: the registry's own methods, not functions wrapping them
register_task = TASKS.register
unregister_task = TASKS.unregister
get_task = TASKS.get
tasks = TASKS.values  # the tasks, in registration order (imported)


# ------------------------------------------------------------------------------------------ shared options
def check_lengths(options) -> None:
    """``lengths`` (and ``depths`` where there are) parsed in place: ``[4k, "8k"]`` -> ``[4096, 8192]``."""
    options.lengths = parse_lengths(options.lengths)
    if getattr(options, "depths", None) is not None:
        options.depths = parse_depths(options.depths)


def check_positive(options, *names: str) -> None:
    for name in names:
        value = getattr(options, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise RopeExtendError(f"{name} must be a positive integer, got {value!r}")


@dataclass(kw_only=True)
class TextOptions:
    """Where a task's texts come from (the one document reader)."""

    data: str | None = option(
        None,
        help="texts: a .txt file, folder, .jsonl, .parquet or a hub dataset (default: the bundled held-out corpus)",
    )
    text_field: str = option("text", help="column holding the text (JSONL, Parquet, datasets)")
    split: str = option("train", help="dataset split (hub datasets)")
    sample_by: SampleBy = option("document", help="a text file is one document, or split by paragraph or line")
    max_docs: int | None = option(None, help="use at most this many documents")


# what reads the texts; a harness takes the texts themselves, so only ``max_docs`` of TextOptions is its
READING = ("data", "text_field", "split", "sample_by")


def options_for(cls: type, options: Any, given: dict[str, Any], *, harness: str) -> Any:
    """The options a harness runs with, declared once, in the task's dataclass ``cls``: ``options`` as passed
    (a task's run), or ``cls(**given)`` from the harness's keywords, with the dataclass's defaults and checks.

    A harness of options that read texts (``TextOptions``) takes the documents themselves, so the fields that
    read them (``READING``) are not its keywords. Unknown or missing keywords, and options given both ways, are
    errors naming ``harness``.
    """
    if options is not None:
        if given:
            raise RopeExtendError(f"{harness}(): give options= or keywords ({', '.join(given)}), not both")
        if not isinstance(options, cls):
            raise RopeExtendError(f"{harness}(): options must be a {cls.__name__}, got {type(options).__name__}")
        return options
    reading = READING if issubclass(cls, TextOptions) else ()
    allowed = [f.name for f in fields(cls) if f.name not in reading]
    unknown = [key for key in given if key not in allowed]
    if unknown:
        near = "".join(closest(key, allowed) for key in unknown)
        raise RopeExtendError(
            f"{harness}(): unknown keyword {', '.join(map(repr, unknown))}{near}; its options ({cls.__name__}): "
            + ", ".join(allowed)
        )
    missing = [
        f.name for f in fields(cls) if f.name not in given and f.default is MISSING and f.default_factory is MISSING
    ]
    if missing:
        raise RopeExtendError(f"{harness}() is missing {', '.join(map(repr, missing))}")
    return cls(**given)


def load_task_texts(options: TextOptions, source: str | None = None) -> list[str]:
    """The documents ``options`` name (``source`` replaces ``options.data``: a path resolved by the caller)."""
    source = options.data if source is None else source
    if source is None:  # the bundled corpus: max_docs holds for it too
        texts = default_texts()
        return texts[: options.max_docs] if options.max_docs is not None else texts
    return load_texts(
        source,
        text_field=options.text_field,
        split=options.split,
        max_docs=options.max_docs,
        sample_by=options.sample_by,
    )
