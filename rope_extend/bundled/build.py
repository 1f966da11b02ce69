"""Making the bundled model's data: the pretraining text, its tokenizer, and the held-out corpus.

    rope-extend bundled-data --out runs/bundled-data      # train.jsonl + tokenizer/ (deterministic)

The pretraining recipe (recipes/bundled-pretrain.yaml) reads that folder; the held-out corpus ships in
the package (rope_extend/bundled/data/eval.jsonl) and is rebuilt by ``--eval-corpus``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..io import atomic_path
from ..training.data import train_bpe_tokenizer
from .corpus import evaluation_documents
from .mix import training_documents

TOKENIZER_DOCUMENTS = 4000  # the tokenizer is trained on the first documents of the stream


def write_jsonl(path: Path, texts: list[str]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"text": text}) + "\n" for text in texts)


def write_pretraining_data(
    out_dir: str | Path,
    *,
    seed: int = 0,
    documents: int = 60000,
    vocab_size: int = 1024,
    context: int = 256,
    **shares: float,
) -> Path:
    """``out_dir/train.jsonl`` (``documents`` mixed documents sized for ``context``; ``shares`` as
    ``mix.training_documents`` takes them) and ``out_dir/tokenizer`` (trained on the first documents of the
    256-token stream of seed 0 with the default shares, the bundled model's tokenizer, whatever is asked)."""
    out_dir = Path(out_dir)
    # min_frequency 2: no merges for one-off strings (a passkey's digits are single tokens anyway)
    tokenizer = train_bpe_tokenizer(training_documents(0, TOKENIZER_DOCUMENTS), vocab_size, min_frequency=2)

    def count(text: str) -> int:  # as training encodes a document (special tokens included)
        return len(tokenizer(text)["input_ids"])

    texts = training_documents(seed, documents, context=context, count=count, **shares)
    write_jsonl(out_dir / "train.jsonl", texts)
    with atomic_path(out_dir / "tokenizer") as tmp:
        tokenizer.save_pretrained(tmp)
    return out_dir


def write_eval_corpus(path: str | Path, *, seed: int = 1_000_003, documents: int = 8, words: int = 5000) -> Path:
    write_jsonl(Path(path), evaluation_documents(seed, documents, words))
    return Path(path)
