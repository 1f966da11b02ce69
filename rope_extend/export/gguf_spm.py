"""SentencePiece tokenizers (Llama 2, Mistral v0.1, Gemma) as llama.cpp's ``llama`` (SPM) vocabulary.

The source is the tokenizer transformers runs: its ``tokenizers`` pipeline (``tokenizer.json``, or what
transformers converted ``tokenizer.model`` into when the folder ships only that), so llama.cpp is given the
tokenization the patched model was checked with, and no SentencePiece protobuf is parsed here.

Facts from llama.cpp at the commit ``llamacpp`` names (src/llama-vocab.cpp):

- ``tokenizer.ggml.model = "llama"`` tokenizes each stretch of text between special tokens on its own: a space in
  front when ``add_space_prefix`` is set (at the start and after every special token), every space as ``▁``,
  then one symbol per character and, repeatedly, the adjacent pair whose concatenation is a token with the
  highest ``tokenizer.ggml.scores`` value (the leftmost among equals) is joined. Any token text counts, whatever
  its type. A symbol left that is no token goes out as its UTF-8 bytes' ``<0xNN>`` tokens (type BYTE).
- transformers' BPE joins the adjacent pair of lowest rank in its merges (the leftmost among equals), and falls
  back to ``<0xNN>`` for a character it has no token for (``byte_fallback``). The two agree when every pair
  llama.cpp could join is a merge, every token's merges are consecutive, and the score of a token falls with
  the rank of its merges: the score written is ``-(1 + i)`` for the ``i``-th merged token (tokens no merge
  makes get the lowest score, below every merge), and ``spm_metadata`` refuses a vocabulary without those
  properties (SentencePiece's own BPE, and transformers' conversion of it, have them).
- Control tokens (type 3) and user-defined ones (type 4, transformers' added tokens that are not special) are
  cut out of the text before that; user-defined ones always, control ones when parsing specials is asked for.
- Unigram tokenizers are llama.cpp's ``t5`` model (a Viterbi search, not merges by score): refused here.

The text in front of the model, in the shapes transformers writes for these families: a ``Metaspace``
pre-tokenizer (``split`` off; Llama 2 and Mistral under transformers 5), a ``Prepend("▁")`` + ``Replace(" ",
"▁")`` normalizer (older Llama 2 and Mistral files), or a ``Replace(" ", "▁")`` normalizer with no prefix
(Gemma; its ``Split(" ")`` pre-tokenizer then finds no space). ``Metaspace`` with ``prepend_scheme`` ``first`` or
``always`` adds no ``▁`` to a text that already starts with one (or with a space), where llama.cpp, as
SentencePiece itself, adds one; with ``first`` it adds none after a special token either, where llama.cpp adds
one after each. Those differences are said in the export's notes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import UnsupportedModelError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's token types
SPACE = "\u2581"  # SentencePiece's visible space
BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")
ALLOWED = (
    "the GGUF writer writes byte-level BPE tokenizers (llama.cpp's gpt2 model) and SentencePiece BPE tokenizers "
    "with byte fallback (llama.cpp's llama model: Llama 2, Mistral v0.1, Gemma)"
)
LEADING_SPACE = (
    "llama.cpp adds SentencePiece's leading ▁ to a prompt that starts with a space, which this tokenizer (a "
    "Metaspace pre-tokenizer, as transformers 5 builds Llama's) does not: such a prompt gets one more ▁ token"
)
AFTER_SPECIAL = (
    "llama.cpp adds a leading ▁ to the text after each special token, which this tokenizer (a Metaspace "
    "pre-tokenizer with prepend_scheme first, Llama's with legacy=false) adds at the start of the prompt only"
)


def _is_replace_space(node: Any) -> bool:
    return (
        isinstance(node, dict)
        and node.get("type") == "Replace"
        and node.get("pattern") == {"String": " "}
        and node.get("content") == SPACE
    )


def _steps(node: Any) -> list:
    """A normalizer or pre-tokenizer as a list of steps (a ``Sequence`` flattened one level)."""
    if node is None:
        return []
    if isinstance(node, dict) and node.get("type") == "Sequence":
        return list(node.get("normalizers") or node.get("pretokenizers") or [])
    return [node]


def _describe(node: Any) -> str:
    steps = _steps(node)
    return "+".join(str(s.get("type")) if isinstance(s, dict) else repr(s) for s in steps) or "none"


def space_prefix(data: dict) -> tuple[bool, list[str]] | None:
    """``(add_space_prefix, notes)`` for a pipeline of a shape llama.cpp's SPM tokenizer runs, None otherwise."""
    norm, pre = _steps(data.get("normalizer")), _steps(data.get("pre_tokenizer"))
    if not norm and len(pre) == 1 and pre[0].get("type") == "Metaspace":
        meta = pre[0]
        scheme = meta.get("prepend_scheme", "always" if meta.get("add_prefix_space", True) else "never")
        if meta.get("replacement") != SPACE or meta.get("split", True) or scheme not in ("first", "always", "never"):
            return None
        if scheme == "never":
            return False, []
        return True, [LEADING_SPACE] + ([AFTER_SPECIAL] if scheme == "first" else [])
    prepend = {"type": "Prepend", "prepend": SPACE}
    if len(norm) == 2 and norm[0] == prepend and _is_replace_space(norm[1]) and not pre:
        return True, []
    gemma_split = {"type": "Split", "pattern": {"String": " "}}
    gemma_pre = not pre or (len(pre) == 1 and {k: pre[0].get(k) for k in gemma_split} == gemma_split)
    if len(norm) == 1 and _is_replace_space(norm[0]) and gemma_pre:
        return False, []  # the split on " " runs after every space became ▁: it splits nothing
    return None


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{ALLOWED}, not this one ({what}): convert with llama.cpp's convert_hf_to_gguf.py")


def _check_model(data: dict) -> dict:
    if not data:
        raise _refuse("a tokenizer without a tokenizers pipeline (tokenizer.json)")
    model = data.get("model") or {}
    kind = model.get("type")
    found = f"a {kind} model, normalizer {_describe(data.get('normalizer'))}, pre-tokenizer "
    found += _describe(data.get("pre_tokenizer"))
    if kind == "Unigram":
        raise _refuse(f"{found}; a Unigram model is llama.cpp's t5 tokenizer, which this writer does not write")
    if kind != "BPE" or space_prefix(data) is None:
        raise _refuse(found)
    if not model.get("byte_fallback"):
        raise _refuse(f"{found}, without byte_fallback")
    odd = [k for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "ignore_merges") if model.get(k)]
    if odd:
        raise _refuse(f"{found} with {', '.join(odd)} set")
    if not isinstance(model.get("vocab"), dict) or not isinstance(model.get("merges"), list):
        raise _refuse(f"{found} without a vocabulary and merges")
    return model


def _merge_scores(merges: list, vocab: dict) -> tuple[dict[str, float], set[tuple[str, str]]]:
    """The score of every merged token (``-(1 + i)`` for the ``i``-th, in merge order) and the merge pairs;
    refused where a token's merges are not consecutive (one score could not order them as the ranks do)."""
    order: dict[str, int] = {}
    pairs: set[tuple[str, str]] = set()
    last = None
    for merge in merges:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        piece = left + right
        if piece not in vocab:
            raise _refuse(f"a merge {left!r} + {right!r} into {piece!r}, which is not in the vocabulary")
        if piece != last:
            if piece in order:
                raise _refuse(f"the merges into {piece!r} are not consecutive, so no score orders them as the ranks do")
            order[piece] = len(order)
            last = piece
        pairs.add((left, right))
    return {piece: -1.0 - i for piece, i in order.items()}, pairs


def _check_pairs(texts: dict[str, int], skip: set[int], pairs: set[tuple[str, str]]) -> None:
    """Refuse a token llama.cpp could join from two symbols (characters or tokens) where transformers has no
    such merge; added tokens (``skip``) are cut out of the text first in both."""
    for text, i in texts.items():
        if i in skip:
            continue
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if (len(left) == 1 or left in texts) and (len(right) == 1 or right in texts) and (left, right) not in pairs:
                raise _refuse(
                    f"llama.cpp would join {left!r} and {right!r} into the token {text!r}, which the merges never do"
                )


def special_ends(tokenizer) -> tuple[bool, bool]:
    """Whether transformers adds BOS in front and EOS behind a text, found by tokenizing one both ways."""
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a")["input_ids"])
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    for head in (False, True) if bos is not None else (False,):
        for tail in (False, True) if eos is not None else (False,):
            if full == [bos] * head + plain + [eos] * tail:
                return head, tail
    raise UnsupportedModelError(
        f"the tokenizer adds {full} around {plain}; llama.cpp can add only BOS in front and EOS behind"
    )


def check_added_flags(token: dict) -> None:
    """Refuse an added token that strips the spaces beside it (``lstrip``, ``rstrip``) or matches only as a whole
    word (``single_word``): a GGUF has no place for these flags, and llama.cpp (0.3.36) then splits the text
    around the token otherwise than transformers, silently (``"a <|x|> b"`` with ``lstrip`` keeps the space as
    a token of its own)."""
    if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
        raise _refuse(
            f"the added token {token.get('content')!r} strips spaces or matches whole words, which llama.cpp does not"
        )


def _texts(vocab: dict, added: dict[int, dict]) -> dict[str, int]:
    """Every token text and its id, added tokens included; refused where llama.cpp would match an added token
    elsewhere than transformers does, or where an id has two texts."""
    texts = {str(text): int(i) for text, i in vocab.items()}
    for i, token in added.items():
        content = token["content"]
        check_added_flags(token)
        if token.get("normalized") and (" " in content or SPACE in content):
            raise _refuse(f"the added token {content!r} is matched after normalization, unlike llama.cpp")
        if texts.setdefault(content, i) != i:
            raise _refuse(f"the added token {content!r} has id {i} and the vocabulary's {texts[content]}")
    if len(set(texts.values())) != len(texts):
        raise _refuse("an id with two token texts (an added token over a different vocabulary entry)")
    return texts


def _token_list(texts: dict[str, int], added: dict[int, dict], unk, vocab_size: int) -> tuple[list, list]:
    """``(tokens, types)`` for ids ``0 .. vocab_size - 1``; an id without a token is ``[PAD{i}]`` (UNUSED), as
    llama.cpp's converter names it, and joins ``texts``."""
    by_id = {i: t for t, i in texts.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        text = by_id.get(i)
        if text is None:
            text = f"[PAD{i}]"
            if texts.setdefault(text, i) != i:
                raise _refuse(f"a token {text!r}, the name the writer gives the unused id {i}, at id {texts[text]}")
            types.append(UNUSED)
        elif i == unk:
            types.append(UNKNOWN)
        elif i in added:
            types.append(CONTROL if added[i].get("special") else USER_DEFINED)
        else:
            types.append(BYTE if BYTE_TOKEN.fullmatch(text) else NORMAL)
        tokens.append(text)
    return tokens, types


def spm_metadata(tokenizer, data: dict, vocab_size: int) -> dict[str, Any]:
    """llama.cpp's ``llama`` (SPM) tokenizer keys from a transformers tokenizer whose pipeline is ``data``."""
    model = _check_model(data)
    prefix, notes = space_prefix(data) or (False, [])
    vocab: dict[str, int] = model["vocab"]
    added = {int(t["id"]): t for t in data.get("added_tokens", [])}
    texts = _texts(vocab, added)
    top = max(texts.values(), default=-1)
    if top >= vocab_size:
        raise UnsupportedModelError(f"the tokenizer has token id {top}, past the model's vocab_size {vocab_size}")
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing:
        raise _refuse(f"byte fallback without the byte tokens {', '.join(missing[:4])} ({len(missing)} missing)")
    scores, pairs = _merge_scores(model["merges"], vocab)
    tokens, types = _token_list(texts, added, tokenizer.unk_token_id, vocab_size)
    _check_pairs(texts, set(added), pairs)
    floor = -1.0 - len(scores)  # below every merge
    bos, eos = special_ends(tokenizer)
    return {
        "model": "llama",
        "tokens": tokens,
        "token_type": types,
        "scores": [scores.get(text, floor) for text in tokens],
        "add_bos_token": bos,
        "add_eos_token": eos,
        "add_space_prefix": prefix,
        "notes": notes,
    }


def pipeline(tokenizer) -> dict:
    """The tokenizer's ``tokenizers`` pipeline as JSON (empty for a tokenizer without one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return json.loads(backend.to_str()) if backend is not None else {}
