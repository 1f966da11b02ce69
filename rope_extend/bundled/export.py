"""Copy a finished pretraining run into the package as the bundled model, with its model card.

    rope-extend bundled-export runs/bundled-pretrain

Writes ``rope_extend/bundled/model/`` atomically: the weights (safetensors), config, tokenizer, and a
``README.md`` model card giving how the model was made, the exact commands, the data, and the SHA-256 of
every file (the tests check them).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from safetensors import safe_open

from ..io import atomic_path, sha256
from . import MODEL_DIR

COMMANDS = """\
rope-extend bundled-data --out runs/bundled-data          # the mixed documents and the tokenizer
rope-extend bundled-data --out runs/bundled-data-copy64 --context 64 --documents 80000 \\
    --passkey-share 0 --needle-share 0 --recall-share 0 --drill-share 1
rope-extend bundled-data --out runs/bundled-data-copy256 --context 256 --documents 20000 \\
    --passkey-share 0 --needle-share 0 --recall-share 0 --drill-share 1
# stage 1: copy drills in a 64-token window, from scratch: induction heads form
OMP_NUM_THREADS=1 rope-extend train bundled-pretrain
# stage 2: copy drills in the 256-token window: the heads reach across the context
OMP_NUM_THREADS=1 rope-extend train bundled-copy
rope-extend bundled-data --out runs/bundled-data-ruler --seed 4 --documents 12000 --passkey-share 0.25 \\
    --recall-share 0.12 --needle-share 0.04 --drill-share 0.15 --ruler-share 0.3
# stage 3: the whole mix (chronicles, passkeys with varied filler, recall, needles, drills)
OMP_NUM_THREADS=1 rope-extend train bundled-retrieval
# stage 4: the same kinds with 30% RULER needle tasks in RULER's words
OMP_NUM_THREADS=1 rope-extend train bundled-ruler
rope-extend bundled-export runs/bundled-ruler --notes rope_extend/recipes/bundled-model-card.md"""

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

CARD = """# rope-extend bundled testbed model

A small Llama-architecture model that rope-extend pretrains itself, offline, so that every scaling
method, recipe and harness can be shown doing something real without downloading anything. It is a
testbed, not a general language model: it knows only the synthetic text it was trained on.

| | |
|---|---|
| architecture | Llama, {layers} layers, hidden {hidden}, {heads} heads ({kv_heads} key/value), head dim {head_dim}, MLP {mlp} |
| parameters | {params:,} (tied input/output embeddings), float32 |
| vocabulary | {vocab} (byte-level BPE trained on the corpus, digits one per token) |
| trained context | {context} tokens (`max_position_embeddings`) |
| rotary | `rope_theta` {theta:g}: {turning} of {pairs} frequency pairs complete a full turn inside the trained context ({turning_share:.0%}; Llama 2 at 4k: 45 of 64, 70%) |
| training | last stage: {steps} steps x {tokens_per_step:,} tokens = {tokens:,} tokens, final loss {final_loss:.3f} (mean of the last 20 steps) |

## Data
Synthetic and license-clean, made by `rope_extend.bundled.corpus` from word lists and templates with
`random.Random(seed)`: town chronicles that introduce people with facts and recall them later (long-range
structure), passkey-retrieval examples in the evaluation protocol's exact wording with varied filler,
associative recall, needle questions, copy drills, and RULER's needle tasks in RULER's own words (last stage).
The held-out corpus
(`rope_extend/bundled/data/eval.jsonl`) is 8 chronicles of about 6k tokens each from a separate seed
stream; `rope_extend/bundled/data/unseen_prose.txt` is original prose that is not in the training corpus
(filler for a passkey test the model cannot know).

{notes}## How it was made
```
{commands}
```

## Files
| file | sha256 |
|---|---|
{checksums}
"""


def _turning_pairs(theta: float, head_dim: int, context: int) -> int:
    """Frequency pairs whose wavelength ``2 pi theta^(2i/d)`` is shorter than the context."""
    return sum(1 for i in range(head_dim // 2) if 2 * math.pi * theta ** (2 * i / head_dim) < context)


def export(run_dir: str | Path, out: str | Path = MODEL_DIR, *, commands: str, notes: str = "") -> Path:
    """Copy ``run_dir/model`` to ``out`` with a model card; ``notes`` (markdown: how it was trained, what it
    measures) goes into the card before the commands."""
    run_dir = Path(run_dir)
    source = run_dir / "model"
    if not (source / "model.safetensors").is_file():
        raise FileNotFoundError(f"{source} holds no finished model (model.safetensors); finish the run first")
    config = json.loads((source / "config.json").read_text())
    history = []
    loss_csv = run_dir / "loss.csv"
    if loss_csv.is_file():
        lines = loss_csv.read_text().strip().splitlines()
        header = lines[0].split(",")
        history = [dict(zip(header, line.split(","), strict=True)) for line in lines[1:]]
    with atomic_path(out) as tmp:
        tmp.mkdir()
        for name in FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, tmp / name)

        with safe_open(str(tmp / "model.safetensors"), "pt") as fh:
            params = sum(math.prod(fh.get_slice(k).get_shape()) for k in fh.keys())  # noqa: SIM118 (not a dict)
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        theta = config["rope_parameters"]["rope_theta"]
        context = config["max_position_embeddings"]
        turning = _turning_pairs(theta, head_dim, context)
        steps = int(history[-1]["step"]) if history else 0
        tokens = int(float(history[-1]["tokens"])) if history else 0
        tail = [float(r["loss"]) for r in history[-20:]]
        card = CARD.format(
            layers=config["num_hidden_layers"],
            hidden=config["hidden_size"],
            heads=config["num_attention_heads"],
            kv_heads=config["num_key_value_heads"],
            head_dim=head_dim,
            mlp=config["intermediate_size"],
            params=params,
            vocab=config["vocab_size"],
            context=context,
            theta=theta,
            turning=turning,
            pairs=head_dim // 2,
            turning_share=turning / (head_dim // 2),
            steps=steps,
            tokens_per_step=tokens // max(steps, 1),
            tokens=tokens,
            final_loss=sum(tail) / len(tail) if tail else float("nan"),
            commands=commands.strip(),
            notes=notes.strip() + "\n\n" if notes.strip() else "",
            checksums="\n".join(f"| `{name}` | `{sha256(tmp / name)}` |" for name in FILES if (tmp / name).is_file()),
        )
        (tmp / "README.md").write_text(card, encoding="utf-8")
    return Path(out)
