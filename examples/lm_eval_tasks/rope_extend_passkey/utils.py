"""The dataset of the rope_extend_passkey tasks: the rows of passkey.jsonl (next to this file) of one length."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

DATA = Path(__file__).with_name("passkey.jsonl")


def load(length: int | None = None, **_metadata):
    """A ``DatasetDict`` with a ``test`` split: the prompts of ``length`` tokens (all of them if None).
    lm-eval calls it with the task's ``dataset_kwargs`` and any ``--metadata``; the metadata is not used."""

    with DATA.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if length is not None:
        rows = [r for r in rows if r["length"] == int(length)]
    if not rows:
        raise ValueError(f"{DATA} has no prompts of length {length}")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
