"""Evaluate what is served: a GGUF file run by llama.cpp, measured by the same harnesses as a transformers model.

    from rope_extend.evaluation import passkey, perplexity
    from rope_extend.evaluation.engines import LlamaCppModel

    served = LlamaCppModel("model-yarn.gguf", n_ctx=16384, method="yarn", factor=4)
    passkey(served, tokenizer, "8k,16k", trials=5)          # the same prompts as for the transformers model
    perplexity(served, tokenizer, texts, "8k,16k")

The harnesses build every prompt and window with the transformers tokenizer, exactly as for the transformers
model, and hand the engine token ids; only the forward pass and greedy decoding run in llama.cpp. So a
difference between the two backends is a difference in what the model computes, never in the prompts.

- ``greedy``: llama.cpp decodes the prompt with logits asked for at its last position only, then one token at a
  time, choosing the argmax of its float32 logits (no sampler), and stops after the tokenizer's end-of-sequence
  token, as transformers' greedy search.
- ``nll``: the window is decoded in batches of ``n_batch`` tokens with logits asked for at the scored positions
  only, and each batch's logits are reduced (log-softmax in float64, ``REDUCE_ROWS`` rows at a time) before the
  next is decoded, so at most ``n_batch x vocab`` logits exist at once (``Llama(logits_all=True)`` would hold
  ``n_ctx x vocab``: 6.4 GB at 32k tokens of a 49k vocabulary).
- Settings (measured by eval/benchmarks/engine_speed.py, docs/benchmarks.md): flash attention on (it changes
  no answer and perplexity by less than 1e-4), every core this process may use for prompts as for single steps
  (llama-cpp-python would take half the machine's cores for steps, all of them for prompts, ignoring ``threads``).
- Identity: a record names the file's SHA-256 (``model_digest``) and the engine, so records of the served
  file are never mixed with the transformers model's (whose digest is of its weights).

Runs llama-cpp-python 0.3.36 (llama.cpp 0c1e57098, what ``rope_extend.export`` writes for); it uses the
``Llama`` object's batch and context wrappers, which that version exposes as ``_batch`` and ``_ctx``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import RopeExtendError
from ..io import sha256
from ..methods._common import check_int
from ..version import __version__

DIGEST_DIGITS = 16  # of the file's SHA-256 (io.sha256), in its records: enough to tell two files apart

# the extra that installs llama-cpp-python 0.3.36 (pyproject.toml; .ci/run builds the same from its source)
INSTALL = "pip install 'rope-extend[llama]', which builds llama.cpp from source in minutes"

# How the harnesses drive llama.cpp (eval/benchmarks/engine_speed.py --variants, docs/benchmarks.md). 2048-token
# batches and micro-batches: a quarter of the meetings of llama.cpp's threads per token (one after every operation
# of every micro-batch), 0.68-0.86 of 512's CPU time (SmolLM2, 2 threads, 2k and 8k). A batch whose logits are all
# asked for holds n_batch x vocab float32 logits in llama.cpp (2048 x 49152 x 4 = 403 MB for SmolLM2, 1.05 GB for
# Llama 3's 128k vocabulary); they are reduced REDUCE_ROWS at a time, in a float64 copy of 512 x vocab x 8 bytes.
N_BATCH = 2048
N_UBATCH = 2048
REDUCE_ROWS = 512
FLASH_ATTN = True
KV_TYPE = "f16"  # llama.cpp's own default for its KV cache
KV_TYPES = {"f32": 0, "f16": 1}  # GGML_TYPE_F32, GGML_TYPE_F16 (ggml.h): the cache types its CPU attention reads


def default_threads() -> int:
    """The cores this process may run on (its CPU affinity): llama-cpp-python's own default is half of
    ``multiprocessing.cpu_count()`` for one-token steps, every core of the machine for batches."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class EngineModel:
    """What the evaluation harnesses ask of a model served by an engine (instead of a transformers model)."""

    engine = ""
    n_ctx = 0

    def info(self) -> dict[str, Any]:
        """The record fields that identify the served model (``run_info`` for a transformers model)."""
        raise NotImplementedError

    def greedy(self, input_ids: Sequence[int], max_new_tokens: int, eos: int | None) -> list[int]:
        """The greedy continuation of ``input_ids``: at most ``max_new_tokens`` ids, ending with ``eos`` if it
        was produced."""
        raise NotImplementedError

    def nll(self, ids: Sequence[int], score_from: int) -> tuple[float, int]:
        """Sum of ``-log p(ids[j] | ids[:j])`` for ``j >= score_from`` (``>= 1``), and their count."""
        raise NotImplementedError

    def close(self) -> None:
        """Free the engine (its weights, its cache)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def check_reachable(self, length: int, generated: int = 0) -> None:
        if length + generated > self.n_ctx:
            raise RopeExtendError(
                f"length {length} (+{generated} generated) is past the {self.n_ctx}-token context this {self.engine} "
                f"model was opened with: open it with n_ctx >= {length + generated}"
            )


def is_engine(model) -> bool:
    return isinstance(model, EngineModel)


class LlamaCppModel(EngineModel):
    """A GGUF file run by llama.cpp on the CPU.

    ``n_ctx``: the longest prompt plus generated tokens it will be asked for (llama.cpp allocates its KV cache
    for it up front). ``method``, ``factor`` and ``original_length`` are what the file was exported with
    (``ExportResult.method``); they label records, the file's digest identifies them. ``threads`` (default: every
    core this process may run on) runs prompts and single steps alike; ``n_batch`` positions are fed per call,
    cut by llama.cpp into micro-batches of ``n_ubatch``; ``flash_attn`` is llama.cpp's fused attention;
    ``kv_type`` the type its KV cache keeps keys and values in (``f16`` or ``f32``). On cores
    shared with other busy work ``threads=1`` can be faster: llama.cpp's threads meet at a barrier after every
    operation, and one of them descheduled holds up the other.
    """

    engine = "llama.cpp"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        n_ctx: int,
        method: str = "served",
        factor: float = 1.0,
        original_length: int | None = None,
        threads: int | None = None,
        n_batch: int = N_BATCH,
        n_ubatch: int = N_UBATCH,
        flash_attn: bool = FLASH_ATTN,
        kv_type: str = KV_TYPE,
    ):
        try:
            import llama_cpp  # noqa: PLC0415 - optional: only this backend needs it
        except ImportError as exc:
            raise RopeExtendError(f"evaluating a GGUF file needs llama-cpp-python: {INSTALL}") from exc
        self.path = Path(path)
        if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 1:
            raise RopeExtendError(f"n_ctx must be a positive integer, got {n_ctx!r}")
        threads = default_threads() if threads is None else check_int("threads", threads)
        check_int("n_batch", n_batch)
        if check_int("n_ubatch", n_ubatch) > n_batch:  # llama-cpp-python would cut it to n_batch without a word
            raise RopeExtendError(f"n_ubatch ({n_ubatch}) must be <= n_batch ({n_batch}): a batch is cut into these")
        if not isinstance(flash_attn, bool):
            raise RopeExtendError(f"flash_attn must be True or False, got {flash_attn!r}")
        if not isinstance(kv_type, str) or kv_type not in KV_TYPES:
            raise RopeExtendError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
        self.n_ctx = n_ctx
        # a batch never holds more than the context (llama-cpp-python's own bound)
        self.settings: dict[str, Any] = {
            "threads": threads,
            "n_batch": min(n_batch, n_ctx),
            "n_ubatch": min(n_ubatch, n_ctx),
        }
        self.settings.update(flash_attn=flash_attn, kv_type=kv_type)
        self.n_batch = self.settings["n_batch"]
        self.labels = {"method": method, "factor": float(factor), "original_length": original_length}
        # a regular file or one line naming what is there (a pipe named like a GGUF is refused, not waited on)
        self.digest = sha256(self.path, fix="give the path of a GGUF file")[:DIGEST_DIGITS]
        # n_threads_batch too: llama-cpp-python runs every batch of more than one token (all of a prefill) on
        # multiprocessing.cpu_count() threads whatever n_threads says
        self._llm = llama_cpp.Llama(
            str(self.path),
            n_ctx=n_ctx,
            n_batch=self.n_batch,
            n_ubatch=self.settings["n_ubatch"],
            n_threads=threads,
            n_threads_batch=threads,
            flash_attn=flash_attn,
            type_k=KV_TYPES[kv_type],
            type_v=KV_TYPES[kv_type],
            logits_all=False,
            verbose=False,
        )
        self.vocab = self._llm.n_vocab()
        self.version = llama_cpp.__version__

    def close(self) -> None:
        self._llm.close()

    def info(self) -> dict[str, Any]:
        return {
            "model": str(self.path),
            "model_digest": self.digest,
            "rope_extend": __version__,
            "engine": f"llama.cpp (llama-cpp-python {self.version})",
            **self.labels,
            "params": {},
        }

    # ------------------------------------------------------------------------------------------ decoding
    def _batches(self, ids: Sequence[int], want_from: int) -> Iterator[tuple[int, np.ndarray]]:
        """Feed ``ids`` at positions ``0..`` (after clearing the cache), ``n_batch`` at a time, asking for logits at
        the positions ``>= want_from`` only; per batch that has some, yield the first such position and their logits
        ``[rows, vocab]`` (float32, a view of llama.cpp's buffer: valid until the next batch).

        llama.cpp computes logits only where asked: the output projection of a 49k vocabulary costs as much as a
        fifth of a small model's layers, and a passkey prompt needs it at one position of thousands."""
        llm = self._llm
        llm._ctx.kv_cache_clear()
        llm.n_tokens = 0
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start : start + self.n_batch]
            llm._batch.set_batch(batch=chunk, n_past=start, logits_all=False)  # positions, sequence 0, last row
            first = max(want_from, start)
            for i in range(first - start, len(chunk)):
                llm._batch.batch.logits[i] = True
            llm._ctx.decode(llm._batch)
            rows = start + len(chunk) - first
            if rows > 0:
                yield first, np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(rows, self.vocab))

    def _step(self, token: int, position: int) -> np.ndarray:
        """One token decoded after the cached ones: its logits ``[vocab]``."""
        llm = self._llm
        llm._batch.set_batch(batch=[token], n_past=position, logits_all=False)
        llm._ctx.decode(llm._batch)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(self.vocab,))

    def greedy(self, input_ids: Sequence[int], max_new_tokens: int, eos: int | None) -> list[int]:
        self.check_reachable(len(input_ids), max_new_tokens)
        *_, (_, rows) = self._batches(input_ids, want_from=len(input_ids) - 1)
        last = rows[-1]
        out: list[int] = []
        for step in range(max_new_tokens):
            token = int(np.argmax(last))
            out.append(token)
            if token == eos or step == max_new_tokens - 1:
                break
            last = self._step(token, len(input_ids) + step)
        return out

    def nll(self, ids: Sequence[int], score_from: int) -> tuple[float, int]:
        n = len(ids)
        if n - score_from <= 0:
            return 0.0, 0
        self.check_reachable(n)
        total = 0.0
        # position j predicts ids[j + 1]: positions score_from - 1 .. n - 2 are scored and the last token is never
        # fed; each batch's rows are reduced as they come (log-softmax in float64), never an n x vocab array
        for first, batch in self._batches(ids[: n - 1], want_from=score_from - 1):
            for at in range(0, len(batch), REDUCE_ROWS):
                logits = batch[at : at + REDUCE_ROWS].astype(np.float64)
                logits -= logits.max(-1, keepdims=True)
                log_z = np.log(np.exp(logits).sum(-1))
                targets = np.asarray(ids[first + at + 1 : first + at + 1 + len(logits)])
                total += float((log_z - logits[np.arange(len(targets)), targets]).sum())
        if not math.isfinite(total):
            raise RopeExtendError(f"llama.cpp gave non-finite logits for a {n}-token window of {self.path}")
        return total, n - score_from
