"""The ``perplexity`` task (its options, its harness ``perplexity()`` and its ``TASK``): long-context perplexity
without full-sequence logits.

Protocol (transformers docs, "Perplexity of fixed-length models"; the long-context papers): a window of
``length`` tokens; with ``stride=None`` one window per document, its first ``length`` tokens (documents
shorter than ``length`` are left out at that length: YaRN/LongLoRA use documents of at least the target
length, truncated to it); with ``stride=k`` the window slides by ``k`` over the whole document and every
token is scored once, by the first window that predicts it, with the rest of that window as context only.

``PPL = exp(sum of token NLLs / number of scored tokens)``: token-weighted over all documents at a length
(not a mean of per-window or per-document means, as the YaRN scripts report).

Memory: at 128k tokens the float32 logits of a 32k vocabulary alone take 16.8 GB. The model's decoder is
run to hidden states (no KV cache), then the LM head, the model's logit post-processing (Gemma's final
softcapping, Cohere's ``logit_scale``, Granite's ``logits_scaling``: ``hf.head``, checked against the
model's own logits) and cross-entropy are applied to ``chunk_size`` positions at a time, so at most
``chunk_size x vocab`` logits exist at once. Records, resume, progress and the sliding-window policy are the
evaluation runner's.
"""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import RopeExtendError
from ..hf import head as hf_head
from ..hf.head import LMHead
from ..hf.reading import attn_implementation
from ..hf.window import SlidingWindowMode
from ..schema import option
from . import report, runner
from .engines import is_engine
from .records import short_hash
from .tasks.base import WINDOW_HELP, Context, Task, TextOptions, check_lengths, check_positive, options_for

CHUNK_LOGITS = 1 << 24  # logits per chunk (64 MB in float32): 512 positions of a 32k vocabulary


@dataclass(kw_only=True)
class PerplexityOptions(TextOptions):
    """The perplexity task's options: a suite's section, the subcommand's flags and ``perplexity()``'s keywords
    (of the text options only ``max_docs``: the harness takes the texts themselves)."""

    lengths: list[Any] = option(help="window lengths in tokens")
    stride: int | None = option(None, help="sliding-window step; null: one truncated window per document")
    chunk_size: int | None = option(None, help="positions per LM-head chunk (default: 16M logits / vocab)")
    sliding_window: SlidingWindowMode = option("auto", help=WINDOW_HELP)

    def __post_init__(self):
        check_lengths(self)
        check_positive(self, "stride", "chunk_size")
        if self.stride is not None and self.stride > min(self.lengths):
            raise RopeExtendError(
                f"stride {self.stride} is larger than the window length {min(self.lengths)}: tokens would be skipped"
            )


@torch.no_grad()
def window_nll(head: LMHead, ids: torch.Tensor, score_from: int, chunk_size: int | None = None) -> tuple[float, int]:
    """Sum of NLLs of ``ids[score_from:]`` given their prefixes within ``ids`` (1-D), and their count.

    ``score_from >= 1``: position ``j`` of the hidden states predicts token ``j + 1``.
    """
    n = ids.shape[0]
    if n - score_from <= 0:
        return 0.0, 0
    if head.decoder is None:  # lm_head(model) without decoder=True: there is nothing to run the ids through
        raise RopeExtendError("window_nll needs the model's decoder: take the head with lm_head(model, decoder=True)")
    hidden = head.decoder(input_ids=ids[None], use_cache=False).last_hidden_state[0]
    hidden = hidden[score_from - 1 : n - 1]
    targets = ids[score_from:]
    step = chunk_size or max(1, CHUNK_LOGITS // head.vocab_size)
    total = 0.0
    for start in range(0, targets.shape[0], step):
        logits = head.logits(hidden[start : start + step])
        total += float(F.cross_entropy(logits, targets[start : start + step], reduction="sum", ignore_index=-100))
        del logits
    return total, int(targets.shape[0])


def doc_digest(ids: Sequence[int]) -> str:
    """A short hash of a document's token ids: a record counts only for the text it was measured on."""
    return short_hash(",".join(map(str, ids)))


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


def perplexity(
    model,
    tokenizer,
    texts: Sequence[str] | Iterable[str],
    lengths: str | Iterable[Any] | None = None,
    *,
    options: PerplexityOptions | None = None,
    records: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool = True,
    run: dict[str, Any] | None = None,
    **given: Any,
) -> PerplexityResult:
    """Perplexity of ``model`` on ``texts`` at each of ``lengths`` (see the module docstring for the protocol).

    The options are ``PerplexityOptions``'s (the task's, declared once), given as keywords or as ``options=``;
    of its text options only ``max_docs`` (the texts are given). Documents are tokenized with the tokenizer's
    special tokens (a BOS where it adds one). A document shorter than a length is left out at that length
    (counted in ``.skipped``); a length no document reaches is an error.

    ``sliding_window``: ``"auto"`` (default) widens a sliding window that every layer uses (Mistral, Phi-3) to
    the longest length for the evaluation, so long context is really measured, and keeps windows that
    alternate with full-attention layers (Gemma 2 and 3); ``"full"`` widens every window; ``"keep"`` none.
    The model is restored afterwards.
    """
    if lengths is not None:
        given["lengths"] = lengths
    options = options_for(PerplexityOptions, options, given, harness="perplexity")
    lengths, stride, chunk_size, max_docs = options.lengths, options.stride, options.chunk_size, options.max_docs
    engine = is_engine(model)  # a served file: the engine scores each window (engines.EngineModel.nll)
    head = None if engine else hf_head.lm_head(model, decoder=True)
    runner.check_reachable(model, max(lengths), cache=False)  # before tokenizing the documents
    docs = _documents(tokenizer, texts, lengths, max_docs)
    if head is not None:  # a transformers model (an engine has no head to check)
        _check_head(model, head, docs)
    device = None if engine else next(model.parameters()).device

    def score(ids, score_from: int) -> tuple[float, int]:
        if head is None:  # an engine scores the window itself
            return model.nll(ids.tolist(), score_from)
        return window_nll(head, ids, score_from, chunk_size)

    def measure(job: dict) -> dict:
        ids = torch.tensor(docs[job["doc"]], device=device)
        nll, count = 0.0, 0
        for begin, end, score_from in windows(len(ids), job["length"], stride):
            w_nll, w_count = score(ids[begin:end], score_from - begin)
            nll, count = nll + w_nll, count + w_count
        return {
            "stride": stride,
            "tokens": count,
            "nll": nll,
            "perplexity": math.exp(nll / count) if count else float("nan"),
        }

    # the document's digest is part of the job: a record measured on another text (another file, another
    # tokenizer) with the same number of documents is never taken for this one's
    digests = [doc_digest(d) for d in docs]
    jobs = [{"length": n, "doc": i, "text": digests[i]} for n in lengths for i, d in enumerate(docs) if len(d) >= n]
    done = runner.run(
        model,
        task="perplexity",
        setting={"stride": stride, "docs": len(docs)},
        jobs=jobs,
        measure=measure,
        longest=max(lengths),
        records=records,
        resume=resume,
        progress=progress,
        run=run,
        sliding_window=options.sliding_window,
        unit="doc",
    )
    return _result(done, docs, lengths)


def _documents(tokenizer, texts: Iterable[str], lengths: list[int], max_docs: int | None) -> list[list[int]]:
    """The non-empty texts tokenized (special tokens included), once every length is one a document reaches."""
    texts = [t for t in texts if t and t.strip()]
    if not texts:
        raise RopeExtendError("no texts given: perplexity needs at least one non-empty document")
    docs = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts[: max_docs or None]]
    longest = max(len(d) for d in docs)
    for length in lengths:
        if length < 2:
            raise RopeExtendError(f"length {length} is too short: a window needs at least 2 tokens")
        if length > longest:
            raise RopeExtendError(
                f"length {length} cannot be reached: the longest of the {len(docs)} documents has {longest} tokens "
                f"of this tokenizer; give longer texts or lengths <= {longest}"
            )
    return docs


def _check_head(model, head: LMHead, docs: list[list[int]]) -> None:
    """The LM head against the model's own logits (``hf.head.check``), and a warning for eager attention."""
    hf_head.check(model, head, max(docs, key=len))
    if attn_implementation(getattr(model, "config", None)) == "eager":
        logging.getLogger("rope_extend").warning(
            "the model uses eager attention (L x L scores in memory); load it with attn_implementation='sdpa'"
        )


def _result(done: list[dict], docs: list[list[int]], lengths: list[int]) -> PerplexityResult:
    """The token-weighted perplexity per length from the records (every document's NLLs summed, then divided)."""
    ppl, tokens = {}, {}
    for length in lengths:
        rows = [r for r in done if r["length"] == length]
        nll, count = sum(r["nll"] for r in rows), sum(r["tokens"] for r in rows)
        ppl[length], tokens[length] = math.exp(nll / count), count
    skipped = {n: sum(1 for d in docs if len(d) < n) for n in lengths}
    return PerplexityResult(done, ppl, tokens, skipped)


# ------------------------------------------------------------------------------------------ the task
def _run(model, tokenizer, options: PerplexityOptions, context: Context) -> list[dict]:
    return perplexity(model, tokenizer, context.documents("perplexity"), options=options, **context.common()).records


def _summarize(records: list[dict]) -> dict[str, list[dict]]:
    """Per (run, length): exp(sum of NLL / sum of tokens) over the documents (token-weighted)."""
    sums: dict = defaultdict(lambda: [0.0, 0, 0])
    for r in records:
        row = sums[(report.label_of(r), r["length"])]
        row[0] += r["nll"]
        row[1] += r["tokens"]
        row[2] += 1
    return {
        "perplexity": [
            {
                "label": label,
                "length": length,
                "perplexity": math.exp(nll / tokens) if tokens else None,
                "tokens": tokens,
                "docs": docs,
            }
            for (label, length), (nll, tokens, docs) in sums.items()
        ]
    }


def _render(summary: dict) -> list[str]:
    rows = summary.get("perplexity")
    title = "Perplexity (token-weighted; lower is better)"
    return report.length_table(rows, title, report.perplexity_cell) if rows else []


def _plot(summary: dict, out: Path) -> dict[str, Path]:
    if not summary.get("perplexity"):
        return {}
    path = report.plot_lines(
        summary["perplexity"],
        "perplexity",
        out / "perplexity.png",
        title="Perplexity vs context length",
        ylabel="perplexity (log)",
        log_y=True,
    )
    return {"perplexity_plot": path}


TASK = Task(
    name="perplexity",
    help="token-weighted perplexity per length (chunked, no full logits)",
    title="Perplexity",
    options=PerplexityOptions,
    run=_run,
    summarize=_summarize,
    render=_render,
    plot=_plot,
)
