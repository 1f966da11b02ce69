"""The task interface and registry (see the package docstring); imports neither torch nor transformers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ...documents import SampleBy
from ...errors import RopeExtendError
from ...registry import Registry
from ...schema import option
from ..data import default_texts, load_texts, parse_depths, parse_lengths

Summary = dict[str, list[dict]]

WINDOW_HELP = (
    "sliding-window attention: auto widens a window every layer uses, keeps interleaved local layers; "
    "full widens all; keep none"
)


@dataclass
class Context:
    """What a task's ``run`` gets besides the model and its options."""

    texts: list[str] | None = None  # the documents, for options that subclass TextOptions
    records: str | Path | None = None  # the JSONL file every record is appended to
    resume: bool = True  # skip the trials already in ``records``
    progress: bool = True  # progress bars
    run: dict[str, Any] = field(default_factory=dict)  # fields added to every record (the label)

    def common(self) -> dict[str, Any]:
        """The keywords every harness takes from the run (``records``, ``resume``, ``progress``, ``run``)."""
        return {"records": self.records, "resume": self.resume, "progress": self.progress, "run": self.run}


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


# the tasks, in registration order (the order of the report's sections); a name is a suite key and a command
TASKS: Registry[Task] = Registry("evaluation task", reserved=RESERVED, identifiers=True)


def register_task(task: Task) -> Task:
    """Add ``task``; its name must be new, a Python identifier (a suite key), and not one of ``RESERVED``."""
    return TASKS.register(task)


def unregister_task(name: str) -> None:
    """Remove a task (a test's toy task)."""
    TASKS.unregister(name)


def tasks() -> list[Task]:
    """The registered tasks, in registration order (the order of the report's sections)."""
    return TASKS.values()


def get_task(name: str) -> Task:
    """The task called ``name``; an unknown name raises, naming the closest known one and all of them."""
    return TASKS.get(name)


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


def harness_options(options, *, unset: tuple[str, ...] = ()) -> dict[str, Any]:
    """``options`` as the harness's keywords: the fields of ``TextOptions`` left out (the harness gets the
    texts themselves), and those named in ``unset`` left out while None (the harness's default applies)."""
    text_fields = {f.name for f in fields(TextOptions)} if isinstance(options, TextOptions) else set()
    return {
        f.name: getattr(options, f.name)
        for f in fields(options)
        if f.name not in text_fields and not (f.name in unset and getattr(options, f.name) is None)
    }


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
