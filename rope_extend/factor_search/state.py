"""The search's saved state, read back as hostile: every field checked before a resume uses it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import untrusted
from ..errors import RopeExtendError

MAX_STATE = 64 << 20  # bytes of a saved state: a pool and history of thousands of evaluations fit in a few MiB
# settings a state written before they were recorded was searched with (so such a search still resumes)
LEGACY_SETTINGS = {"fitness": "text", "space": "longrope", "critical_pair": None}


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _factors(x, size: int) -> bool:
    return isinstance(x, list) and len(x) == size and all(_number(v) for v in x)


def _state_problem(state, size: int) -> str | None:
    """What is wrong with the shape of a saved state (field by field, as ``_Run.state`` writes it), or None."""
    if not isinstance(state, dict):
        return f"the state is a JSON {type(state).__name__}, not an object"
    for key in ("settings", "rng", "pool", "history", "seeds"):
        if key not in state:
            return f"it has no {key!r}"
    if not isinstance(state["settings"], dict):
        return "'settings' is not an object"
    rng = state["rng"]
    if not (
        isinstance(rng, list)
        and len(rng) == 3
        and isinstance(rng[0], int)
        and isinstance(rng[1], list)
        and len(rng[1]) == 625  # Mersenne Twister: 624 words and the position
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32 for v in rng[1])
        and (rng[2] is None or _number(rng[2]))
    ):
        return "'rng' is not a random generator's state [version, 625 integers, gauss]"
    pool = state["pool"]
    if not isinstance(pool, list) or not all(
        isinstance(e, list) and len(e) == 2 and _factors(e[0], size) and _number(e[1]) for e in pool
    ):
        return f"'pool' is not a list of [{size} factors, fitness]"
    history = state["history"]
    if not isinstance(history, list) or not all(
        isinstance(e, list) and len(e) == 3 and all(map(_number, e)) for e in history
    ):
        return "'history' is not a list of [evaluation, fitness, best]"
    if not isinstance(state["seeds"], dict) or not all(map(_number, state["seeds"].values())):
        return "'seeds' is not an object of fitnesses"
    candidates = state.get("seed_candidates", {})
    if not isinstance(candidates, dict) or not all(_factors(c, size) for c in candidates.values()):
        return f"'seed_candidates' is not an object of {size} factors each"
    pending = state.get("pending", [])
    if not isinstance(pending, list) or not all(_factors(c, size) for c in pending):
        return f"'pending' is not a list of {size} factors each"
    return None


def read_state(path: Path, size: int) -> dict[str, Any]:
    """The state saved at ``path``, checked field by field; a damaged one (truncated, empty, not UTF-8, not
    JSON, or of another shape) is refused in one line naming the file. It is read as hostile (``untrusted``):
    a regular file of at most ``MAX_STATE`` bytes, not through a link (the search wrote it there)."""
    fix = "start the search again into a new --out, or with --overwrite"
    name = f"resume: the search state {path}"
    state = untrusted.read_json(path, limit=MAX_STATE, name=name, follow_links=False, fix=fix)
    problem = _state_problem(state, size)
    if problem is None:
        state["settings"] = {**LEGACY_SETTINGS, **state["settings"]}
        return state
    raise RopeExtendError(f"resume: the search state {path} is damaged: {problem}; {fix}")
