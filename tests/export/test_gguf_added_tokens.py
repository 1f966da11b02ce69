"""An added token whose flags a GGUF cannot carry (``lstrip``, ``rstrip``, ``single_word``) is refused on the
byte-level BPE path too, as on the SentencePiece one: llama.cpp 0.3.36 splits the text around such a token
otherwise than transformers (``"a <|x|> b"`` with ``lstrip``: transformers ``[a, <|x|>, b]``, llama.cpp
``[a, " ", <|x|>, b]``; with ``rstrip`` the space before ``b`` stays in llama.cpp; with ``single_word``
transformers does not match ``word<|x|>word`` at all), measured with the bundled tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rope_extend.errors import UnsupportedModelError
from rope_extend.export import llamacpp
from rope_extend.loading import resolve_name


def _with_added(root: Path, flags: dict):
    """The bundled tokenizer with its last vocabulary entry turned into the added token ``<|x|>`` with ``flags``
    (the merges that make or use the old entry dropped)."""
    from transformers import AutoTokenizer

    src, folder = Path(resolve_name("bundled")), root / ("tok-" + "-".join(flags))
    folder.mkdir(parents=True)
    data = json.loads((src / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    last = max(vocab.values())
    old = next(t for t, i in vocab.items() if i == last)
    del vocab[old]
    vocab["<|x|>"] = last
    pairs = [m.split(" ") if isinstance(m, str) else m for m in data["model"]["merges"]]
    data["model"]["merges"] = [p for p in pairs if old not in p and "".join(p) != old]
    token = {"id": last, "content": "<|x|>", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": False, **flags}  # fmt: skip
    data["added_tokens"].append(token)
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "tokenizer_config.json").write_text((src / "tokenizer_config.json").read_text())
    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word"])
def test_an_added_token_that_strips_spaces_or_matches_whole_words_is_refused(tmp_path, flag):
    tok = _with_added(tmp_path, {flag: True})
    assert tok("a <|x|> b", add_special_tokens=False).input_ids != tok("a<|x|>b", add_special_tokens=False).input_ids
    with pytest.raises(UnsupportedModelError, match=r"the added token '<\|x\|>' strips spaces or matches whole words"):
        llamacpp.tokenizer_metadata(tok, 1024, "smollm")


def test_an_added_token_without_those_flags_is_written(tmp_path):
    tok = _with_added(tmp_path, {})
    meta = llamacpp.tokenizer_metadata(tok, 1024, "smollm")
    assert meta["tokens"][1023] == "<|x|>" and meta["token_type"][1023] == 4  # USER_DEFINED
