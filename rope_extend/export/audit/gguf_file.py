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

from pathlib import Path
from typing import Any

import numpy as np

from ...errors import RopeExtendError
from ...methods.yarn import correction_range, mscale
from .rope import Rope

ENGINE = "llama.cpp 0c1e57098"
# arch: (pattern, swa base (None: the global base), swa frequency scale (None: the global scale))
SWA = {"gemma3": (6, 10000.0, 1.0), "gemma2": (2, None, None), "gpt-oss": (2, None, None)}
READS_BETAS = ("mistral3", "grok")


def read(path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(keys, rope tensors)`` of a GGUF file: every metadata key, and the ``rope_freqs`` /
    ``rope_factors_long`` / ``rope_factors_short`` tensors as float64 arrays."""
    try:
        from gguf import GGUFReader, GGUFValueType
    except ImportError:
        raise RopeExtendError("reading a GGUF file needs the gguf package: pip install 'rope-extend[gguf]'") from None
    try:
        reader = GGUFReader(Path(path))
    except (OSError, ValueError, IndexError) as exc:
        raise RopeExtendError(f"{path} is not a readable GGUF file: {exc}") from None
    keys: dict[str, Any] = {}
    for field in reader.fields.values():
        if not field.types:
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            if len(field.types) > 1 and field.types[1] == GGUFValueType.STRING:
                continue  # token lists
            keys[field.name] = [field.parts[i].tolist()[0] for i in field.data]
        elif field.types[0] == GGUFValueType.STRING:
            keys[field.name] = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
        else:
            keys[field.name] = field.parts[field.data[0]].tolist()[0]
    tensors = {
        t.name: np.asarray(t.data, dtype=np.float64).reshape(-1)
        for t in reader.tensors
        if t.name.split(".")[0] in ("rope_freqs", "rope_factors_long", "rope_factors_short")
        or t.name.startswith(("blk.0.rope_freqs", "blk.0.rope_factors"))
    }
    return keys, {name.removeprefix("blk.0.").removesuffix(".weight"): value for name, value in tensors.items()}


def _swa_layers(arch: str, keys: dict[str, Any], n_layer: int) -> list[bool]:
    pattern = keys.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return [bool(x) for x in pattern[:n_layer]]
    if arch not in SWA or (arch == "gemma3" and not keys.get(f"{arch}.attention.sliding_window")):
        return [False] * n_layer
    n = int(pattern) if pattern is not None else SWA[arch][0]
    return [n == 0 or i % n < n - 1 for i in range(n_layer)]


def _divisors(tensors: dict[str, np.ndarray], served: int, original: int, n_rot: int) -> tuple[np.ndarray, str]:
    """The factors each frequency is divided by (``get_rope_factors``) and which tensor gave them."""
    if "rope_freqs" in tensors:
        divisors, which = tensors["rope_freqs"], "rope_freqs tensor"
    elif "rope_factors_long" in tensors and served > original:
        divisors, which = tensors["rope_factors_long"], f"long factors (context {served} > original {original})"
    elif "rope_factors_short" in tensors:
        divisors, which = tensors["rope_factors_short"], f"short factors (context {served} <= original {original})"
    else:
        divisors, which = np.ones(n_rot // 2), ""
    if divisors.size != n_rot // 2:
        raise RopeExtendError(
            f"the GGUF's rope tensor has {divisors.size} values, rope.dimension_count/2 is {n_rot // 2}"
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


def layers(keys: dict[str, Any], tensors: dict[str, np.ndarray], served: int) -> list[tuple[str | None, Rope]]:
    """``[(layer type, Rope)]`` llama.cpp computes for every layer when started with ``served`` tokens of
    context (``-c``); the layer type is ``sliding_attention`` / ``full_attention`` where the architecture has
    sliding-window layers with their own rope."""
    arch = keys.get("general.architecture")
    if not arch:
        raise RopeExtendError("the GGUF file names no general.architecture")

    def key(name, default=None):
        return keys.get(f"{arch}.{name}", default)

    n_layer = int(key("block_count", 0))
    heads = key("attention.head_count")
    heads = heads[0] if isinstance(heads, list) else heads
    head_dim = key("attention.key_length") or (int(key("embedding_length")) // int(heads) if heads else None)
    n_rot = int(key("rope.dimension_count") or head_dim or 0)
    if not n_layer or not n_rot:
        raise RopeExtendError(f"the GGUF file has no {arch}.block_count or rotary dimension: not a decoder model")
    base = float(key("rope.freq_base", 10000.0))
    kind = str(key("rope.scaling.type", "linear"))
    if kind not in ("none", "linear", "yarn", "longrope"):
        raise RopeExtendError(f"llama.cpp aborts on {arch}.rope.scaling.type {kind!r} (none, linear, yarn, longrope)")
    factor = float(key("rope.scaling.factor", 0.0) or key("rope.scale_linear", 0.0) or 0.0)
    freq_scale = 1.0 if kind == "none" or factor == 0.0 else 1.0 / factor
    attn = float(key("rope.scaling.attn_factor", 1.0))
    context = int(key("context_length", 0) or 0)
    original = int(key("rope.scaling.original_context_length", 0) or context)
    betas = (32.0, 1.0)
    if arch in READS_BETAS:
        betas = (float(key("rope.scaling.yarn_beta_fast", 32.0)), float(key("rope.scaling.yarn_beta_slow", 1.0)))
    yarn = kind == "yarn"
    if yarn:  # llama-context.cpp: the temperature is cancelled there and applied again in ggml's rope_yarn
        log_mul = float(key("rope.scaling.yarn_log_multiplier", 0.0))
        s = 1.0 / freq_scale
        temp = mscale(s) / mscale(s, log_mul) if log_mul else mscale(s)
        attn = temp / (1.0 + 0.1 * np.log(s)) * attn
    divisors, which = _divisors(tensors, served, original, n_rot)
    swa = _swa_layers(arch, keys, n_layer)
    _, swa_base, swa_scale = SWA.get(arch, (0, None, None))
    swa_base = float(key("rope.freq_base_swa", swa_base if swa_base is not None else base))
    swa_scale = freq_scale if swa_scale is None else swa_scale
    out, cache = [], {}
    for il in range(n_layer):
        local = swa[il]
        layer_type = ("sliding_attention" if local else "full_attention") if any(swa) else None
        if layer_type not in cache:
            b, fs = (swa_base, swa_scale) if local else (base, freq_scale)
            freqs, scale = _rope(n_rot, b, fs, divisors, attn, yarn_original=original if yarn else None, betas=betas)
            what = f"{ENGINE}: {arch}, freq_base {b:g}, scaling {kind}" + (f" x{1 / fs:g}" if fs != 1.0 else "")
            what += (
                (f", original {original}" if yarn else "") + f", attn_factor {attn:g}" + (f", {which}" if which else "")
            )
            cache[layer_type] = Rope(freqs, float(scale), what)
        out.append((layer_type, cache[layer_type]))
    return out


def summary(keys: dict[str, Any]) -> dict[str, Any]:
    """The rope-related keys (for the report and the checks made without a reference)."""
    arch = keys.get("general.architecture", "")
    return {
        k.removeprefix(f"{arch}."): v
        for k, v in keys.items()
        if k.startswith(f"{arch}.rope") or k.endswith(".context_length")
    }
