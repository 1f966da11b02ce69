"""SentencePiece tokenizers in the GGUF writer (llama.cpp's ``llama`` model, ``rope_extend/export/gguf_spm.py``).

In llama.cpp (llama-cpp-python 0.3.36, marker ``engines``; ``sentencepiece`` trains the tokenizers): Llama 2,
Mistral v0.1 and Gemma configurations (``tests/export/spm_tokenizers.py``), each saved with a tiny random model
of its family and exported from the folder with ``rope_extend.export`` (linear x4). llama.cpp's tokenization of
texts with digits, whitespace runs, leading spaces, newlines, accents, CJK and emoji (byte fallback) must be
transformers' ids, its detokenization transformers' text, and the model run on the text must give the
patched transformers model's logits and greedy tokens (bounds as ``test_gguf_families``). Without llama.cpp:
the tokenizers the writer refuses, before anything is written.
"""

from __future__ import annotations

import ctypes
import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.utils import logging as progress

import rope_extend
from rope_extend.export import export, gguf_spm
from tests.export.test_gguf_families import INIT, MISSED, NEW, TOLERANCE, L, llama_cpp_logits, transformers_logits
from tests.tiny import tiny_model

CASES = [  # (tokenizer, the family of the tiny model it is saved with)
    ("llama2", "llama"),
    ("mistral", "mistral"),
    ("llama2-json", "llama"),
    ("gemma", "gemma"),
    ("gemma", "gemma3"),  # Gemma 3's tokenizer is Gemma's kind
    ("llama2", "phi3"),  # Phi-3's is Llama's
]
ALPHABET = [
    " ",
    " ",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "a",
    "e",
    "t",
    "th",
    "1",
    "2",
    "0",
    ".",
    ",",
    "é",
    "ü",
    "北",
    "京",
    "🙂",
    "—",
]
LEADING = [" leading space", "   three spaces", "\ttab first", "\nnewline first"]
SPECIALS = {"gemma": "<start_of_turn>user\nhi 12<end_of_turn>\n<unused0> x"}  # the others: "<s>[INST] hi 12 </s>"


def _folder(name, root, family=None):
    """A tiny model of the family with the tokenizer's vocabulary and special ids, saved next to it."""
    from tests.export import spm_tokenizers

    tok = spm_tokenizers.tokenizer(name, root / "tokenizers")
    ids = {"pad_token_id": tok.pad_token_id or 0, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    model = tiny_model(family or dict(CASES)[name], initializer_range=INIT, vocab_size=len(tok), **ids)
    # not named after the family: llama.cpp gives every special token of a file whose general.name (here the
    # folder) contains "phi3" or "phi-3" Phi-3's right-strip, and fails to load one without <|endoftext|>
    folder = root / f"case-{name}"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model, tok, folder


def _detokenize(vocab, ids: list[int]) -> str:
    """llama.cpp's own ``llama_detokenize`` (what llama-server runs; llama-cpp-python's ``detokenize`` strips a
    space of its own), specials removed."""
    import llama_cpp

    array = (llama_cpp.llama_token * len(ids))(*ids)
    buffer = ctypes.create_string_buffer(8 * len(ids) + 64)
    n = llama_cpp.llama_detokenize(vocab._model.vocab, array, len(ids), buffer, len(buffer), True, False)
    assert n >= 0
    return buffer.raw[:n].decode("utf-8")


@pytest.mark.engines
@pytest.mark.parametrize(("name", "family"), CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_llama_cpp_tokenizes_and_runs_as_transformers(tmp_path, name, family):
    llama_cpp = pytest.importorskip("llama_cpp")
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("sentencepiece")
    from tests.export.spm_tokenizers import TEXTS

    model, tok, folder = _folder(name, tmp_path, family)
    result = export(str(folder), "gguf", tmp_path / "m.gguf", method="linear", factor=4.0)
    fields = gguf.GGUFReader(result.out).fields
    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "llama"
    prefix = bool(fields["tokenizer.ggml.add_space_prefix"].parts[-1][0])
    assert prefix == (name != "gemma")
    # transformers 5's LlamaTokenizer builds a Metaspace: prepend_scheme first (Llama 2), always (legacy: Mistral)
    metaspace = {"llama2": 2, "mistral": 1}.get(name, 0)  # the differences the notes name
    assert len(result.notes) == metaspace and all("one more ▁" in n or "after each special" in n for n in result.notes)

    vocab = llama_cpp.Llama(str(result.out), vocab_only=True, verbose=False)
    special = SPECIALS.get(name, "<s>[INST] hi 12 </s>")
    for text in TEXTS + LEADING + [special]:
        want = tok(text, add_special_tokens=False).input_ids
        got = vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if metaspace and text.startswith(" "):  # SentencePiece's dummy prefix, always added by llama.cpp
            assert got == tok(" " + text, add_special_tokens=False).input_ids != want, text
            continue
        if metaspace == 2 and text == special:  # and after each special token
            assert got == tok("<s> [INST] hi 12 </s>", add_special_tokens=False).input_ids != want
            continue
        assert got == want, (text, tok.convert_ids_to_tokens(want), tok.convert_ids_to_tokens(got))
        if text in TEXTS:
            assert _detokenize(vocab, got) == tok.decode(want), text
    assert vocab.tokenize(b"x 12") == tok("x 12").input_ids  # BOS added by both, no EOS
    rng = random.Random(0)  # and 300 strings drawn from what the texts above mix
    for _ in range(300):
        text = "x" + "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40)))
        assert vocab.tokenize(text.encode(), add_bos=False) == tok(text, add_special_tokens=False).input_ids, text

    text = " ".join(TEXTS[:3] * 4)
    ids = vocab.tokenize(text.encode("utf-8"))
    assert ids == tok(text).input_ids and len(ids) > 384
    ids = ids[:384]  # past L = 256
    vocab.close()
    plain, _ = transformers_logits(model, ids)
    rope_extend.patch(model, "linear", factor=4.0)
    want, want_greedy = transformers_logits(model, ids)
    got, got_greedy = llama_cpp_logits(result.out, ids)
    scale = float(np.abs(want).max())
    diff, missed = float(np.abs(got - want).max()) / scale, float(np.abs(got[L:] - plain[L:]).max()) / scale
    print(f"{name} ({family}): {len(ids)} tokens, max |diff| / logit scale {diff:.2e} (unscaled: {missed:.2e})")
    assert diff < TOLERANCE and got_greedy == want_greedy and len(got_greedy) == NEW
    assert missed > MISSED * TOLERANCE  # the scaling is in the file


@pytest.mark.engines
def test_the_comparison_can_fail(tmp_path, monkeypatch):
    """The control: Gemma's tokenizer written with llama.cpp's default space prefix gives other ids."""
    llama_cpp = pytest.importorskip("llama_cpp")
    pytest.importorskip("sentencepiece")
    _model, tok, folder = _folder("gemma", tmp_path)
    monkeypatch.setattr(gguf_spm, "space_prefix", lambda data: (True, []))
    out = export(str(folder), "gguf", tmp_path / "m.gguf", method="linear", factor=4.0).out
    vocab = llama_cpp.Llama(str(out), vocab_only=True, verbose=False)
    text = "The river keeps 12 of its time"
    assert vocab.tokenize(text.encode(), add_bos=False) != tok(text, add_special_tokens=False).input_ids
    vocab.close()


# ----------------------------------------------------------------------------------------------- refusals
BYTES = {f"<0x{b:02X}>": 3 + b for b in range(256)}


def _piece_tokenizer(pieces, merges, model="BPE", drop_bytes=0):
    """A ``tokenizers`` SentencePiece-shaped tokenizer: ``<unk> <s> </s>``, the byte tokens, then ``pieces``."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **dict(list(BYTES.items())[drop_bytes:])}
    vocab.update({p: 259 + i for i, p in enumerate(pieces)})
    if model == "Unigram":
        inner = models.Unigram([(p, -float(i)) for p, i in vocab.items()], unk_id=0, byte_fallback=True)
    else:
        inner = models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True)
    backend = Tokenizer(inner)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return tok, 259 + len(pieces)


PIECES = ["▁", "a", "b", "c", "ab", "bc", "abc", "▁abc"]
REFUSED = [  # (pieces, merges, model, byte tokens dropped, tokenizer_pre, what the message says)
    (
        PIECES,
        [("a", "b"), ("b", "c"), ("ab", "c"), ("▁", "abc")],
        "BPE",
        0,
        None,
        "would join 'a' and 'bc' into the token 'abc'",
    ),
    (PIECES, [("a", "b"), ("b", "c"), ("ab", "c"), ("▁", "abc"), ("a", "bc")], "BPE", 0, None, "not consecutive"),
    (PIECES, [], "Unigram", 0, None, "a Unigram model is llama.cpp's t5 tokenizer"),
    (PIECES, [("a", "b")], "BPE", 2, None, r"without the byte tokens <0x00>, <0x01> \(2 missing\)"),
    (PIECES, [("a", "b")], "BPE", 0, "llama-bpe", "names how llama.cpp's gpt2 model splits text"),
]


@pytest.mark.parametrize(
    ("pieces", "merges", "model", "dropped", "pre", "message"), REFUSED, ids=[r[-1][:30] for r in REFUSED]
)
def test_what_llama_cpp_would_tokenize_differently_is_refused(tmp_path, pieces, merges, model, dropped, pre, message):
    pytest.importorskip("gguf")
    tok, size = _piece_tokenizer(pieces, merges, model, dropped)
    net = tiny_model("llama", vocab_size=size)
    with pytest.raises(rope_extend.RopeExtendBaseError, match=message) as error:
        export(net, "gguf", tmp_path / "m.gguf", tokenizer=tok, tokenizer_pre=pre)
    assert "\n" not in str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_the_complete_merges_are_written_with_scores_in_merge_order():
    """The same vocabulary with every pair llama.cpp could join as a merge: written, each merged token scored
    by its merge's rank (``-(1 + i)``), every other token below them all; types as llama.cpp names them."""
    merges = [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc"), ("▁", "abc")]
    tok, size = _piece_tokenizer(PIECES, merges)
    meta = gguf_spm.spm_metadata(tok, json.loads(tok.backend_tokenizer.to_str()), size + 2)
    scores = dict(zip(meta["tokens"], meta["scores"], strict=True))
    assert [scores[t] for t in ("ab", "bc", "abc", "▁abc")] == [-1.0, -2.0, -3.0, -4.0]
    assert scores["a"] == scores["<0x41>"] == scores["[PAD268]"] == -5.0
    assert meta["token_type"][:4] == [2, 3, 3, 6] and meta["token_type"][259] == 1 and meta["token_type"][-1] == 5
    assert meta["add_bos_token"] is False and meta["add_space_prefix"] is True and meta["notes"]


def test_normalizer_shapes():
    """The pipelines llama.cpp's SPM tokenizer runs, and one it does not (a Metaspace that splits words)."""
    replace = normalizers.Replace(" ", "▁")
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace])
    assert gguf_spm.space_prefix(json.loads(backend.to_str())) == (True, [])
    backend.normalizer = replace
    backend.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    assert gguf_spm.space_prefix(json.loads(backend.to_str())) == (False, [])
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=False)
    assert gguf_spm.space_prefix(json.loads(backend.to_str())) == (False, [])
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    assert gguf_spm.space_prefix(json.loads(backend.to_str())) is None
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = None
    assert gguf_spm.space_prefix(json.loads(backend.to_str())) is None


def test_the_command_refuses_in_one_line_and_writes_nothing(tmp_path, capsys):
    """``rope-extend export FOLDER --to gguf`` on a folder whose tokenizer is a Unigram model: exit 2, one line
    naming what was found and what is written, with the flags that add the rope to a file converted elsewhere."""
    pytest.importorskip("gguf")
    from rope_extend.cli import main

    tok, size = _piece_tokenizer(PIECES, [], "Unigram")
    folder = tmp_path / "m"
    progress.disable_progress_bar()  # the save's bar would reach stderr past readouterr
    try:
        tiny_model("llama", vocab_size=size).save_pretrained(folder)
    finally:
        progress.enable_progress_bar()
    tok.save_pretrained(folder)
    before = sorted(p.name for p in folder.iterdir())
    argv = [
        "export",
        str(folder),
        "--to",
        "gguf",
        "--method",
        "yarn",
        "--factor",
        "2",
        "--out",
        str(tmp_path / "m.gguf"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a Unigram model" in err and "SentencePiece BPE tokenizers" in err, err
    assert "--override-kv llama.rope.scaling.type=str:yarn" in err
    assert not (tmp_path / "m.gguf").exists() and sorted(p.name for p in folder.iterdir()) == before
