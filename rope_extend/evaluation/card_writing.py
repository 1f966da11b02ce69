"""The card's writing: card.md (``markdown``: one table by length and backend, the effective lengths, retention,
agreement) and card.png (``figure``), from the dict ``evaluation.card`` builds (what card.json holds)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..io import writing
from .card_measurements import ANSWER_SHARE
from .report import _pyplot
from .ruler.subtasks import GENERATE

# what each backend's numbers are called in the card's table and figure (one mapping for both)
SERVED = {"llama.cpp": ("GGUF", "llama.cpp"), "vllm": ("vLLM", "vLLM")}  # engine: (its export, its name)
SHOWN = {"original": "original", "transformers": "patched", **{k: f"served in {v}" for k, (_, v) in SERVED.items()}}
CONFIGURED = "as configured"  # the transformers column of a model measured with the scaling its config ships


def _configured(card: dict[str, Any]) -> bool:
    """A model measured as configured (``scaling_from: config``: a fine-tune, a model that ships its scaling) is no
    patch; a card.json without the field is a patch's."""
    return card.get("scaling_from") == "config"


def _shown(card: dict[str, Any]) -> dict[str, str]:
    """``SHOWN`` for this card: the column of a model measured as configured says so."""
    return {**SHOWN, "transformers": CONFIGURED} if _configured(card) else SHOWN


def _title(card: dict[str, Any]) -> str:
    return f"{card['scaling']}{', from the config' if _configured(card) else ''}"


def _pct(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def _ruler_what(card: dict[str, Any]) -> str:
    """What the RULER column averages: its tasks, counted and named, and why it is not RULER's own number."""
    tasks = card.get("ruler_tasks")
    if tasks is None:  # a card.json written before the plan named its tasks
        tasks = [None] * card["backends"]["transformers"]["ruler_tasks"]
    if not tasks:
        return "not measured (see what is left out)"
    names = f": {', '.join(tasks)}" if all(tasks) else ""
    budgets = card.get("answer_tokens") or {}
    capped = sorted({n for t, n in budgets.items() if n < GENERATE[t]})
    if card["options"].get("answer_tokens") is not None:
        budget = f"; {card['options']['answer_tokens']} answer tokens for every task (--answer-tokens)"
    elif capped:
        budget = (
            f"; answer tokens: RULER's per task, capped at L/{ANSWER_SHARE} = {capped[-1]} (RULER's own budgets, up "
            "to 128, are for contexts of 4k and more)"
        )
    else:
        budget = ""
    return (
        f"average over {len(tasks)} {'task' if len(tasks) == 1 else 'tasks'}{names} "
        f"({card['options']['samples']} samples each{budget}; RULER's own average is over 13, so the numbers are "
        "not comparable with its tables)"
    )


def markdown(card: dict[str, Any]) -> str:
    """The model-card block: one table by length (each backend), effective lengths, retention, agreement."""
    b = card["backends"]
    shown = _shown(card)
    names = [n for n in shown if n in b]
    head = ["length"] + [f"{what} ({shown[n]})" for n in names for what in ("RULER", "passkey", "ppl")]
    lines = [
        f"### Long context: {card['model']}, {_title(card)}",
        "",
        (
            f"Trained context L = {card['original_length']}, target {card['target_length']}. RULER: {_ruler_what(card)}; "
            f"passkey: {card['options']['trials']} trials (95% Wilson interval); perplexity: token-weighted."
        ),
        "",
        *(["Left out (decided before measuring):", ""] if card.get("left_out") else []),
        *(f"- {line}" for line in card.get("left_out", ())),
        *([""] if card.get("left_out") else []),
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for n in card["lengths"]:
        row = [str(n)]
        for name in names:
            x = b[name]
            lo_hi = x["passkey_interval"].get(str(n)) or x["passkey_interval"].get(n)
            pk = x["passkey"].get(str(n), x["passkey"].get(n))
            row += [
                _pct(x["ruler"].get(str(n), x["ruler"].get(n))),
                "-" if pk is None else f"{100 * pk:.0f}% ({100 * lo_hi[0]:.0f}-{100 * lo_hi[1]:.0f})",
                "-" if (p := x["perplexity"].get(str(n), x["perplexity"].get(n))) is None else f"{p:.3f}",
            ]
        lines.append("| " + " | ".join(row) + " |")
    eff = b["transformers"].get("effective") or {}
    lines += [
        "",
        (
            f"Effective length (RULER's rule, average >= {eff.get('threshold')}): {eff.get('length') or 'none'}; "
            f"keeping {eff.get('keep')} of the score at {eff.get('reference_length')}: {eff.get('relative_length') or 'none'}."
            if eff
            else "Effective length: not measured (no RULER task was measured)."
        ),
        "",
        "| retention inside L | ratio | 95% interval | examples |",
        "|---|---|---|---|",
    ]
    for k, v in card["retention"].items():
        if "undefined" in v:
            lines.append(f"| {k} | undefined: {v['undefined']} | - | - |")
        else:
            lines.append(f"| {k} | {v['ratio']:.3f} | {v['low']:.3f}-{v['high']:.3f} | {v['examples']} |")
    served = card.get("served")
    if served and "engine" in served:
        a = card["agreement"]
        lines += [
            "",
            f"Served: the {SERVED[served['engine']][0]} export ({served['how']}) in {SERVED[served['engine']][1]}, "
            "the same prompts at "
            f"{', '.join(str(n) for n in served.get('lengths', card['lengths']))}: perplexity within "
            f"{100 * a['perplexity_rel_diff']:.3f}%, passkey within {100 * a['passkey_abs_diff']:.0f} points, RULER "
            f"within {100 * a['ruler_abs_diff']:.1f} points of transformers: "
            + ("agrees." if a["agree"] else "DOES NOT AGREE within the stated limits."),
        ]
    elif served:
        lines += ["", f"Served: not measured ({served['skipped']})."]
    hw = card["hardware"]
    lines += ["", f"Measured in {card['seconds']:.0f} s on {hw.get('gpu') or hw['cpu']} ({hw['cores']} cores)."]
    return "\n".join(lines) + "\n"


def figure(card: dict[str, Any], path: Path) -> list[str]:
    """RULER average, passkey accuracy and perplexity by length, one line per backend, named as the table's
    columns name it (``SHOWN``: original, patched or as configured, served in llama.cpp) in one legend for the
    three panels (a backend a panel lacks, such as the original's RULER when RULER starts past L, is still named).
    Returns the legend's names."""

    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    shown = _shown(card)
    colors = {name: f"C{i}" for i, name in enumerate(shown)}
    handles: dict[str, Any] = {}
    for name, x in card["backends"].items():
        label = shown.get(name, name)
        for ax, key, scale in ((axes[0], "ruler", 1), (axes[1], "passkey", 100), (axes[2], "perplexity", 1)):
            pts = sorted((int(n), v * scale) for n, v in x[key].items())
            if pts:
                (line,) = ax.plot(*zip(*pts, strict=True), marker="o", color=colors.get(name), label=label)
                handles.setdefault(label, line)
    for ax, title in zip(axes, ("RULER average (%)", "passkey (%)", "perplexity"), strict=True):
        ax.set_xscale("log", base=2)
        ax.axvline(card["original_length"], color="grey", linestyle=":", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("tokens")
        if title.endswith("(%)"):
            ax.set_ylim(-5, 105)  # a share: 0 and 100 in sight, so a flat line at 0 is not read as a trend
        if not any(line.get_label() in handles for line in ax.lines):  # only the line at L: nothing measured
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, color="grey")
    fig.legend(handles.values(), handles.keys(), loc="upper right", fontsize=8)
    fig.suptitle(f"{card['model']}: {_title(card)}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    with writing(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return list(handles)
