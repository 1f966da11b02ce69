"""Training-free extension in attention: Self-Extend, Dual Chunk Attention, ReRoPE, leaky ReRoPE; log-n.

These methods keep plain RoPE frequencies and change which positions a query and a key are rotated to, so
every relative position the model sees stays inside its trained length ``L``. Query at ``i``, key at
``j <= i``; the logit is ``q . R(qpos - kpos) k`` with RoPE's own frequencies. Each method splits the pairs
into a few *kinds*; within a kind the query position depends on ``i`` only and the key position on ``j``
only, so attention is computed per kind on re-rotated queries and keys and the parts are merged by their
log-sum-exp (``hf.attention``).

- ``self_extend`` (Jin et al. 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without Tuning"):
  neighbour window ``W``, group size ``G``. ``i - j < W``: positions ``i`` and ``j`` (kind ``near``);
  otherwise query ``i // G + W - W // G`` and key ``j // G`` (kind ``far``). Usable length ``(L - W) G + W``.
- ``dual_chunk`` (An et al. 2024, "Training-Free Long-Context Scaling of Large Language Models", as the
  authors' ChunkLlama code computes it): ``chunk_size`` ``C``, ``local_window`` ``w``, chunk length
  ``s = C - w``, chunk ``i // s``. Key position ``j mod s``; query position ``i mod s`` for a key in the same
  chunk (``intra``), ``min(i mod s + s, C)`` in the previous chunk (``successive``), ``min(2s - 1, C)`` in
  any chunk before (``inter``). Every relative position stays ``<= C < L``; no length limit. Its temperature
  multiplies cos and sin by ``1 + t ln s`` (``DualChunkParams``).
- ``rerope`` (Su 2023, "Rectified Rotary Position Embeddings"): relative position ``min(i - j, w)``: far
  pairs use query ``w`` and key ``0``. ``leaky_rerope``: beyond ``w`` the relative position grows with
  slope ``1/k``: ``w + (i - j - w) / k`` (query ``w + (i - w) / k``, key ``j / k``).
- log-n temperature (``logn=True`` with any method; Qwen-1 ``use_logn_attn``, also in ReRoPE): the query
  at position ``p`` is multiplied by ``max(1, ln(p + 1) / ln L)``.

A model that ships a rope scaling (Llama 3.1's ``llama3``): the methods replace it with plain RoPE by default.
With ``keep_shipped=True`` they re-rotate with the shipped frequencies and ``L`` here is the shipped context
``C``: STRING's authors' rule (``methods.string``). The other authors' code differs: Self-Extend's
(datamllab/LongLM) re-rotates with the model's own rotary module, so whatever it ships, with ``L`` the
pretraining window in its reach ``(L - W) G + W``; ChunkLlama computes plain frequencies itself and takes
``chunk_size`` from the pretraining length it is given (its vLLM config for Llama 3.1: 8192).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import RopeExtendError
from ._common import MAX_ATTENTION_FACTOR, TOO_HOT, Geometry, Method, check_int, check_number, rope_frequencies

Pass = tuple[str, int, int, bool]  # (kind, first key position, end key position, every pair in the kind)


def logn_scale(positions: torch.Tensor, original_max_position_embeddings: int) -> torch.Tensor:
    """``max(1, ln(p + 1) / ln L)`` for query positions ``p`` (float32)."""
    p = positions.to(torch.float32).clamp(min=0)
    return (torch.log1p(p) / math.log(original_max_position_embeddings)).clamp(min=1.0)


# ----------------------------------------------------------------------------------------------- rules
class Rules:
    """The position rules of one method, resolved against ``L``: integer parameters, no tensors kept."""

    kinds: tuple[str, ...] = ()

    def query_position(self, kind: str, i: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def key_position(self, kind: str, j: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def run_length(self) -> int | None:
        """``key_position(j) - j`` is constant over each run of this many keys from 0 (Dual Chunk's chunks); None:
        no such runs. With runs, a few queries over many keys turn the queries once per run instead of every key."""
        return None

    def key_group(self, kind: str) -> str | None:
        """Kinds with the same group share key positions; None: the kind keeps the true positions of queries
        and keys (no rotation)."""
        return kind

    def moves_keys(self, kind: str) -> bool:
        """Whether ``key_position(kind, j)`` differs from ``j`` (False: the keys stay where they are, only the
        queries move)."""
        return self.key_group(kind) is not None

    def region(self, kind: str, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Whether the pairs ``(i, j)`` (broadcast, ``j <= i`` assumed) belong to ``kind``."""
        raise NotImplementedError

    def blocks(self, start: int, end: int, size: int) -> list[tuple[int, int]]:
        """Query positions ``start .. end-1`` in blocks of at most ``size``."""
        return [(a, min(a + size, end)) for a in range(start, end, size)]

    def passes(self, a: int, b: int, first: int) -> list[Pass]:
        """The key ranges of the query block ``a .. b-1`` (keys from position ``first``), per kind."""
        raise NotImplementedError


class _Windowed(Rules):
    """Two kinds split at the window ``w``: ``near`` (``i - j < w``, true positions) and ``far``."""

    kinds = ("near", "far")

    def __init__(self, window: int):
        self.window = window

    def key_group(self, kind):
        return None if kind == "near" else kind

    def region(self, kind, i, j):
        near = (i - j) < self.window
        return near if kind == "near" else ~near

    def passes(self, a, b, first):
        """Far keys up to ``a - w`` are far from every query of the block, near keys start at ``a - w + 1``, and
        far keys end at ``b - 1 - w``. The far keys ``a - w .. b - 1 - w`` are one masked pass: a causal square
        over the block's rows (row ``t`` sees ``t + 1`` of them), which the CPU kernel runs with its causal
        skipping; the near pass starts with the mirror square. A one-row block has no masked far pass."""
        w = self.window
        split = max(first, a - w + (b - a == 1))
        edge = max(first, a - w + 1)
        out: list[Pass] = []
        if split > first:
            out.append(("far", first, split, True))
        if b - w > split:
            out.append(("far", split, b - w, False))
        if b > edge:
            out.append(("near", edge, b, False))
        return out

    def _far_query(self, i):
        """The far pass's query position of slot ``i`` (each rule its own)."""
        raise NotImplementedError

    def _far_key(self, j):
        """The far pass's key position of slot ``j`` (each rule its own)."""
        raise NotImplementedError

    def query_position(self, kind, i):
        return i if kind == "near" else self._far_query(i)

    def key_position(self, kind, j):
        return j if kind == "near" else self._far_key(j)


class SelfExtendRules(_Windowed):
    def __init__(self, group_size: int, window: int):
        super().__init__(window)
        self.group_size = group_size

    def _far_query(self, i):
        g, w = self.group_size, self.window
        return torch.div(i, g, rounding_mode="floor") + (w - w // g)

    def _far_key(self, j):
        return torch.div(j, self.group_size, rounding_mode="floor")


class ReRopeRules(_Windowed):
    def __init__(self, window: int, k: float | None = None):
        super().__init__(window)
        self.k = k  # None: plain ReRoPE (far relative position exactly w)

    def _far_query(self, i):
        if self.k is None:
            return torch.full_like(i, self.window)
        return self.window + (i.to(torch.float64) - self.window) / self.k

    def _far_key(self, j):
        if self.k is None:
            return torch.zeros_like(j)
        return j.to(torch.float64) / self.k


class DualChunkRules(Rules):
    kinds = ("intra", "successive", "inter")

    def __init__(self, chunk_size: int, local_window: int):
        self.chunk_size = chunk_size
        self.local_window = local_window
        self.chunk_len = chunk_size - local_window

    def query_position(self, kind, i):
        s, c = self.chunk_len, self.chunk_size
        if kind == "intra":
            return torch.remainder(i, s)
        if kind == "successive":
            return (torch.remainder(i, s) + s).clamp(max=c)
        return torch.full_like(i, min(2 * s - 1, c))

    def key_position(self, kind, j):
        return torch.remainder(j, self.chunk_len)

    @property
    def run_length(self) -> int:
        return self.chunk_len  # key j at j mod s: moved by -s floor(j / s), constant over a chunk

    def key_group(self, kind):
        return "chunk"  # one key position for every kind

    def region(self, kind, i, j):
        gap = torch.div(i, self.chunk_len, rounding_mode="floor") - torch.div(j, self.chunk_len, rounding_mode="floor")
        if kind == "intra":
            return gap == 0
        if kind == "successive":
            return gap == 1
        return gap >= 2

    def blocks(self, start, end, size):
        out, s = [], self.chunk_len
        a = start
        while a < end:
            b = min(a + size, end, (a // s + 1) * s)  # a block never crosses a chunk boundary
            out.append((a, b))
            a = b
        return out

    def passes(self, a, b, first):
        s = self.chunk_len
        start = (a // s) * s  # the block's chunk
        out: list[Pass] = []
        if start - s > first:
            out.append(("inter", first, start - s, True))
        if start > first:
            out.append(("successive", max(first, start - s), start, True))
        if a > max(first, start):
            out.append(("intra", max(first, start), a, True))
        out.append(("intra", max(first, a), b, False))
        return out


# ----------------------------------------------------------------------------------------------- params
def _window(name: str, value, length: int, default: int) -> int:
    value = default if value is None else value
    check_int(name, value, minimum=1)
    if value >= length:
        raise RopeExtendError(f"{name} must be < the original length L={length}, got {value}")
    return value


@dataclass(frozen=True)
class SelfExtendParams:
    """``group_size`` G >= 1; ``window`` W (neighbour window, default L/4) in ``[1, L)``."""

    group_size: int = 8
    window: int | None = None
    USABLE = ("(L - window) * group_size + window", "raise group_size or lower the factor")

    def __post_init__(self):
        check_int("group_size", self.group_size, minimum=1)
        if self.window is not None:
            check_int("window", self.window, minimum=1)

    def rules(self, length: int) -> SelfExtendRules:
        window = _window("window", self.window, length, max(1, length // 4))
        if self.group_size > 1 and window < self.group_size:
            raise RopeExtendError(f"window must be >= group_size ({self.group_size}), got {window}")
        return SelfExtendRules(self.group_size, window)

    def usable_length(self, length: int) -> int:
        """``(L - W) G + W``: the longest sequence whose far positions stay below ``L``."""
        rules = self.rules(length)
        return (length - rules.window) * rules.group_size + rules.window


DCA_TEMPERATURE = 0.05  # ChunkLlama's chunkllama_attn_replace.py


@dataclass(frozen=True)
class DualChunkParams:
    """``chunk_size`` C (default 3L/4) in ``[2, L)``; ``local_window`` w (default L/16) in ``[1, C)``;
    ``temperature`` t >= 0 (default 0.05).

    The temperature multiplies cos and sin by ``m = 1 + t ln s`` (queries and keys, so every logit by ``m^2``)
    where ``s = n / L`` is the factor. The authors' code (ChunkLlama, ``chunkllama_attn_replace.py``) does this
    with ``t = 0.05`` and ``n`` the longest sequence it has seen; their comment says the paper's reported
    results did not use it, so ``temperature=0`` is the paper's DCA. ``t = 0.1`` is YaRN's attention factor:
    DCA with YaRN as Qwen2.5-1M is served (vLLM's dual-chunk attention scales keys and the softmax scale by
    ``0.1 ln(n / L) + 1`` with ``n`` the request's length; RoPE frequencies unchanged), and the authors'
    ``flash_decoding_chunkllama.py``. Here ``n`` is the target length ``factor x L`` fixed at patch time, so
    generation with a cache equals generation without; it matches those codes for a sequence of that length.
    Without a factor (``s = 1``) the temperature has no effect.
    """

    chunk_size: int | None = None
    local_window: int | None = None
    temperature: float = DCA_TEMPERATURE
    UNBOUNDED: ClassVar[bool] = True  # every relative position stays <= C < L: no length limit

    def __post_init__(self):
        if self.chunk_size is not None:
            check_int("chunk_size", self.chunk_size, minimum=2)
        if self.local_window is not None:
            check_int("local_window", self.local_window, minimum=1)
        check_number("temperature", self.temperature, minimum=0.0)

    def attention_factor(self, factor: float) -> float:
        """``m = 1 + temperature * ln(factor)`` on cos and sin; at most ``MAX_ATTENTION_FACTOR``."""
        m = 1.0 + float(self.temperature) * math.log(factor)
        if m > MAX_ATTENTION_FACTOR:
            most = (MAX_ATTENTION_FACTOR - 1.0) / math.log(factor)
            raise RopeExtendError(
                f"temperature={self.temperature!r} at factor {factor:g} multiplies cos and sin by {m:.4g} (every logit "
                f"by its square); allowed: temperature <= {most:.4g} here, a multiplier of at most "
                f"{MAX_ATTENTION_FACTOR:g} ({TOO_HOT})"
            )
        return m

    def rules(self, length: int) -> DualChunkRules:
        chunk = _window("chunk_size", self.chunk_size, length, max(2, 3 * length // 4))
        local = max(1, length // 16) if self.local_window is None else self.local_window
        if local >= chunk:
            raise RopeExtendError(f"local_window must be < chunk_size ({chunk}), got {local}")
        return DualChunkRules(chunk, local)


@dataclass(frozen=True)
class ReRopeParams:
    """``window`` w (default L/4) in ``[1, L)``."""

    window: int | None = None
    # every relative position stays <= w < L: no length limit (generate's max-length reminder is dropped)
    UNBOUNDED: ClassVar[bool] = True

    def __post_init__(self):
        if self.window is not None:
            check_int("window", self.window, minimum=1)

    def rules(self, length: int) -> ReRopeRules:
        return ReRopeRules(_window("window", self.window, length, max(1, length // 4)))


@dataclass(frozen=True)
class LeakyReRopeParams(ReRopeParams):
    """``window`` w as in ReRoPE; ``k`` > 1: slope ``1/k`` of the relative position beyond ``w`` (default 16)."""

    k: float = 16.0
    UNBOUNDED: ClassVar[bool] = False  # the relative position passes L at w + k (L - w)

    def __post_init__(self):
        super().__post_init__()
        check_number("k", self.k, above=1.0)

    def rules(self, length: int) -> ReRopeRules:
        return ReRopeRules(_window("window", self.window, length, max(1, length // 4)), float(self.k))


def _plain(params, geo: Geometry, factor: float, seq_len: int | None):
    """Plain RoPE frequencies, attention scale 1; checks the parameters against ``L``."""
    params.rules(geo.original_max_position_embeddings)
    return rope_frequencies(geo.dim, geo.base), 1.0


def _dual_chunk(params: DualChunkParams, geo: Geometry, factor: float, seq_len: int | None):
    """Plain RoPE frequencies; the attention scale is the temperature's ``1 + t ln s``."""
    params.rules(geo.original_max_position_embeddings)
    return rope_frequencies(geo.dim, geo.base), params.attention_factor(factor)


SELF_EXTEND = Method(
    "self_extend",
    SelfExtendParams,
    _plain,
    rope_type="self_extend",
    attention=True,
    source='Jin et al. 2024, "LLM Maybe LongLM" (Self-Extend)',
    engine_lacks="it has no Self-Extend (only llama.cpp has a version of it)",
    engine_instead="--to gguf",
)
DUAL_CHUNK = Method(
    "dual_chunk",
    DualChunkParams,
    _dual_chunk,
    rope_type="dual_chunk",
    attention=True,
    source="An et al. 2024, Dual Chunk Attention (ChunkLlama)",
    engine_lacks="it has no dual-chunk attention",
)
REROPE = Method("rerope", ReRopeParams, _plain, rope_type="rerope", attention=True, source="Su 2023, ReRoPE")
LEAKY_REROPE = Method(
    "leaky_rerope",
    LeakyReRopeParams,
    _plain,
    rope_type="leaky_rerope",
    attention=True,
    source="Su 2023, ReRoPE (leaky)",
)
