"""The ``passkey`` task: passkey retrieval per length (and per depth); the harness is
``evaluation.passkey``."""

from __future__ import annotations

from pathlib import Path

from . import _retrieval, base
from .options import PasskeyOptions


def run(model, tokenizer, options: PasskeyOptions, context: base.Context) -> list[dict]:
    from ..passkey import passkey

    return passkey(model, tokenizer, options=options, **context.common()).records


def plot(summary: dict, out: Path) -> dict[str, Path]:
    from .. import report

    files = _retrieval.heatmaps(summary, out, "passkey", "Passkey")
    if summary.get("passkey"):
        files["passkey_plot"] = report.plot_lines(
            summary["passkey"], "accuracy", out / "passkey.png", title="Passkey retrieval", ylabel="accuracy (%)"
        )
    return files


TASK = base.Task(
    name="passkey",
    help="passkey retrieval accuracy per length (and depth)",
    title="Passkey retrieval",
    options=PasskeyOptions,
    run=run,
    summarize=lambda records: _retrieval.summarize("passkey", records),
    render=lambda summary: _retrieval.render(summary, "passkey", "Passkey retrieval accuracy", context=True),
    plot=plot,
)
