"""The GGUF file's ``general.name``: the model's own name, never one that changes how llama.cpp tokenizes.

llama.cpp reads ``general.name`` for more than display. At the commit ``llamacpp`` names, src/llama-vocab.cpp
(``llama_vocab::impl::load``) lowercases it and, when it contains

- ``phi-3`` or ``phi3``: gives every control, user-defined and unknown token the RSTRIP attribute (the
  whitespace after it is dropped from the text), then sets it on ``</s>`` and clears it on ``<unk>``, ``<s>``
  and ``<|endoftext|>``, looking each of those four up with ``token_to_id.at``: a vocabulary without one of
  them does not load at all;
- ``modern-bert``: gives ``[MASK]`` the LSTRIP attribute (the whitespace before it is dropped).

The old writer wrote ``_name_or_path``, the folder a model was loaded from, so a Llama model saved in a folder
named ``phi3-try`` got a file llama.cpp refused to load, and with a vocabulary holding those four tokens one
that tokenized the text after every special token differently from transformers. Here the name is the last
part of the model's own name (``HuggingFaceTB/SmolLM2-135M`` -> ``SmolLM2-135M``; a folder's name, never the
rest of a local path), kept only where llama.cpp's rule for it does what the tokenizer does; otherwise the
model type, or ``model`` where that too would trip a rule.
"""

from __future__ import annotations

import re
from typing import Any

PHI3_STRIP_OFF = ("<unk>", "<s>", "<|endoftext|>")  # llama.cpp clears RSTRIP on these after setting it on all
PHI3_NEEDS = ("</s>", *PHI3_STRIP_OFF)  # looked up with .at(): missing -> the file does not load
RULES = {"phi-3": "phi3", "phi3": "phi3", "modern-bert": "modern-bert"}  # substring -> llama.cpp's rule
FALLBACK = "model"


def rules_in(name: str) -> set[str]:
    """The llama.cpp name rules ``name`` sets off (``RULES`` values), matched as llama.cpp does: lowercased."""
    low = name.lower()
    return {rule for needle, rule in RULES.items() if needle in low}


def phi3_rule_agrees(data: dict) -> bool:
    """Whether llama.cpp's ``phi3`` rule leaves the tokenizer whose ``tokenizers`` pipeline is ``data`` as
    transformers runs it: every token it names is there, and each added token strips the whitespace after it
    exactly where the rule makes llama.cpp strip it (and none strips before it)."""
    model = data.get("model") or {}
    vocab = model.get("vocab")
    added = [t for t in data.get("added_tokens") or [] if isinstance(t, dict)]
    texts = (set(vocab) if isinstance(vocab, dict) else set()) | {t.get("content") for t in added}
    if any(token not in texts for token in PHI3_NEEDS):
        return False
    for token in added:
        want = token.get("content") not in PHI3_STRIP_OFF
        if bool(token.get("rstrip")) != want or token.get("lstrip"):
            return False
    return True


def own_name(config: Any) -> str:
    """The last part of the model's ``_name_or_path`` (a hub id's model name, a folder's own name), or ''."""
    raw = str(getattr(config, "_name_or_path", "") or "")
    parts = [p for p in re.split(r"[\\/]", raw) if p not in ("", ".", "..")]
    return parts[-1] if parts else ""


def gguf_name(config: Any, data: dict, wanted: str = "") -> tuple[str, list[str]]:
    """``(general.name, notes)`` for a model with ``config`` and a tokenizer whose pipeline is ``data``:
    ``wanted`` (or the model's own name) unless llama.cpp would react to it with a rule the tokenizer does not
    follow; then the model type (or ``model``), and a note saying why."""
    name = wanted or own_name(config)
    agrees = {"phi3": phi3_rule_agrees(data)}  # modern-bert: an encoder, never written here

    def safe(candidate: str) -> bool:
        return all(agrees.get(rule, False) for rule in rules_in(candidate))

    if name and safe(name):
        return name, []
    model_type = str(getattr(config, "model_type", "") or "")
    fallback = model_type if model_type and safe(model_type) else FALLBACK
    if not name:
        return fallback, []
    rule = ", ".join(sorted(rules_in(name)))
    note = (
        f"general.name is {fallback!r}, not {name!r}: llama.cpp applies its {rule} token rules to a model whose "
        "name contains that, which this tokenizer does not follow"
    )
    return fallback, [note]
