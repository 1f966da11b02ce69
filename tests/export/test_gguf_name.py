"""The GGUF ``general.name``: the model's own name, never one that sets off llama.cpp's per-name token rules
(``rope_extend.export.gguf_name``)."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest

from rope_extend.export.gguf_name import gguf_name, phi3_rule_agrees, rules_in
from rope_extend.loading import resolve_name


def _bundled() -> Path:
    return Path(resolve_name("bundled"))


def _bundled_pipeline() -> dict:
    return json.loads((_bundled() / "tokenizer.json").read_text())


def _config(name_or_path: str, model_type: str = "llama"):
    return types.SimpleNamespace(_name_or_path=name_or_path, model_type=model_type)


def _phi3_pipeline(rstrip_end: bool = True) -> dict:
    """A pipeline shaped as Phi-3-mini's: the four tokens llama.cpp's rule looks up, the chat tokens rstrip."""

    def added(i, content, rstrip):
        return {"id": i, "content": content, "rstrip": rstrip, "lstrip": False, "special": True}

    return {
        "model": {"vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3}},
        "added_tokens": [
            added(0, "<unk>", False),
            added(1, "<s>", False),
            added(2, "</s>", True),
            added(4, "<|endoftext|>", False),
            added(5, "<|end|>", rstrip_end),
        ],
    }


def test_llama_cpp_name_rules_are_matched_as_llama_cpp_matches_them():
    assert rules_in("Phi-3-mini-4k-instruct") == {"phi3"}
    assert rules_in("/x/PHI3-try") == {"phi3"}
    assert rules_in("ModernBERT") == set()  # llama.cpp looks for "modern-bert"
    assert rules_in("modern-bert-base") == {"modern-bert"}
    assert rules_in("phi-4") == rules_in("SmolLM2-135M") == set()


@pytest.mark.parametrize(
    ("name_or_path", "model_type", "want"),
    [
        ("HuggingFaceTB/SmolLM2-135M", "llama", "SmolLM2-135M"),  # a hub id: its model name
        ("/home/u/phi3-experiments/llama-small/", "llama", "llama-small"),  # the folder's own name, not the path
        ("C:\\models\\tiny", "llama", "tiny"),
        ("", "qwen2", "qwen2"),
        ("/home/u/phi3-try", "llama", "llama"),  # the rule would fire: the model type instead
        ("/home/u/Phi-3-try", "phi3", "model"),  # and where the model type fires it too
    ],
)
def test_the_name_is_the_models_own_and_never_sets_off_a_rule(name_or_path, model_type, want):
    name, notes = gguf_name(_config(name_or_path, model_type), _bundled_pipeline())
    assert name == want
    assert rules_in(name) == set()
    if want in name_or_path or not name_or_path:
        assert notes == []
    else:
        assert len(notes) == 1 and f"not {name_or_path.rstrip('/').rsplit('/', 1)[-1]!r}" in notes[0]
        assert "phi3 token rules" in notes[0]


def test_a_phi3_name_is_kept_where_the_tokenizer_strips_as_llama_cpp_then_does():
    assert phi3_rule_agrees(_phi3_pipeline())
    assert gguf_name(_config("microsoft/Phi-3-mini-4k-instruct", "phi3"), _phi3_pipeline()) == (
        "Phi-3-mini-4k-instruct",
        [],
    )
    # one chat token that does not strip: llama.cpp would strip after it, so the name goes
    assert not phi3_rule_agrees(_phi3_pipeline(rstrip_end=False))
    name, notes = gguf_name(_config("microsoft/Phi-3-mini-4k-instruct", "phi3"), _phi3_pipeline(rstrip_end=False))
    assert name == "model" and len(notes) == 1
    # a vocabulary without one of the four tokens: llama.cpp would not load the file
    short = _phi3_pipeline()
    short["added_tokens"] = [t for t in short["added_tokens"] if t["content"] != "<|endoftext|>"]
    assert not phi3_rule_agrees(short)


@pytest.mark.engines
def test_a_folder_named_phi3_exports_a_file_llama_cpp_reads_as_any_other(tmp_path):
    """The bundled Llama model exported from a folder named ``phi3-try`` and from a neutral one: llama.cpp loads
    both and tokenizes a text with special tokens and whitespace after them the same way (before the fix the
    first file's name was the folder, and llama.cpp refused to load it: its vocabulary has no ``<unk>``)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    gguf = pytest.importorskip("gguf")
    from rope_extend.export import export

    text = b"<s>  hi </s>\n\n there <pad> x"
    got, names = {}, {}
    for folder in ("neutral", "phi3-try"):
        shutil.copytree(_bundled(), tmp_path / folder)
        result = export(str(tmp_path / folder), "gguf", tmp_path / f"{folder}.gguf")
        names[folder] = bytes(gguf.GGUFReader(result.out).fields["general.name"].parts[-1]).decode()
        vocab = llama_cpp.Llama(str(result.out), vocab_only=True, verbose=False)
        got[folder] = vocab.tokenize(text, add_bos=False, special=True)
    assert names == {"neutral": "neutral", "phi3-try": "llama"}
    assert got["phi3-try"] == got["neutral"]
    assert got["neutral"][0] == 1 and 2 in got["neutral"]  # the specials were parsed as such
