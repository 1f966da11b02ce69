"""Evaluate what is served: a GGUF file run by llama.cpp, measured by the same harnesses as a transformers model.

    from rope_extend.evaluation import passkey, perplexity
    from rope_extend.evaluation.engines import LlamaCppModel

    served = LlamaCppModel("model-yarn.gguf", n_ctx=16384, method="yarn", factor=4)
    passkey(served, tokenizer, "8k,16k", trials=5)          # the same prompts as for the transformers model
    perplexity(served, tokenizer, texts, "8k,16k")

The harnesses build every prompt and window with the transformers tokenizer, exactly as for the transformers
model, and hand the engine token ids; only the forward pass and greedy decoding run in llama.cpp. So a
difference between the two backends is a difference in what the model computes, never in the prompts.

- ``greedy``: llama.cpp decodes the prompt, then one token at a time, choosing the argmax of its float32
  logits (no sampler), and stops after the tokenizer's end-of-sequence token, as transformers' greedy search.
- ``nll``: the window is decoded in batches of ``n_batch`` tokens with logits requested for every position,
  so at most ``n_batch x vocab`` logits exist at once (``Llama(logits_all=True)`` would hold ``n_ctx x vocab``:
  6.4 GB at 32k tokens of a 49k vocabulary); log-softmax in float64.
- Identity: a record names the file's SHA-256 (``model_digest``) and the engine, so records of the served
  file are never mixed with the transformers model's (whose digest is of its weights).

Runs llama-cpp-python 0.3.36 (llama.cpp 0c1e57098, what ``rope_extend.export`` writes for); it uses the
``Llama`` object's batch and context wrappers, which that version exposes as ``_batch`` and ``_ctx``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import RopeExtendError
from ..io import sha256
from ..version import __version__

DIGEST_DIGITS = 16  # of the file's SHA-256 (io.sha256), in its records: enough to tell two files apart

# the extra that installs llama-cpp-python 0.3.36 (pyproject.toml; .ci/run builds the same from its source)
INSTALL = "pip install 'rope-extend[llama]', which builds llama.cpp from source in minutes"


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
    (``ExportResult.method``); they label records, the file's digest identifies them. ``threads`` defaults to
    every core.
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
        n_batch: int = 512,
    ):
        try:
            import llama_cpp  # noqa: PLC0415 - optional: only this backend needs it
        except ImportError as exc:
            raise RopeExtendError(f"evaluating a GGUF file needs llama-cpp-python: {INSTALL}") from exc
        self.path = Path(path)
        if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 1:
            raise RopeExtendError(f"n_ctx must be a positive integer, got {n_ctx!r}")
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.labels = {"method": method, "factor": float(factor), "original_length": original_length}
        # a regular file or one line naming what is there (a pipe named like a GGUF is refused, not waited on)
        self.digest = sha256(self.path, fix="give the path of a GGUF file")[:DIGEST_DIGITS]
        threads = threads or os.cpu_count() or 1
        self._llm = llama_cpp.Llama(
            str(self.path), n_ctx=n_ctx, n_batch=n_batch, n_threads=threads, logits_all=False, verbose=False
        )
        self.vocab = self._llm.n_vocab()
        self.version = llama_cpp.__version__

    def close(self) -> None:
        self._llm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

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
    def _decode(self, ids: Sequence[int], start: int, logits: bool) -> np.ndarray:
        """Feed ``ids`` at positions ``start..``; with ``logits`` return their logits ``[len(ids), vocab]``
        (float32), else only the last row ``[1, vocab]``."""
        llm = self._llm
        rows = []
        for i in range(0, len(ids), self.n_batch):
            chunk = list(ids[i : i + self.n_batch])
            llm._batch.set_batch(batch=chunk, n_past=start + i, logits_all=logits)
            llm._ctx.decode(llm._batch)
            n = len(chunk) if logits else 1
            flat = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n * self.vocab,))
            rows.append(flat.reshape(n, self.vocab).copy())
        if not logits:
            return rows[-1]
        return np.concatenate(rows)

    def _clear(self) -> None:
        self._llm._ctx.kv_cache_clear()
        self._llm.n_tokens = 0

    def greedy(self, input_ids: Sequence[int], max_new_tokens: int, eos: int | None) -> list[int]:
        self.check_reachable(len(input_ids), max_new_tokens)
        self._clear()
        last = self._decode(input_ids, 0, logits=False)
        out: list[int] = []
        for step in range(max_new_tokens):
            token = int(np.argmax(last[-1]))
            out.append(token)
            if token == eos or step == max_new_tokens - 1:
                break
            last = self._decode([token], len(input_ids) + step, logits=False)
        return out

    def nll(self, ids: Sequence[int], score_from: int) -> tuple[float, int]:
        n = len(ids)
        if n - score_from <= 0:
            return 0.0, 0
        self.check_reachable(n)
        self._clear()
        logits = self._decode(ids, 0, logits=True)[score_from - 1 : n - 1].astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        log_z = np.log(np.exp(logits).sum(-1))
        targets = np.asarray(ids[score_from:])
        total = float((log_z - logits[np.arange(len(targets)), targets]).sum())
        if not math.isfinite(total):
            raise RopeExtendError(f"llama.cpp gave non-finite logits for a {n}-token window of {self.path}")
        return total, len(targets)
