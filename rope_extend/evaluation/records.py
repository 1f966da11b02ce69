"""Records written as they are produced: one JSON line per trial (passkey, needle) or document (perplexity).

Each line is appended and flushed (and fsynced) at once, so an interrupted run keeps every record it
finished. A resumed run reads the file back and skips the records whose key it already holds; a record
only counts for a run with the same *setting* (the model's digest, method, parameters, protocol options, the
data's digest, the task's version and rope-extend's), so records of other runs stay in the file untouched
and are never reused by mistake.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ..errors import RopeExtendBaseError, RopeExtendError
from ..hf.config import config_scaling, scaled_layer_types, text_config
from ..patching import patched
from ..version import __version__
from .engines import is_engine
from .identity import model_digest


def short_hash(text: str) -> str:
    """The first 12 hex digits of ``text``'s SHA-1: how a record names a setting or the text it was measured on."""
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def setting_id(setting: dict[str, Any]) -> str:
    """A short stable hash of a run's setting (sorted JSON)."""
    return short_hash(json.dumps(setting, sort_keys=True, default=str))


def _config_scaling(model):
    """The scaling the unpatched model's config names (a fine-tuned yarn x4, Llama 3.1's llama3), or None."""
    config = getattr(model, "config", None)
    if config is None or not getattr(text_config(config), "rope_parameters", None):
        return None
    config = text_config(config)
    try:
        return config_scaling(config, (scaled_layer_types(config) or [None])[0])
    except (RopeExtendBaseError, KeyError, TypeError):  # a family's own rope type, or no global rope dict
        return None


def run_info(model, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """What identifies the model under test: its name, the digest of its weights and config
    (``identity.model_digest``: the name alone is what the user typed, and two models can share it), the
    rope-extend version, and the rope-extend scaling applied; with no patch, the scaling its config names
    (``scaling_from: config``: a fine-tuned or shipped scaling), else ``none``."""
    if is_engine(model):  # a served file: its digest and the engine name it
        return {**model.info(), **(extra or {})}
    scaling, source = patched(model), "patch"
    if scaling is None:
        scaling, source = _config_scaling(model), "config"
    info: dict[str, Any] = {
        "model": str(getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__),
        "model_digest": model_digest(model),
        "rope_extend": __version__,
    }
    if scaling is None:
        info.update(method="none", factor=1.0, original_length=None, params={})
    else:
        info.update(
            method=scaling.method.name,
            factor=scaling.factor,
            original_length=scaling.original_max_position_embeddings,
            params=scaling.method.param_dict(scaling.params),
        )
        if source == "config":
            info["scaling_from"] = "config"
    info.update(extra or {})
    return info


_INT, _NUM, _STR = "an integer", "a number", "a string"
_NONE = " or null"
# The type of each field a harness writes; a field not named here (a toy task's own) is not checked. A field
# with another type is an edited or damaged record: counted, it would pass off a wrong number ("correct":
# "false" is truthy), so it is refused.
FIELD_TYPES: dict[str, str] = {
    **dict.fromkeys(("task", "setting", "model", "method", "model_digest", "rope_extend", "scaling_from"), _STR),
    **dict.fromkeys(("label", "output", "text", "ruler_task"), _STR),
    **dict.fromkeys(("length", "trial", "doc", "tokens", "sample", "task_version", "units", "pad_tokens"), _INT),
    **dict.fromkeys(("prompt_tokens",), _INT),
    **dict.fromkeys(("max_new_tokens",), _INT),
    **dict.fromkeys(("factor", "seconds", "cpu_seconds", "score", "depth", "actual_depth", "perplexity"), _NUM),
    "nll": "a finite number",
    "original_length": _INT + _NONE,
    "stride": _INT + _NONE,
    "depth_grid": _NUM + _NONE,
    "haystack": _STR + _NONE,
    "correct": "true or false",
    "params": "a mapping",
    "answers": "a list",
    "answer": "an integer or a string",
    "prediction": "an integer, a string or null",
}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_CHECKS = {
    _STR: lambda v: isinstance(v, str),
    _INT: _is_int,
    _NUM: _is_num,
    _INT + _NONE: lambda v: v is None or _is_int(v),
    _NUM + _NONE: lambda v: v is None or _is_num(v),
    _STR + _NONE: lambda v: v is None or isinstance(v, str),
    "a finite number": lambda v: _is_num(v) and math.isfinite(v),
    "true or false": lambda v: isinstance(v, bool),
    "a mapping": lambda v: isinstance(v, dict),
    "a list": lambda v: isinstance(v, list),
    "an integer or a string": lambda v: _is_int(v) or isinstance(v, str),
    "an integer, a string or null": lambda v: v is None or _is_int(v) or isinstance(v, str),
}


def check_record(record: Any, where: str) -> dict:
    """``record`` if it is a rope-extend record whose fields have their types (``FIELD_TYPES``), else a
    RopeExtendError naming ``where`` (the file and line), the field, the value and the type expected."""
    if not isinstance(record, dict) or "setting" not in record or "task" not in record:
        raise RopeExtendError(f"{where}: not a rope-extend record (no task or setting): {record!r:.80}")
    for name, value in record.items():
        kind = FIELD_TYPES.get(name)
        if kind is not None and not _CHECKS[kind](value):
            raise RopeExtendError(
                f"{where}: the record's {name!r} must be {kind}, got {value!r:.60}: an edited or damaged record "
                "is not counted; remove or repair that line"
            )
    return record


class RecordLog:
    """An append-only JSONL file of records, keyed for resuming; ``path=None`` keeps records in memory only.

    ``resume=False`` on a file that already holds records is an error (nothing already written is lost).
    """

    def __init__(self, path: str | os.PathLike | None, *, resume: bool = False):
        self.path = Path(path) if path is not None else None
        self.records: list[dict] = []
        if self.path is not None and self.path.exists() and self.path.stat().st_size > 0:
            if not resume:
                raise RopeExtendError(
                    f"{self.path} already holds results of an earlier run; pass resume=True (--resume) to continue "
                    "it, or write to another output folder"
                )
            self.records = self._read(self.path)
        # a run killed mid-write leaves a line without its newline: start the next record on a fresh line
        self._newline = (
            self.path is not None
            and self.path.exists()
            and self.path.stat().st_size > 0
            and self.path.read_bytes()[-1:] != b"\n"
        )

    @staticmethod
    def _read(path: Path) -> list[dict]:
        """The records of a JSONL file, each checked (``check_record``); a line that is not JSON (one cut short
        by an interruption) is skipped, so that its record is simply measured again."""
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RopeExtendError(
                f"{path} is not a UTF-8 text file (byte {exc.start}): give a records.jsonl or results.json that "
                "rope-extend wrote"
            ) from None
        records = []
        for number, line in enumerate(text.split("\n"), 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by an interruption: that record is simply redone
            records.append(check_record(record, f"{path}:{number}"))
        return records

    def find(self, key: dict[str, Any], settings: Collection[str] | None = None) -> dict | None:
        """The record whose fields equal ``key``'s (the latest one), or None; ``settings`` also requires the
        record's setting id to be one of them."""
        for record in reversed(self.records):
            if settings is not None and record.get("setting") not in settings:
                continue
            if all(record.get(k) == v for k, v in key.items()):
                return record
        return None

    def add(self, record: dict[str, Any]) -> dict:
        self.records.append(record)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                f.write(("\n" if self._newline else "") + json.dumps(record, default=str) + "\n")
                self._newline = False
                f.flush()
                os.fsync(f.fileno())
        return record


def read_records(path: str | os.PathLike) -> list[dict]:
    """The records of an earlier run: its ``records.jsonl``, a report's ``results.json`` (its ``records``),
    or the folder holding either (records.jsonl first)."""
    path = Path(path)
    if path.is_dir():
        found = [path / name for name in ("records.jsonl", "results.json") if (path / name).is_file()]
        if not found:
            raise RopeExtendError(f"{path} holds neither records.jsonl nor results.json: give a run's folder or file")
        path = found[0]
    if not path.is_file():
        raise RopeExtendError(f"no records at {path}: give a records.jsonl, a results.json or the folder of a run")
    if path.suffix != ".json":
        return RecordLog._read(path)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise RopeExtendError(f"{path} is not a UTF-8 text file (byte {exc.start}): give a results.json") from None
    except json.JSONDecodeError as exc:
        raise RopeExtendError(f"{path} is not a JSON file ({' '.join(str(exc).split())})") from None
    records = data.get("records") if isinstance(data, dict) else None
    if not isinstance(records, list):
        raise RopeExtendError(f"{path} has no list of records: give a results.json that rope-extend wrote")
    return [check_record(r, f"{path}: records[{i}]") for i, r in enumerate(records)]


def earlier_records(sources: Collection[str | os.PathLike]) -> list[dict]:
    """The records of every source (see ``read_records``), read and checked: a command reads them before it
    loads a model, so that a bad source fails first, and hands them to ``import_records`` once it writes."""
    return [record for source in sources for record in read_records(source)]


def import_records(target: str | os.PathLike, records: Collection[dict]) -> int:
    """Append to the records file ``target`` those of ``records`` (``earlier_records``) that it does not hold
    already; returns how many were added. A resumed run then reuses those whose setting is its own, so a run
    can go on from a report committed elsewhere or from another machine's records; the others stay in the
    file unused."""
    log = RecordLog(target, resume=True)
    held = {json.dumps(r, sort_keys=True, default=str) for r in log.records}
    added = 0
    for record in records:
        key = json.dumps(record, sort_keys=True, default=str)
        if key not in held:
            held.add(key)
            log.add(record)
            added += 1
    return added
