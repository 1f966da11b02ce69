"""llama.cpp reading a GGUF file: the rotary frequencies and cos/sin scale each layer gets from the file's keys.

From llama.cpp 0c1e57098 (vendored by llama-cpp-python 0.3.36):

- ``src/llama-model.cpp`` (``load_hparams``): ``{arch}.rope.freq_base`` (10000 when absent),
  ``rope.scaling.type`` (``linear`` when absent), ``rope.scaling.factor`` (or the older ``rope.scale_linear``;
  frequency scale ``1/factor``, 1 when absent), ``rope.scaling.attn_factor`` (1),
  ``rope.scaling.original_context_length`` (``context_length`` when absent), ``rope.dimension_count``;
  ``get_rope_factors``: ``rope_freqs`` when present, else LongRoPE's long factors when the context llama.cpp is
  started with is longer than the original length, else the short ones.
- ``src/llama-context.cpp``: type ``none`` never scales; YaRN (``ext_factor`` 1) turns ``attn_factor`` into the
  final scale ``attn_factor x (0.1 ln s + 1)`` (the temperature cancelled there, applied again in ggml); the betas
  are 32 and 1 unless the architecture reads ``rope.scaling.yarn_beta_*`` (mistral3, grok).
- ggml (``ggml/src/ggml.c`` ``ggml_rope_yarn_corr_dims``, ``ggml-cpu/ops.cpp`` ``rope_yarn``): the ramp ends are
  always floored and ceiled (transformers' ``truncate=True``); each frequency is divided by its ``rope_freqs`` /
  LongRoPE factor before scaling.
- Sliding-window layers (``get_rope_freq_base`` / ``get_rope_freq_scale``, per architecture in ``src/models``):
  ``gemma3``: every 6th layer global, the others at ``rope.freq_base_swa`` (10000 when absent) and never scaled;
  ``gemma2`` and ``gpt-oss``: every 2nd, at ``rope.freq_base_swa`` (the global base when absent) with the global
  scale; ``attention.sliding_window_pattern`` (a number or a per-layer array) overrides the pattern.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import RopeExtendError
from ...methods._common import Geometry, check_int, check_number, rotary_dim
from ...methods.yarn import correction_range, mscale
from . import gguf_read
from .rope import MAX_LAYERS, MAX_ROTARY_DIM, Rope

ENGINE = "llama.cpp 0c1e57098"
# arch: (pattern, swa base (None: the global base), swa frequency scale (None: the global scale))
SWA = {"gemma3": (6, 10000.0, 1.0), "gemma2": (2, None, None), "gpt-oss": (2, None, None)}
READS_BETAS = ("mistral3", "grok")
KINDS = ("none", "linear", "yarn", "longrope")
ORIGINAL_KINDS = ("yarn", "longrope")  # the types whose numbers depend on the original length


@dataclass(frozen=True)
class Settings:
    """The rope settings llama.cpp reads from a GGUF's keys, each checked before anything is computed with it."""

    arch: str
    n_layer: int
    n_rot: int
    base: float
    kind: str  # rope.scaling.type
    factor: float  # rope.scaling.factor (or rope.scale_linear); 0: none, as llama.cpp reads it
    attn: float  # rope.scaling.attn_factor
    context: int  # context_length; 0: the file has none
    original: int  # rope.scaling.original_context_length; 0: none (llama.cpp then takes context_length)
    betas: tuple[float, float]
    log_mul: float  # rope.scaling.yarn_log_multiplier
    swa: tuple[bool, ...]  # which layers are sliding-window layers
    swa_base: float

    @property
    def freq_scale(self) -> float:
        return 1.0 if self.kind == "none" or self.factor == 0.0 else 1.0 / self.factor


def _kind(value: Any) -> str:
    """How a message names a value of the wrong type."""
    if isinstance(value, gguf_read.Unread):
        return repr(value)
    if isinstance(value, list):
        return f"an array of {len(value)} items"
    return f"{type(value).__name__} {value!r}"[:200]


class _Keys:
    """The keys of one architecture (``{arch}.name``), each checked for its type and range as it is read."""

    def __init__(self, keys: dict[str, Any], arch: str):
        self.keys, self.arch = keys, arch

    def name(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def get(self, name: str) -> Any:
        return self.keys.get(self.name(name))

    def int(self, name: str, default: int, minimum: int = 0, value: Any = None) -> int:
        value = self.get(name) if value is None else value
        if value is None:
            return default
        return check_int(self.name(name), value, minimum=minimum)

    def float(self, name: str, default: float, **bounds) -> float:
        value = self.get(name)
        if value is None:
            return default
        if not isinstance(value, float):
            raise RopeExtendError(f"{self.name(name)} must be a float (llama.cpp reads a float32), got {_kind(value)}")
        return check_number(self.name(name), value, **bounds)

    def per_layer(self, name: str, n_layer: builtins.int) -> list | None:  # ``int`` is the method above here
        """A per-layer array (``get_key_or_arr``: one item per layer), or None when the key is a single value."""
        value = self.get(name)
        if isinstance(value, gguf_read.Unread) or (isinstance(value, list) and len(value) != n_layer):
            raise RopeExtendError(f"{self.name(name)} must have one item per layer ({n_layer}), got {_kind(value)}")
        return value if isinstance(value, list) else None


def settings(keys: dict[str, Any]) -> Settings:
    """The rope settings of a GGUF's keys, read as llama.cpp's ``load_hparams`` reads them; a key of the wrong type
    or out of its range is refused naming it (a NaN factor, an odd rotary dimension, a string block count)."""
    arch = keys.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise RopeExtendError(f"general.architecture must name the architecture, got {_kind(arch)}")
    k = _Keys(keys, arch)
    if k.get("block_count") is None:
        raise RopeExtendError(f"the GGUF file has no {arch}.block_count: not a decoder model")
    n_layer = k.int("block_count", 0, minimum=1)
    if n_layer > MAX_LAYERS:
        raise RopeExtendError(f"{arch}.block_count {n_layer}: the audit reads models of at most {MAX_LAYERS} layers")
    n_rot = _rotary_dim(k, n_layer)
    kind = k.get("rope.scaling.type")
    kind = "linear" if kind is None else kind  # an empty name is llama.cpp's UNSPECIFIED, which it aborts on
    if kind not in KINDS:
        raise RopeExtendError(
            f"llama.cpp aborts on {arch}.rope.scaling.type {_kind(kind)} (none, linear, yarn, longrope)"
        )
    # load_hparams: rope.scaling.factor when the key is there (0 included), else the older rope.scale_linear
    old = k.get("rope.scaling.factor") is None
    factor = k.float("rope.scale_linear" if old else "rope.scaling.factor", 0.0, minimum=0.0)
    context = k.int("context_length", 0, minimum=1)
    original = k.int("rope.scaling.original_context_length", 0)
    if kind == "yarn" and not (original or context):
        raise RopeExtendError(
            f"YaRN needs an original length: {arch} has no context_length nor original_context_length"
        )
    betas = (32.0, 1.0)
    if arch in READS_BETAS:
        betas = (
            k.float("rope.scaling.yarn_beta_fast", 32.0, above=0.0),
            k.float("rope.scaling.yarn_beta_slow", 1.0, above=0.0),
        )
    base = k.float("rope.freq_base", 10000.0)
    _, swa_base, _ = SWA.get(arch, (0, None, None))
    swa_base = k.float("rope.freq_base_swa", swa_base if swa_base is not None else base)
    for name, value in (("rope.freq_base", base), ("rope.freq_base_swa", swa_base)):
        _check_base(k.name(name), n_rot, value)
    return Settings(
        arch,
        n_layer,
        n_rot,
        base,
        kind,
        factor,
        k.float("rope.scaling.attn_factor", 1.0, above=0.0),
        context,
        original,
        betas,
        k.float("rope.scaling.yarn_log_multiplier", 0.0, minimum=0.0),
        tuple(_swa_layers(k, n_layer)),
        swa_base,
    )


def _check_base(name: str, n_rot: int, base: float) -> None:
    """The methods' own rule for a base (``Geometry``: finite and > 1), named by the GGUF key."""
    try:
        Geometry(n_rot, base, 2)  # any L: only the base is checked here
    except RopeExtendError as exc:
        raise RopeExtendError(f"{name}: {exc}") from None


def _rotary_dim(k: _Keys, n_layer: int) -> int:
    """``rope.dimension_count``, else the head dimension (``attention.key_length``, else ``embedding_length /
    head_count``): an even number from 2 to ``MAX_ROTARY_DIM`` (the methods' ``rotary_dim`` rule)."""
    heads_list = k.per_layer("attention.head_count", n_layer)
    heads = k.int("attention.head_count", 0, value=heads_list[0] if heads_list else None)
    n_rot = k.get("rope.dimension_count")
    if n_rot is None:
        n_rot = k.int("attention.key_length", 0, minimum=1)
        if not n_rot and heads:
            n_rot = k.int("embedding_length", 0, minimum=1) // heads
        if not n_rot:
            raise RopeExtendError(f"the GGUF file has no {k.arch}.rope.dimension_count or head dimension")
    try:
        n_rot = rotary_dim(n_rot)
    except RopeExtendError as exc:
        raise RopeExtendError(f"{k.name('rope.dimension_count')} (or the head dimension): {exc}") from None
    if n_rot > MAX_ROTARY_DIM:
        raise RopeExtendError(f"rotary dimension {n_rot}: the audit reads at most {MAX_ROTARY_DIM}")
    return n_rot


def _swa_layers(k: _Keys, n_layer: int) -> list[bool]:
    """Which layers are sliding-window layers: ``attention.sliding_window_pattern`` (one flag per layer, or every
    n-th layer global), else the architecture's own pattern (``SWA``)."""
    flags = k.per_layer("attention.sliding_window_pattern", n_layer)
    if flags is not None:
        return [bool(k.int("attention.sliding_window_pattern", 0, value=x)) for x in flags]
    if k.arch not in SWA or (k.arch == "gemma3" and not k.int("attention.sliding_window", 0)):
        return [False] * n_layer
    n = k.int("attention.sliding_window_pattern", SWA[k.arch][0])
    return [n == 0 or i % n < n - 1 for i in range(n_layer)]


def _divisors(tensors: dict[str, np.ndarray], served: int, original: int, n_rot: int) -> tuple[np.ndarray, str]:
    """The factors each frequency is divided by (``get_rope_factors``) and which tensor gave them: one per rotated
    pair, each finite and > 0 (a NaN would make every comparison false, a 0 an infinite frequency)."""
    if "rope_freqs" in tensors:
        name, which = "rope_freqs", "rope_freqs tensor"
    elif "rope_factors_long" in tensors and served > original:
        name, which = "rope_factors_long", f"long factors (context {served} > original {original})"
    elif "rope_factors_short" in tensors:
        name, which = "rope_factors_short", f"short factors (context {served} <= original {original})"
    else:
        return np.ones(n_rot // 2), ""
    divisors = tensors[name]
    if divisors.size != n_rot // 2:
        raise RopeExtendError(
            f"the GGUF's {name} tensor has {divisors.size} values, rotary dimension/2 is {n_rot // 2}"
        )
    bad = np.flatnonzero(~(np.isfinite(divisors) & (divisors > 0)))
    if bad.size:
        raise RopeExtendError(
            f"the GGUF's {name} tensor holds {divisors[bad[0]]} at index {bad[0]} ({bad.size} such values): each "
            "factor must be a finite number > 0"
        )
    return divisors, which


def _rope(n_rot: int, base: float, fs: float, divisors, attn: float, *, yarn_original: int | None, betas) -> tuple:
    """One layer's ``(frequencies, scale)`` as ggml's ``rope_yarn`` computes them (YaRN when ``yarn_original``
    is given: ``ext_factor`` 1, the ramp floored and ceiled)."""
    extrap = 1.0 / base ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot) / divisors
    if yarn_original is None:
        return fs * extrap, attn
    low, high = correction_range(n_rot, base, yarn_original, betas[0], betas[1], truncate=True)
    mix = 1 - np.clip((np.arange(n_rot // 2) - low) / max(0.001, high - low), 0, 1)
    return fs * extrap * (1 - mix) + extrap * mix, attn * (1.0 + 0.1 * np.log(1.0 / fs))


def layers(s: Settings, tensors: dict[str, np.ndarray], served: int) -> list[tuple[str | None, Rope]]:
    """``[(layer type, Rope)]`` llama.cpp computes for every layer when started with ``served`` tokens of
    context (``-c``); the layer type is ``sliding_attention`` / ``full_attention`` where the architecture has
    sliding-window layers with their own rope."""
    freq_scale, attn = s.freq_scale, s.attn
    original = s.original or s.context
    yarn = s.kind == "yarn"
    if yarn:  # llama-context.cpp: the temperature is cancelled there and applied again in ggml's rope_yarn
        f = 1.0 / freq_scale
        temp = mscale(f) / mscale(f, s.log_mul) if s.log_mul else mscale(f)
        attn = temp / (1.0 + 0.1 * np.log(f)) * attn
    divisors, which = _divisors(tensors, served, original, s.n_rot)
    swa_scale = SWA.get(s.arch, (0, None, None))[2]
    swa_scale = freq_scale if swa_scale is None else swa_scale
    out, cache = [], {}
    for il in range(s.n_layer):
        local = s.swa[il]
        layer_type = ("sliding_attention" if local else "full_attention") if any(s.swa) else None
        if layer_type not in cache:
            b, fs = (s.swa_base, swa_scale) if local else (s.base, freq_scale)
            freqs, scale = _rope(
                s.n_rot, b, fs, divisors, attn, yarn_original=original if yarn else None, betas=s.betas
            )
            what = f"{ENGINE}: {s.arch}, freq_base {b:g}, scaling {s.kind}" + (f" x{1 / fs:g}" if fs != 1.0 else "")
            what += (
                (f", original {original}" if yarn else "") + f", attn_factor {attn:g}" + (f", {which}" if which else "")
            )
            cache[layer_type] = Rope(
                freqs, float(scale), what, original=original if s.kind in ORIGINAL_KINDS else None, factor=1 / fs
            )
        out.append((layer_type, cache[layer_type]))
    return out
