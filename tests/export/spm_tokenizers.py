"""SentencePiece tokenizers trained here (no hub) in the configurations Llama 2, Mistral v0.1 and Gemma ship,
wrapped by transformers as those families' tokenizers, and tiny models of the families with their vocabularies.

Each is a BPE ``tokenizer.model`` trained with the ``sentencepiece`` package (byte fallback, identity
normalization, whitespace kept as it is, whitespace-only pieces allowed, as in the released models), saved in
a folder with a ``tokenizer_config.json`` and converted by transformers itself (``AutoTokenizer``):

- ``llama2``: ``<unk> <s> </s>`` at 0-2, the dummy prefix, digits split; BOS added (Llama 2's config). transformers
  5 builds it with a ``Metaspace`` pre-tokenizer (``prepend_scheme`` ``first``).
- ``mistral``: as Llama 2 but digits merged and ``legacy`` (Mistral v0.1's config): ``prepend_scheme`` ``always``.
- ``llama2-json``: Llama 2's as older ``tokenizer.json`` files write it (a ``Prepend("▁")`` + ``Replace(" ", "▁")``
  normalizer, no pre-tokenizer), read by ``PreTrainedTokenizerFast`` (transformers 5's ``LlamaTokenizer`` would
  rebuild the pipeline as a ``Metaspace``).
- ``gemma``: ``<pad> <eos> <bos> <unk> <mask>`` at 0-4, user-defined ``<start_of_turn>`` / ``<end_of_turn>``, no
  dummy prefix, digits split, BOS added; transformers' ``GemmaTokenizer`` (a ``Replace(" ", "▁")`` normalizer).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import transformers as T

from eval import spm_bpe
from tests.tiny import TOKENIZER_TEXT

CORPUS = (
    "\n".join(TOKENIZER_TEXT)
    + "\n"
    + (
        "Übergrößen café naïve déjà vu — “quotes” 北京 東京 上海 数字 123 4567 89 0.5 3.14159 🙂 🎉\n"
        "tabs\tand\t\ttabs, two  spaces,   three   spaces,    four    spaces.\n"
        "def f(x):\n    return x  # comment\n\n"
    )
)
TEXTS = [  # digits, whitespace runs, leading spaces, newlines, accents, CJK, emoji (byte fallback)
    "The river keeps 12,345.67 of its own time!!  Twice   over   42,  7 and\t\t9\n\n\tand again:  'twas done.",
    "Übergrößen café naïve — “quotes” 北京 123abc x2y3 ١٢٣ ² ½ $100 #tag 🙂 3.14159e-10 \r\n   trailing   ",
    "def f(x):\n    return x  # comment\n\n\n        deeper\t\t\tend",
    "ñandú 你好世界 こんにちは 😀😃 🇫🇷 ∑∫√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 zero-width\u200bjoin",
    "x" + " " * 17 + "y" + "\n" * 5 + "z" + "\t" * 3,
    "1234567890 00000 9999 3.5e+7",
]
CONFIGS = {
    "llama2": (
        "LlamaTokenizer",
        dict(add_dummy_prefix=True, split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1),
        {"add_bos_token": True, "add_eos_token": False},
    ),
    "mistral": (
        "LlamaTokenizer",
        dict(add_dummy_prefix=True, split_digits=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1),
        {"add_bos_token": True, "add_eos_token": False, "legacy": True},
    ),
    "llama2-json": (  # Llama 2 as older tokenizer.json files say it, read by the generic class
        "PreTrainedTokenizerFast",
        dict(add_dummy_prefix=True, split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1),
        {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    ),
    "gemma": (
        "GemmaTokenizer",
        dict(
            add_dummy_prefix=False,
            split_digits=True,
            pad_id=0,
            eos_id=1,
            bos_id=2,
            unk_id=3,
            pad_piece="<pad>",
            eos_piece="<eos>",
            bos_piece="<bos>",
            user_defined_symbols=["<mask>", "<start_of_turn>", "<end_of_turn>"],
        ),
        {"add_bos_token": True, "add_eos_token": False},
    ),
}
VOCAB = 700


def train(folder: Path, vocab_size: int = VOCAB, corpus: list[str] | None = None, **options) -> Path:
    """A SentencePiece BPE (``eval/spm_bpe.py``) trained on ``corpus`` (lines; ``CORPUS``'s twice by default),
    written as ``folder/tokenizer.model``."""
    lines = corpus or [line for line in CORPUS.splitlines() if line.strip()] * 2
    return spm_bpe.train(folder, lines, vocab_size, **options)


@functools.cache
def _folder(name: str, root: str) -> Path:
    cls, options, config = CONFIGS[name]
    folder = Path(root) / name
    train(folder, **options)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": cls, **config}))
    if name == "llama2-json":  # converted as Llama's, then the prefix and the spaces written as a normalizer
        (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", **config}))
        data = json.loads(T.AutoTokenizer.from_pretrained(str(folder)).backend_tokenizer.to_str())
        data["pre_tokenizer"] = None
        data["normalizer"] = {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "\u2581"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
            ],
        }
        (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
        (folder / "tokenizer.model").unlink()
        (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": cls, **config}))
    return folder


def tokenizer(name: str, root: Path):
    """The family's tokenizer as transformers loads it from the folder (converted from ``tokenizer.model``;
    ``llama2-json``'s from its ``tokenizer.json``)."""
    return T.AutoTokenizer.from_pretrained(str(_folder(name, str(root))))
