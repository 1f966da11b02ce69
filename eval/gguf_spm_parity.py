"""llama.cpp's tokenization of a SentencePiece tokenizer exported to GGUF, against transformers', on many texts.

    python eval/gguf_spm_parity.py                    # 8,000 pieces trained on canterbury/lcet10.txt, Llama's and Gemma's

Trains a SentencePiece BPE (byte fallback, identity normalization, whitespace kept, digits split) on the text,
loads it in transformers as ``LlamaTokenizer`` and as ``GemmaTokenizer``, exports a tiny random model of the
family with it (``rope_extend.export``, GGUF), and tokenizes with llama.cpp (llama-cpp-python, vocabulary only)
slices of the text (1-400 characters, every 200) and ``--random`` strings of spaces, tabs, newlines, letters,
digits, accents, CJK and emoji. A text starting with a space is given a letter in front for Llama's (the one
difference llama.cpp keeps for a Metaspace tokenizer, docs/serving.md). Prints one JSON line per tokenizer:
texts and how many differ. Needs ``sentencepiece``, ``protobuf`` and ``llama-cpp-python``.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import transformers as T

from eval.spm_bpe import train
from eval.tiny import tiny_model
from rope_extend.documents import read_documents
from rope_extend.export import export

FAMILIES = {"LlamaTokenizer": "llama", "GemmaTokenizer": "gemma"}
ALPHABET = " \t\nab1é北🙂"


def texts(text: str, count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    slices = [text[i : i + rng.randint(1, 400)] for i in range(0, len(text), 200)]
    drawn = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(count)]
    return slices + drawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--document", default="canterbury/lcet10.txt")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--random", type=int, default=3000)
    args = parser.parse_args()
    from llama_cpp import Llama

    text = read_documents(args.document)[0]
    work = Path(tempfile.mkdtemp())
    lines = [line for line in text.splitlines() if line.strip()]
    for cls, family in FAMILIES.items():
        folder = work / family
        train(folder, lines, args.vocab, split_digits=True)
        (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": cls, "add_bos_token": True}))
        tok = T.AutoTokenizer.from_pretrained(str(folder))
        ids = {"pad_token_id": 0, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
        model = tiny_model(family, vocab_size=len(tok), **ids)
        out = export(model, "gguf", work / f"{family}.gguf", tokenizer=tok).out
        vocab = Llama(str(out), vocab_only=True, verbose=False)
        differ = 0
        samples = texts(text, args.random)
        for sample in samples:
            if family == "llama" and sample.startswith(" "):
                sample = "x" + sample
            got = vocab.tokenize(sample.encode("utf-8"), add_bos=False, special=False)
            differ += got != tok(sample, add_special_tokens=False).input_ids
        vocab.close()
        print(json.dumps({"tokenizer": cls, "pieces": len(tok), "texts": len(samples), "different": differ}))


if __name__ == "__main__":
    main()
