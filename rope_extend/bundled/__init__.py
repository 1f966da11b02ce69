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

import hashlib
import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "model"
DATA_DIR = HERE / "data"
EVAL_CORPUS = DATA_DIR / "eval.jsonl"
# Original prose written for this package (lighthouses, bread, glaciers, ...): no sentence of it, and none of
# its sentence patterns, is in the training corpus (rope_extend.bundled.corpus makes that corpus from its own
# word lists and templates only), so it is filler the model never saw; it holds no digits.
UNSEEN_PROSE = DATA_DIR / "unseen_prose.txt"


class BundledModelMissing(FileNotFoundError):
    """The bundled model files are not in this installation."""


def available() -> bool:
    return (MODEL_DIR / "config.json").is_file() and (MODEL_DIR / "model.safetensors").is_file()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def card_checksums() -> dict[str, str]:
    """``{file name: sha256}`` as listed in the model card's checksum table."""
    card = (MODEL_DIR / "README.md").read_text(encoding="utf-8")
    return dict(re.findall(r"^\|\s*`([^`]+)`\s*\|\s*`([0-9a-f]{64})`\s*\|", card, flags=re.M))


def load(*, device: str | None = None, dtype=None):
    """``(model, tokenizer)`` of the bundled model, in eval mode, with SDPA attention."""
    if not available():
        raise BundledModelMissing(
            f"the bundled model is not in {MODEL_DIR}; build it with the pretraining recipe "
            "(see rope_extend/bundled/README in the repository) or reinstall rope-extend"
        )
    from ..loading import load_model, load_tokenizer

    return load_model(str(MODEL_DIR), dtype=dtype, device=device), load_tokenizer(str(MODEL_DIR))


def trained_length() -> int:
    """The context the bundled model was pretrained at (its ``max_position_embeddings``)."""
    return int(json.loads((MODEL_DIR / "config.json").read_text())["max_position_embeddings"])


def unseen_filler() -> list[str]:
    """Sentences of prose the bundled model never saw in training (``UNSEEN_PROSE``), for a passkey test
    whose filler it cannot know: ``passkey(model, tokenizer, [L], filler=bundled.unseen_filler())``."""
    from ..evaluation.prompts import split_sentences

    return split_sentences(UNSEEN_PROSE.read_text(encoding="utf-8"))


def eval_texts() -> list[str]:
    """The held-out evaluation corpus: long synthetic chronicles, one string each."""
    with open(EVAL_CORPUS, encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh if line.strip()]
