"""Which method each engine can serve: exported, exported only on request (``approximate``), or refused.

The rules every engine shares are here; what one engine does differently is in its own module
(``targets/``, ``ExportTarget.decide``). A refusal names the method, the engine, what the engine lacks and the
nearest choice that exports. The
``table`` below is what the README's serving table is generated from (a test keeps them equal).
"""

from __future__ import annotations

from ..methods import registry
from ..methods.resolved import Scaling, resolve
from .forms import static_form
from .targets import TARGETS
from .targets.base import APPROXIMATE, EXPORTED, REFUSED, Decision, yarn_like

__all__ = ["APPROXIMATE", "EXPORTED", "REFUSED", "TARGETS", "Decision", "check_target", "decide", "table"]


def check_target(target: str) -> str:
    """``target`` if it is a registered export target (importing its module), else a refusal naming the closest."""
    TARGETS.get(target)
    return target


def _attention(scaling: Scaling) -> Decision:
    """An attention method where the engine has not said otherwise: refused (plain frequencies, positions
    changed inside attention, which no engine config can say), in the words the method declares
    (``Method.engine_lacks``, ``Method.engine_instead``)."""
    method = scaling.method
    lacks = method.engine_lacks or "it has no attention that changes positions per query and key"
    return Decision(REFUSED, None, lacks, method.engine_instead or yarn_like(scaling))


def decide(scaling: Scaling | None, target: str, dim: int, base: float) -> Decision:
    """How ``target`` serves ``scaling`` for a rotary dimension ``dim`` and base ``base``: log-n refused by every
    engine, then the target's own rules (``ExportTarget.decide``), then the ones every engine shares."""
    engine = TARGETS.get(target)
    if scaling is not None and scaling.logn:
        return Decision(
            REFUSED,
            None,
            "log-n multiplies each query by log_L(position), which no engine config can say",
            f"{scaling.method.name} without logn",
        )
    attention = scaling is not None and scaling.method.attention
    form = None if attention else static_form(scaling, dim, base)
    own = engine.decide(scaling, form, base)
    if own is not None:
        return own
    if scaling is not None and scaling.method.attention:
        return _attention(scaling)
    if form is None:
        return Decision(REFUSED, None, "no engine knows this method", "yarn")
    if form.changes:
        return Decision(APPROXIMATE, form, form.changes)
    return Decision(EXPORTED, form)


# ----------------------------------------------------------------------------------------------- the table
EXAMPLES = {  # a parameter set for each method whose defaults cannot stand alone
    "longrope": {"short_factor": [1.0] * 32, "long_factor": [2.0] * 32},
}


def table(dim: int = 64, base: float = 10000.0, length: int = 4096) -> list[tuple[str, dict[str, str]]]:
    """``[(method, {target: status}), ...]`` for every registered method at factor 4 (the README's table)."""
    rows = []
    for name in ["none", *registry.names()]:
        if name == "none":
            scaling = None
        else:
            method = registry.get(name)
            scaling = resolve(
                method,
                factor=None if method.attention else 4.0,
                original_max_position_embeddings=length,
                params=EXAMPLES.get(name, {}),
            )
        rows.append((name, {t: decide(scaling, t, dim, base).status for t in TARGETS}))
    return rows


def markdown_table() -> str:
    head = "| method | " + " | ".join(TARGETS) + " |\n|---|" + "---|" * len(TARGETS)
    lines = [f"| {name} | " + " | ".join(row[t] for t in TARGETS) + " |" for name, row in table()]
    return "\n".join([head, *lines])
