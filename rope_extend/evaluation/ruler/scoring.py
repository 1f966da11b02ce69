"""RULER's scoring: its post-processing, ``string_match_all`` / ``string_match_part``, a task's score at a length,
and the tables (task -> length -> score, the average over the tasks measured)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ...errors import RopeExtendError
from .subtasks import METRIC, RULER_TASKS


def postprocess(output: str) -> str:
    """RULER's ``postprocess_pred``: strip, control characters to newlines, strip again."""
    return re.sub(r"[\x00-\x1f]", "\n", output.strip()).strip()


def _check_answers(answers: Sequence[str], name: str) -> None:
    if not answers:
        raise RopeExtendError(f"{name} needs at least one expected string")


def string_match_all(output: str, answers: Sequence[str]) -> float:
    """The share of ``answers`` that occur in ``output`` (case-insensitive): RULER's ``string_match_all``."""
    _check_answers(answers, "string_match_all")
    pred = postprocess(output).lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def string_match_part(output: str, answers: Sequence[str]) -> float:
    """1 if any one of ``answers`` occurs in ``output`` (case-insensitive), else 0: RULER's ``string_match_part``
    (its qa tasks', where each reference is an acceptable answer)."""
    _check_answers(answers, "string_match_part")
    pred = postprocess(output).lower()
    return float(any(a.lower() in pred for a in answers))


def score(task: str, output: str, answers: Sequence[str]) -> float:
    """A sample's score in [0, 1] by the task's RULER metric (``METRIC``)."""
    return (string_match_part if METRIC.get(task) == "part" else string_match_all)(output, answers)


def is_empty(output: str) -> bool:
    """RULER's null prediction: nothing left after ``postprocess``."""
    return not postprocess(output)


def task_score(scores: Sequence[float]) -> float:
    """RULER's score of a task at a length: the mean sample score in percent, rounded to 2 decimals."""
    if not scores:
        raise RopeExtendError("task_score needs at least one sample score")
    return round(100 * sum(scores) / len(scores), 2)


def tables(records: Sequence[dict]) -> dict[str, Any]:
    """From RULER records: ``accuracy``, ``scores``, ``empty`` (each task -> length -> value), ``average``
    (length -> the mean of the rounded task scores there, rounded to 2) and ``tasks`` (how many tasks there are).
    A length where some task was not measured gets no average: a mean over fewer tasks is another number."""
    by: dict[str, dict[int, list[dict]]] = {}
    for r in records:
        by.setdefault(r["ruler_task"], {}).setdefault(r["length"], []).append(r)
    accuracy, scores, empty = {}, {}, {}
    for task, lengths in by.items():
        rows = sorted(lengths.items())
        accuracy[task] = {n: sum(float(r["score"]) for r in rs) / len(rs) for n, rs in rows}
        scores[task] = {n: task_score([float(r["score"]) for r in rs]) for n, rs in rows}
        empty[task] = {n: sum(is_empty(r.get("output", "")) for r in rs) for n, rs in rows}
    measured = sorted({n for t in scores.values() for n in t})
    average = {
        n: round(sum(t[n] for t in scores.values()) / len(scores), 2)
        for n in measured
        if all(n in t for t in scores.values())
    }
    return {"accuracy": accuracy, "scores": scores, "empty": empty, "average": average, "tasks": len(scores)}


def average_label(tasks: int) -> str:
    """What an average is over: 'avg over 11 tasks; RULER's is over 13' (never comparable to RULER's own)."""
    word = "task" if tasks == 1 else "tasks"
    return f"avg over {tasks} {word}; RULER's is over {RULER_TASKS}"
