"""The bundled testbed: a small Llama that rope-extend pretrains itself at a short context, its tokenizer,
and a held-out corpus of long documents; everything offline.

    from rope_extend import bundled
    model, tokenizer = bundled.load()
    texts = bundled.eval_texts()          # long held-out documents (>= 16x the trained context)
    filler = bundled.unseen_filler()      # prose sentences it never saw, for passkey(..., filler=filler)

``MODEL_DIR`` is the saved model folder (``from_pretrained(bundled.MODEL_DIR)`` works); its config's
``max_position_embeddings`` is the trained context. The model card (``MODEL_DIR / "README.md"``) gives
the command that made it, the data, and the SHA-256 of every file.
"""

from __future__ import annotations

import json
import re

from .. import resources
from ..documents import read_documents
from ..evaluation.prompts import split_sentences
from ..io import sha256
from ..loading import BundledModelMissing, load_model, load_tokenizer
from ..loading import bundled_available as available

MODEL_DIR = resources.BUNDLED_MODEL
DATA_DIR = resources.BUNDLED_EVAL_CORPUS.parent
EVAL_CORPUS = resources.BUNDLED_EVAL_CORPUS
# Original prose written for this package (lighthouses, bread, glaciers, ...): no sentence of it, and none of
# its sentence patterns, is in the training corpus (rope_extend.bundled.corpus makes that corpus from its own
# word lists and templates only), so it is filler the model never saw; it holds no digits.
UNSEEN_PROSE = DATA_DIR / "unseen_prose.txt"

__all__ = [
    "DATA_DIR",
    "EVAL_CORPUS",
    "MODEL_DIR",
    "UNSEEN_PROSE",
    "BundledModelMissing",
    "available",
    "card_checksums",
    "eval_texts",
    "load",
    "sha256",
    "trained_length",
    "unseen_filler",
]


def card_checksums() -> dict[str, str]:
    """``{file name: sha256}`` as listed in the model card's checksum table."""
    card = (MODEL_DIR / "README.md").read_text(encoding="utf-8")
    return dict(re.findall(r"^\|\s*`([^`]+)`\s*\|\s*`([0-9a-f]{64})`\s*\|", card, flags=re.MULTILINE))


def load(*, device: str | None = None, dtype=None):
    """``(model, tokenizer)`` of the bundled model, in eval mode, with SDPA attention."""
    return load_model("bundled", dtype=dtype, device=device), load_tokenizer("bundled")


def trained_length() -> int:
    """The context the bundled model was pretrained at (its ``max_position_embeddings``)."""
    return int(json.loads((MODEL_DIR / "config.json").read_text())["max_position_embeddings"])


def unseen_filler() -> list[str]:
    """Sentences of prose the bundled model never saw in training (``UNSEEN_PROSE``), for a passkey test
    whose filler it cannot know: ``passkey(model, tokenizer, [L], filler=bundled.unseen_filler())``."""

    return split_sentences(UNSEEN_PROSE.read_text(encoding="utf-8"))


def eval_texts() -> list[str]:
    """The held-out evaluation corpus: long synthetic chronicles, one string each."""
    return read_documents(EVAL_CORPUS)
