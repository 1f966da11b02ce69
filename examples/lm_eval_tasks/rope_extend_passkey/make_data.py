"""Write passkey.jsonl: passkey-retrieval prompts for the bundled model (trained at L = 256 tokens).

Each prompt is the community passkey protocol (``rope_extend.evaluation.prompts.passkey_prompt``) built to
an exact length in the bundled model's tokens: 240 (inside L), 500 (~2x), 750 (~3x) and 1000 (~3.9x), ten
keys at random depths per length (seeded). The answer is the key; the task scores the first integer the
model writes. Run from the repository root to rebuild the file (it is committed):

    PYTHONPATH=. python examples/lm_eval_tasks/rope_extend_passkey/make_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rope_extend.evaluation.prompts import passkey_prompt
from rope_extend.loading import load_tokenizer

LENGTHS = (240, 500, 750, 1000)
PER_LENGTH = 10
SEED = 14


def rows(tokenizer) -> list[dict]:
    out = []
    for length in LENGTHS:
        rng = random.Random(f"{SEED}:{length}")
        for i in range(PER_LENGTH):
            key = rng.randint(1, 50000)
            depth = round(rng.random(), 3)
            prompt = passkey_prompt(tokenizer, length, key, depth)
            text = tokenizer.decode(prompt.input_ids)
            tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            out.append(
                {
                    "id": f"{length}-{i}",
                    "length": length,
                    "tokens": tokens,
                    "depth": depth,
                    "input": text,
                    "target": str(key),
                }
            )
    return out


def main() -> None:
    tokenizer = load_tokenizer("bundled")
    path = Path(__file__).with_name("passkey.jsonl")
    with path.open("w", encoding="utf-8") as f:
        for row in rows(tokenizer):
            f.write(json.dumps(row) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
