"""A byte-level BPE's ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` in the GGUF say what the tokenizer does
(its post-processor, found by tokenizing), not its ``add_bos_token`` attribute, which may say otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rope_extend.export import llamacpp
from rope_extend.loading import resolve_name

TEXT = "The pass key is 12345. Remember it."
# a post-processor that puts BOS (<s>, id 1) in front of every text, as Llama 3's tokenizer.json does
WITH_BOS = {
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
}


def _tokenizer(root: Path, name: str, post_processor: dict | None, config: dict):
    """The bundled tokenizer with another post-processor and tokenizer_config keys, as transformers loads it."""
    from transformers import AutoTokenizer

    src, folder = Path(resolve_name("bundled")), root / name
    folder.mkdir(parents=True)
    data = json.loads((src / "tokenizer.json").read_text())
    if post_processor is not None:
        data["post_processor"] = post_processor
    (folder / "tokenizer.json").write_text(json.dumps(data))
    kept = json.loads((src / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**kept, **config}))
    return AutoTokenizer.from_pretrained(folder)


CASES = {  # name: (post-processor, tokenizer_config keys, whether BOS is added)
    "adds-nothing": (None, {}, False),
    "adds-bos": (WITH_BOS, {}, True),
    "adds-bos-config-says-not": (WITH_BOS, {"add_bos_token": False}, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_add_bos_is_what_the_tokenizer_adds(tmp_path, name):
    post, config, bos = CASES[name]
    tok = _tokenizer(tmp_path, name, post, config)
    assert (tok(TEXT).input_ids[0] == 1) == bos  # the case is what it says
    meta = llamacpp.tokenizer_metadata(tok, 1024, None)
    assert meta["model"] == "gpt2" and meta["add_bos_token"] is bos and meta["add_eos_token"] is False


@pytest.mark.engines
@pytest.mark.parametrize("name", list(CASES))
def test_llama_cpp_adds_what_transformers_adds(tmp_path, name):
    """llama.cpp's tokenization with its defaults (BOS as the file says) gives transformers' ids, BOS included."""
    llama_cpp = pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    from rope_extend.export import export
    from rope_extend.loading import load_model

    post, config, _ = CASES[name]
    tok = _tokenizer(tmp_path, name, post, config)
    model = load_model(resolve_name("bundled"))
    out = export(model, "gguf", tmp_path / "m.gguf", tokenizer=tok).out
    vocab = llama_cpp.Llama(str(out), vocab_only=True, verbose=False)
    assert vocab.tokenize(TEXT.encode("utf-8")) == tok(TEXT).input_ids
    vocab.close()
