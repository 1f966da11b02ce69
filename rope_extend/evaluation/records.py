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
import stat
import warnings
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from .. import untrusted
from ..errors import RopeExtendBaseError, RopeExtendError, shown
from ..hf.reading import config_scaling, scaled_layer_types, text_config
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


def scaling_in_force(model):
    """The scaling ``model`` runs and where it comes from: ``(scaling, "patch")`` for a rope-extend patch,
    ``(scaling, "config")`` for the scaling its config names (a fine-tune's; a shipped ``longrope`` that
    ``shipped_switch`` runs with rope-extend's own counts as the config's), ``(None, "config")`` for none."""
    # here, not at the top: patching imports transformers, and the task modules (which the command line's parser
    # imports for their options) import this module
    from ..patching import patched
    from ..shipped_switch import config_run

    shipped = config_run(model)  # the config's longrope, run with its cached keys turned
    if shipped is not None:
        return shipped, "config"
    scaling = patched(model)
    return (scaling, "patch") if scaling is not None else (_config_scaling(model), "config")


def run_info(model, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """What identifies the model under test: its name, the digest of its weights and config
    (``identity.model_digest``: the name alone is what the user typed, and two models can share it), the
    rope-extend version, and the rope-extend scaling applied; with no patch, the scaling its config names
    (``scaling_from: config``: a fine-tuned or shipped scaling), else ``none``."""
    if is_engine(model):  # a served file: its digest and the engine name it
        return {**model.info(), **(extra or {})}
    scaling, source = scaling_in_force(model)
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


# ------------------------------------------------------------------------------------------ the record schema
# What each field a harness writes may hold: its type and its range, in words (the error says it) and as a
# check. A field not named here (a toy task's own) is not checked. A value outside its range is an edited or
# damaged record just as a wrong type is: counted, it would pass off a wrong number ("correct": "false" is
# truthy; a negative token count turns a perplexity of 2.32 into 0.43), so it is refused, never reused.
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_from(low: int):
    return lambda v: _is_int(v) and v >= low


def _finite(low: float, high: float = math.inf, *, above: bool = False):
    """A finite number in ``[low, high]`` (``(low, high]`` with ``above``): NaN and infinities are never in range."""
    return lambda v: _is_num(v) and math.isfinite(v) and (v > low if above else v >= low) and v <= high


def _or_null(check):
    return lambda v: v is None or check(v)


_STR, _COUNT, _POSITIVE, _FRACTION = "a string", "an integer >= 0", "an integer >= 1", "a number in [0, 1]"
_NONNEG, _NULL = "a finite number >= 0", " or null"
KINDS: dict[str, Callable[[Any], bool]] = {
    _STR: lambda v: isinstance(v, str),
    _COUNT: _int_from(0),
    _POSITIVE: _int_from(1),
    _FRACTION: _finite(0.0, 1.0),
    _NONNEG: _finite(0.0),
    "a finite number >= 1": _finite(1.0),
    "a finite number > 0": _finite(0.0, above=True),
    _POSITIVE + _NULL: _or_null(_int_from(1)),
    _FRACTION + _NULL: _or_null(_finite(0.0, 1.0)),
    _STR + _NULL: lambda v: v is None or isinstance(v, str),
    "true or false": lambda v: isinstance(v, bool),
    "a mapping": lambda v: isinstance(v, dict),
    "a list of strings": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "an integer or a string": lambda v: _is_int(v) or isinstance(v, str),
    "an integer, a string or null": lambda v: v is None or _is_int(v) or isinstance(v, str),
}
FIELD_TYPES: dict[str, str] = {
    **dict.fromkeys(("task", "setting", "model", "method", "model_digest", "rope_extend", "scaling_from"), _STR),
    **dict.fromkeys(("tokenizer_digest", "engine", "label", "output", "text", "ruler_task"), _STR),
    **dict.fromkeys(("length", "task_version", "prompt_tokens", "max_new_tokens", "tokens"), _POSITIVE),
    **dict.fromkeys(("trial", "doc", "sample", "units", "pad_tokens"), _COUNT),  # indices and counts
    **dict.fromkeys(("score", "depth", "actual_depth"), _FRACTION),  # a share of the answers; a place in the prompt
    **dict.fromkeys(("seconds", "cpu_seconds", "nll"), _NONNEG),  # a token's NLL is -log p >= 0
    "perplexity": "a finite number >= 1",  # exp(NLL / tokens) with NLL >= 0
    "factor": "a finite number > 0",
    "original_length": _POSITIVE + _NULL,
    "stride": _POSITIVE + _NULL,
    "depth_grid": _FRACTION + _NULL,
    "haystack": _STR + _NULL,
    "correct": "true or false",
    "params": "a mapping",
    "answers": "a list of strings",
    "answer": "an integer or a string",
    "prediction": "an integer, a string or null",
}


def _relations(record: dict) -> str | None:
    """What two fields of one record must agree on (each harness computes one from the other), or None."""
    if all(isinstance(record.get(k), (int, float)) for k in ("nll", "tokens", "perplexity")):
        try:
            expected = math.exp(record["nll"] / record["tokens"])
        except OverflowError:
            expected = math.inf
        if not math.isclose(record["perplexity"], expected, rel_tol=1e-9):
            return f"'perplexity' {record['perplexity']!r} is not exp(nll / tokens) = {expected:.6g}"
    if "score" in record and "correct" in record and record["correct"] != (record["score"] == 1.0):
        return f"'correct' {record['correct']!r} does not follow its 'score' {record['score']!r} (correct means 1)"
    return None


def check_record(record: Any, where: str) -> dict:
    """``record`` if it is a rope-extend record whose fields hold what they may (``FIELD_TYPES``: type and range;
    ``_relations``), else a RopeExtendError naming ``where`` (the file and line), the field, the value and what
    is allowed. The one check of a record: every reader (a resumed run, ``--records-from``) and the writer use it."""
    if not isinstance(record, dict) or "setting" not in record or "task" not in record:
        raise RopeExtendError(f"{where}: not a rope-extend record (no task or setting): {shown(record, 80)}")
    repair = "an edited or damaged record is not counted; remove or repair that line"
    for name, value in record.items():
        kind = FIELD_TYPES.get(name)
        if kind is not None and not KINDS[kind](value):
            raise RopeExtendError(f"{where}: the record's {name!r} must be {kind}, got {shown(value, 60)}: {repair}")
    problem = _relations(record)
    if problem is not None:
        raise RopeExtendError(f"{where}: the record's {problem}: {repair}")
    return record


MAX_BYTES = 1 << 30  # a records file rope-extend writes: about 1 kB a record, so a million records fit
_CUT = object()  # a line that is not JSON: cut short by an interrupted write


def _log_size(path: Path) -> int:
    """The size of the records file ``path`` (0 when there is none yet), after checking that it is a plain file:
    a folder, a link (appending through it would write into whatever it points at) or a device there is refused."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return 0
    except OSError as exc:
        raise RopeExtendError(f"{path} cannot be read ({exc.strerror}): give a readable output folder") from None
    if stat.S_ISLNK(st.st_mode):
        raise RopeExtendError(
            f"{path} is a symbolic link: records are appended only to a plain file that rope-extend wrote (never "
            "through a link); remove the link or give another output folder"
        )
    what = untrusted.entry_kind(st.st_mode)
    if what is not None:
        raise RopeExtendError(
            f"{path} is {what}: it must be the records file rope-extend wrote (or absent); move it away or give "
            "another output folder"
        )
    return st.st_size


def check_records_file(path: str | os.PathLike, *, resume: bool) -> list[dict]:
    """What a command checks before it loads a model: the records file it will append to (``OUT/records.jsonl``)
    is absent or a plain file (``_log_size``), and with ``resume`` every record in it is read and checked now
    (``check_record``), so that a damaged file fails in one line before minutes of loading and measuring.
    Returns those records."""
    if resume:
        return RecordLog(path, resume=True).records
    _log_size(Path(path))
    return []


class RecordLog:
    """An append-only JSONL file of records, keyed for resuming; ``path=None`` keeps records in memory only.

    ``resume=False`` on a file that already holds records is an error (nothing already written is lost).
    """

    def __init__(self, path: str | os.PathLike | None, *, resume: bool = False):
        self.path = Path(path) if path is not None else None
        self.records: list[dict] = []
        # a run killed mid-write leaves a line without its newline: start the next record on a fresh line
        self._newline = False
        if self.path is not None and _log_size(self.path) > 0:
            if not resume:
                raise RopeExtendError(
                    f"{self.path} already holds results of an earlier run; pass resume=True (--resume) to continue "
                    "it, or write to another output folder"
                )
            self.records = self._read(self.path, follow_links=False)  # the file this run appends to
            with untrusted.open_regular(self.path, follow_links=False) as f:
                f.seek(-1, os.SEEK_END)
                self._newline = f.read(1) != b"\n"

    @staticmethod
    def _read(path: Path, *, follow_links: bool) -> list[dict]:
        """The records of a JSONL file (a regular file of at most ``MAX_BYTES``, UTF-8: ``untrusted``), each
        checked (``check_record``); a line that is not JSON (one cut short by an interruption) is skipped, so that
        its record is simply measured again. ``follow_links``: off for the file a run appends to (``_log_size``)."""
        fix = "give a records.jsonl or results.json that rope-extend wrote"
        text = untrusted.read_text(path, limit=MAX_BYTES, follow_links=follow_links, fix=fix)
        records = []
        for number, line in enumerate(text.split("\n"), 1):
            line = line.strip()
            if not line:
                continue
            # cut short: skipped, that record is simply redone; nested past any record, or a huge number: made
            record = untrusted.decode_json(line, f"{path}:{number}", fix="remove that line", invalid=_CUT)
            if record is not _CUT:
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
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            line = json.dumps(record, default=str)
            # checked as a resumed run will read it: a harness never writes a record that would then be refused
            check_record(json.loads(line), f"{self.path}: the record to append")
            _log_size(self.path)  # still a plain file (not replaced by a folder or a link meanwhile)
            # O_NOFOLLOW: a link put there after that check is refused by the kernel, not written through
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
            try:
                fd = os.open(self.path, flags, 0o644)
            except OSError as exc:
                raise RopeExtendError(f"{self.path} cannot be appended to ({exc.strerror})") from None
            with os.fdopen(fd, "a", encoding="utf-8") as f:
                f.write(("\n" if self._newline else "") + line + "\n")
                self._newline = False
                f.flush()
                os.fsync(f.fileno())
        self.records.append(record)
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
        return RecordLog._read(path, follow_links=True)  # a user's source: a link to a run's records is fine
    data = untrusted.read_json(path, limit=MAX_BYTES, fix="give a results.json that rope-extend wrote")
    records = data.get("records") if isinstance(data, dict) else None
    if not isinstance(records, list):
        raise RopeExtendError(f"{path} has no list of records: give a results.json that rope-extend wrote")
    return [check_record(r, f"{path}: records[{i}]") for i, r in enumerate(records)]


def earlier_records(sources: Collection[str | os.PathLike]) -> list[dict]:
    """The records of every source (see ``read_records``), read and checked: a command reads them before it
    loads a model, so that a bad source fails first, and hands them to ``import_records`` once it writes.

    A source whose records lack ``model_digest`` (written before a record's setting named the model's weights,
    config and dtype) is said so in a warning: no run reuses such a record, whatever model it measures, so its
    trials are measured again rather than silently not reused."""
    found: list[dict] = []
    for source in sources:
        records = read_records(source)
        unnamed = sum("model_digest" not in record for record in records)
        if unnamed:
            warnings.warn(
                f"{source}: {unnamed} of {len(records)} records were written before a record named its model's "
                "digest; they are kept with this run's records but never reused, so their trials and documents "
                "are measured again",
                stacklevel=2,
            )
        found += records
    return found


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
