"""A SentencePiece BPE ``tokenizer.model`` trained here (no hub), in the settings Llama 2, Mistral v0.1 and Gemma
ship: byte fallback, identity normalization, whitespace kept as it is, whitespace-only pieces allowed, every
character covered. ``eval/gguf_spm_parity.py`` trains one on a long text; ``tests/export/spm_tokenizers.py``
small ones in each family's configuration (here, not in tests/, because scripts in eval/ must not import from
tests/). Needs the ``sentencepiece`` package.
"""

from __future__ import annotations

import io
from pathlib import Path


def train(folder: Path, corpus: list[str], vocab_size: int, **options) -> Path:
    """A SentencePiece BPE trained on ``corpus`` (lines) with ``options`` on top of the released models'
    settings, written as ``folder/tokenizer.model``; returns that path."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=out,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        minloglevel=2,
        **options,
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(out.getvalue())
    return folder / "tokenizer.model"
