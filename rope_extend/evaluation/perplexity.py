"""Long-context perplexity without full-sequence logits.

Protocol (transformers docs, "Perplexity of fixed-length models"; the long-context papers): a window of
``length`` tokens; with ``stride=None`` one window per document, its first ``length`` tokens (documents
shorter than ``length`` are left out at that length: YaRN/LongLoRA use documents of at least the target
length, truncated to it); with ``stride=k`` the window slides by ``k`` over the whole document and every
token is scored once, by the first window that predicts it, with the rest of that window as context only.

``PPL = exp(sum of token NLLs / number of scored tokens)``: token-weighted over all documents at a length
(not a mean of per-window or per-document means, as the YaRN scripts report).

Memory: at 128k tokens the float32 logits of a 32k vocabulary alone take 16.8 GB. The model's decoder is
run to hidden states (no KV cache), then the LM head, the model's logit post-processing (Gemma's final
softcapping, Cohere's ``logit_scale``, Granite's ``logits_scaling``) and cross-entropy are applied to
``chunk_size`` positions at a time, so at most ``chunk_size x vocab`` logits exist at once.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from .. import hf
from ..errors import RopeExtendError
from .data import parse_lengths
from .records import RecordLog, run_info, setting_id

CHUNK_LOGITS = 1 << 24  # logits per chunk (64 MB in float32): 512 positions of a 32k vocabulary


@dataclass
class LMParts:
    """A causal LM split into decoder (ids -> hidden states) and head (hidden states -> float32 logits)."""

    decoder: torch.nn.Module
    head: Callable[[torch.Tensor], torch.Tensor]
    vocab_size: int


def lm_parts(model) -> LMParts:
    """Find the decoder and the head of ``model`` (a ``*ForCausalLM``, possibly inside a PEFT wrapper)."""
    if hasattr(model, "get_base_model"):  # peft.PeftModel: the wrapped *ForCausalLM
        model = model.get_base_model()
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if lm_head is None or decoder is None or decoder is model:
        raise RopeExtendError(
            f"{type(model).__name__} is not a causal language model with a separate decoder and LM head: "
            "perplexity needs an AutoModelForCausalLM"
        )
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(model, "logit_scale", None)  # Cohere multiplies the logits
    divide = getattr(config, "logits_scaling", None)  # Granite divides them

    def head(hidden: torch.Tensor) -> torch.Tensor:
        # the same operations in the same dtype as the model's own forward, upcast last (as its loss does)
        logits = lm_head(hidden)
        if scale is not None and not isinstance(scale, torch.nn.Module):
            logits = logits * scale
        if divide is not None:
            logits = logits / divide
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits.float()

    return LMParts(decoder, head, int(lm_head.weight.shape[0]))


@torch.no_grad()
def check_head(model, parts: LMParts, ids: Sequence[int]) -> None:
    """Compare decoder + head with the model's own logits on a few tokens: a family that transforms its
    logits in a way ``lm_parts`` does not know fails here instead of giving wrong perplexities."""
    probe = torch.tensor([list(ids[:16])], device=next(model.parameters()).device)
    ref = model(input_ids=probe, use_cache=False).logits.float()
    ours = parts.head(parts.decoder(input_ids=probe, use_cache=False).last_hidden_state)
    if ours.shape != ref.shape or not torch.allclose(ours, ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()) + 1e-6):
        raise RopeExtendError(
            f"{type(model).__name__} computes its logits differently from its decoder + LM head (an unknown logit "
            "scaling?): the chunked perplexity would be wrong for it"
        )


@torch.no_grad()
def window_nll(parts: LMParts, ids: torch.Tensor, score_from: int, chunk_size: int | None = None) -> tuple[float, int]:
    """Sum of NLLs of ``ids[score_from:]`` given their prefixes within ``ids`` (1-D), and their count.

    ``score_from >= 1``: position ``j`` of the hidden states predicts token ``j + 1``.
    """
    n = ids.shape[0]
    if n - score_from <= 0:
        return 0.0, 0
    hidden = parts.decoder(input_ids=ids[None], use_cache=False).last_hidden_state[0]
    hidden = hidden[score_from - 1: n - 1]
    targets = ids[score_from:]
    step = chunk_size or max(1, CHUNK_LOGITS // parts.vocab_size)
    total = 0.0
    for start in range(0, targets.shape[0], step):
        logits = parts.head(hidden[start: start + step])
        total += float(F.cross_entropy(logits, targets[start: start + step], reduction="sum", ignore_index=-100))
        del logits
    return total, int(targets.shape[0])


def windows(n_tokens: int, length: int, stride: int | None) -> list[tuple[int, int, int]]:
    """``(begin, end, score_from)`` for each window. With ``stride < length`` every token from index 1 on is
    scored exactly once; with ``stride == length`` (disjoint windows, as in transformers' docs) the first token
    of each window has no context inside it and is not scored."""
    if stride is None:
        return [(0, min(length, n_tokens), 1)]
    out, prev_end, begin = [], 0, 0
    while True:
        end = min(begin + length, n_tokens)
        out.append((begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end >= n_tokens:
            return out
        begin += stride


@dataclass
class PerplexityResult:
    """``perplexity``: length -> token-weighted perplexity; ``records``: one per (length, document)."""

    records: list[dict]
    perplexity: dict[int, float]
    tokens: dict[int, int]
    skipped: dict[int, int]  # documents shorter than the length, left out


def perplexity(model, tokenizer, texts: Sequence[str] | Iterable[str], lengths: str | Iterable[Any], *,
               stride: int | None = None, max_docs: int | None = None, chunk_size: int | None = None,
               records: str | os.PathLike | None = None, resume: bool = False, progress: bool = True,
               run: dict[str, Any] | None = None, sliding_window: str = "auto") -> PerplexityResult:
    """Perplexity of ``model`` on ``texts`` at each of ``lengths`` (see the module docstring for the protocol).

    Documents are tokenized with the tokenizer's special tokens (a BOS where it adds one). A document shorter
    than a length is left out at that length (counted in ``.skipped``); a length no document reaches is an error.

    ``sliding_window``: ``"auto"`` (default) widens a sliding window that every layer uses (Mistral, Phi-3) to
    the longest length for the evaluation, so long context is really measured, and keeps windows that
    alternate with full-attention layers (Gemma 2 and 3); ``"full"`` widens every window; ``"keep"`` none.
    The model is restored afterwards.
    """
    from tqdm.auto import tqdm

    hf.check_sliding_window_mode(sliding_window)
    lengths = parse_lengths(lengths)
    if stride is not None and (isinstance(stride, bool) or not isinstance(stride, int) or stride < 1):
        raise RopeExtendError(f"stride must be a positive integer or None (one window per document), got {stride!r}")
    if stride is not None and stride > min(lengths):
        raise RopeExtendError(f"stride {stride} is larger than the window length {min(lengths)}: tokens would be skipped")
    parts = lm_parts(model)
    texts = [t for t in texts if t and t.strip()]
    if not texts:
        raise RopeExtendError("no texts given: perplexity needs at least one non-empty document")
    docs = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts[: max_docs or None]]
    longest = max(len(d) for d in docs)
    check_head(model, parts, max(docs, key=len))
    for length in lengths:
        if length < 2:
            raise RopeExtendError(f"length {length} is too short: a window needs at least 2 tokens")
        if length > longest:
            raise RopeExtendError(
                f"length {length} cannot be reached: the longest of the {len(docs)} documents has {longest} tokens "
                f"of this tokenizer; give longer texts or lengths <= {longest}"
            )
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "eager":
        import logging
        logging.getLogger("rope_extend").warning(
            "the model uses eager attention (L x L scores in memory); load it with attn_implementation='sdpa'")

    with hf.sliding_window_widened(model, max(lengths), sliding_window) as widened:
        info = run_info(model, run)
        setting = {**info, "task": "perplexity", "stride": stride, "docs": len(docs)}
        if widened:
            setting["sliding_window"] = "widened"  # a different measurement: records must not be mixed
        sid = setting_id(setting)
        log = RecordLog(records, resume=resume)
        device = next(model.parameters()).device
        jobs = [(n, i) for n in lengths for i, d in enumerate(docs) if len(d) >= n]
        done: list[dict] = []
        bar = tqdm(jobs, desc=f"perplexity {info.get('label') or info['method']}", unit="doc", disable=not progress)
        for length, index in bar:
            bar.set_postfix(length=length)
            found = log.find({"setting": sid, "length": length, "doc": index})
            if found is not None:
                done.append(found)
                continue
            ids = torch.tensor(docs[index], device=device)
            nll, count = 0.0, 0
            for begin, end, score_from in windows(len(ids), length, stride):
                w_nll, w_count = window_nll(parts, ids[begin:end], score_from - begin, chunk_size)
                nll, count = nll + w_nll, count + w_count
            done.append(log.add({"task": "perplexity", **info, "setting": sid, "length": length, "doc": index,
                                 "stride": stride, "tokens": count, "nll": nll,
                                 "perplexity": math.exp(nll / count) if count else float("nan")}))
    ppl, tokens = {}, {}
    for length in lengths:
        rows = [r for r in done if r["length"] == length]
        nll, count = sum(r["nll"] for r in rows), sum(r["tokens"] for r in rows)
        ppl[length], tokens[length] = math.exp(nll / count), count
    skipped = {n: sum(1 for d in docs if len(d) < n) for n in lengths}
    return PerplexityResult(done, ppl, tokens, skipped)
