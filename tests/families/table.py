"""The families table (docs/methods.md links it): each RoPE family of the installed transformers x each method.

    python -m tests.families.table > eval/reports/families.md

A cell is ``exact`` when ``patch`` accepts the method (tests/families asserts, for every such cell, the
frequencies against the pure math and save/reload for the frequency methods; for the attention methods the
logits are checked here too, against the explicit-position reference), ``refused`` with a numbered reason
otherwise. The families whose tiny model cannot be built here are listed with the reason.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings

import transformers

import rope_extend
from tests.families.test_attention_families import LOGN
from tests.families.test_attention_families import METHODS as ATTENTION
from tests.families.test_attention_families import _outcome as attention_outcome
from tests.families.test_frequency_families import FACTOR, L, _params
from tests.families.test_frequency_families import METHODS as FREQUENCY
from tests.families.tiny import build, rope_families


def outcomes(families):
    """Per family: the frequency methods as ``test_frequency_families`` patches them (``L`` = 16, factor 2),
    the attention methods through ``test_attention_families._outcome`` (the explicit reference included)."""
    for model_type in families:
        try:
            model = build(model_type)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            yield model_type, None, str(exc).splitlines()[0][:120]
            continue
        row = {}
        for method in FREQUENCY:
            try:
                rope_extend.patch(
                    model, method, factor=FACTOR, original_max_position_embeddings=L, **_params(method, model)
                )
                row[method] = ("exact", None)
                rope_extend.unpatch(model)
            except rope_extend.RopeExtendException as exc:
                row[method] = ("refused", str(exc))
        for method in ATTENTION:
            kind, detail = attention_outcome(model_type, method)
            if kind.startswith("exact") and detail >= 2e-4:
                kind = f"MISMATCH {detail:.2g}"  # the test fails too
            row[method] = (kind, detail if kind == "refused" else None)
        yield model_type, row, None


def _reason(message: str, model_type: str, method: str) -> str:
    """The refusal without the family and method in front, and with the method named generically."""
    reason = message.split(f"{model_type}: cannot apply {method!r}: ", 1)[-1]
    if "requires" in reason:  # a family that allows one rope type: one reason for every method
        types = "linear|yarn|dynamic_ntk|llama3|longrope|self_extend|dual_chunk|rerope|string"
        reason = re.sub(rf"\b({types})\b", "<the method's type>", reason)
    return reason


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    transformers.logging.set_verbosity_error()
    methods = (*FREQUENCY, *ATTENTION)
    reasons: dict[str, int] = {}
    lines = [
        "",  # the summary, once counted
        "",
        "| family | " + " | ".join(methods) + " |",
        "|---" * (len(methods) + 1) + "|",
    ]
    counts = {"exact": 0, "refused": 0, "unbuilt": 0, "mismatch": 0}
    unbuilt = []
    families = rope_families()
    for model_type, row, why in outcomes(families):
        if row is None:
            unbuilt.append(f"- {model_type}: {why}")
            counts["unbuilt"] += 1
            continue
        cells = []
        for method in methods:
            kind, message = row[method]
            if kind == "refused":
                counts["refused"] += 1
                label = LOGN if method == "logn" else method
                number = reasons.setdefault(_reason(message, model_type, label), len(reasons) + 1)
                cells.append(f"refused [{number}]")
            else:
                counts["exact" if kind.startswith("exact") else "mismatch"] += 1
                cells.append("exact\\*" if kind == "exact at its reach" else kind)
        lines.append(f"| {model_type} | " + " | ".join(cells) + " |")
    lines[0] = (
        f"transformers {transformers.__version__}: {len(families)} RoPE families; {counts['exact']} family x method "
        f"cells exact, {counts['refused']} refused, {counts['mismatch']} mismatched; {counts['unbuilt']} families "
        "not built here.\n\nexact\\*: the family's config ships a scaling, which the attention method replaces; it is "
        "exact with `target_length` at the method's reach (without it, the method is refused: it would shorten the "
        "shipped context)."
    )
    lines += ["", "Refusals:", ""] + [f"{n}. {reason}" for reason, n in reasons.items()]
    if unbuilt:
        lines += ["", "Not built here:", ""] + unbuilt
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
