"""mlx-lm 0.32.2 reading a model folder's ``config.json``: the rotary frequencies and q/k scale each layer gets.

Modelled from mlx-lm's own source at that version (``mlx_lm/utils.py`` ``MODEL_REMAPPING``, ``models/llama.py``,
``qwen2.py``, ``qwen3.py`` ``ModelArgs``, ``models/rope_utils.py`` ``initialize_rope`` and its classes), and
checked against the rope modules mlx-lm itself builds (``tests/export/test_mlx_engine.py``). mlx-lm reads the
JSON as it is, not through transformers, so this does too:

- the base is the top-level ``rope_theta`` (absent: 10000 for llama and mistral, 1e6 for qwen2; qwen3 takes
  ``rope_parameters["rope_theta"]`` and refuses a config with neither), the scaling the top-level
  ``rope_scaling`` (qwen3: else ``rope_parameters``): a folder saved by transformers 5, whose rope settings are in
  ``rope_parameters`` only, runs in llama and qwen2 at the default base, unscaled;
- the rope type is ``type``, else ``rope_type``; ``default`` and ``linear`` (positions times ``1 / factor``),
  ``dynamic`` (the base ``b (s n / N - (s - 1))^(d/(d-2))`` at ``n = max(length, N)`` of each forward, cached keys
  kept as they were turned), ``llama3`` (defaults: low 1, high 4, original 8192; the smoothed band open at both
  ends), ``yarn`` (defaults: original 4096, betas 32 and 1, ``mscale`` 1, ``mscale_all_dim`` 0; the ramp always
  floored and ceiled; the scale ``mscale(s, mscale) / mscale(s, mscale_all_dim)``, ``attention_factor`` not read)
  and ``longrope`` (the long factors for every sequence; the scale ``sqrt(1 + ln(N / L) / ln L)`` from
  ``max_position_embeddings``, ``attention_factor`` and the mscales not read).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import RopeExtendError
from ...methods._common import check_int, check_length, check_number
from ...untrusted import read_json
from ..targets.mlx import ENGINE
from ..targets.mlx import FAMILIES as MODULES  # model_type: the mlx-lm module that loads it (the export's families)
from . import reference
from .rope import MAX_LAYERS, MAX_ROTARY_DIM, Rope

DEFAULT_THETA = {"llama": 10000.0, "qwen2": 1000000.0}  # ModelArgs.rope_theta's default (qwen3 has none)
KNOWN = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def settings(data: dict[str, Any]) -> tuple[str, float, dict[str, Any] | None, list[str]]:
    """``(module, base, rope_scaling, notes)`` mlx-lm takes from a config's JSON ``data``."""
    kind = data.get("model_type")
    module = MODULES.get(kind) if isinstance(kind, str) else None
    if module is None:
        raise RopeExtendError(f"the audit models {ENGINE}'s {', '.join(MODULES)}, not model_type {kind!r}"[:300])
    theta, scaling, notes = data.get("rope_theta"), data.get("rope_scaling"), []
    nested = data.get("rope_parameters") if isinstance(data.get("rope_parameters"), dict) else None
    if module == "qwen3" and nested is not None:  # transformers 5's keys, read where the top-level ones are absent
        theta = nested.get("rope_theta") if theta is None else theta
        scaling = nested if scaling is None else scaling
    if theta is None:
        if module == "qwen3":
            raise RopeExtendError(f"{ENGINE} refuses this qwen3 config: rope_theta is missing")
        theta = DEFAULT_THETA[module]
        if nested is not None:
            notes.append(
                f"{ENGINE}'s {module} reads the top-level rope_theta and rope_scaling, not rope_parameters (transformers "
                f"5's keys): it runs at base {theta:g}"
                + (", unscaled" if nested.get("rope_type", "default") != "default" else "")
            )
    check_number("rope_theta", theta, above=1.0)
    if scaling is not None and not isinstance(scaling, dict):
        raise RopeExtendError(f"rope_scaling must be an object or null, got {type(scaling).__name__}")
    return module, float(theta), scaling, notes


def _yarn(d: int, base: float, p: dict[str, Any]) -> tuple[np.ndarray, float]:
    """``YarnRoPE``: by-parts frequencies with the ramp's ends floored and ceiled, and its q/k scale."""
    s = float(p["factor"])
    original = float(p.get("original_max_position_embeddings", 4096))
    fast, slow = float(p.get("beta_fast", 32)), float(p.get("beta_slow", 1))

    def index(rotations: float) -> float:
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(index(fast)), 0), min(math.ceil(index(slow)), d - 1)
    top = high + 0.001 if low == high else float(high)  # mlx-lm's guard against a zero-width ramp, as transformers'
    extrapolate = 1.0 - np.clip((np.arange(d // 2) - low) / (top - low), 0.0, 1.0)
    plain = base ** -(np.arange(0, d, 2) / d)
    inv = plain * extrapolate + plain / s * (1.0 - extrapolate)

    def m(scale: float) -> float:
        return 1.0 if s <= 1 else 0.1 * scale * math.log(s) + 1.0

    return inv, m(float(p.get("mscale", 1))) / m(float(p.get("mscale_all_dim", 0)))


def _llama3(d: int, base: float, p: dict[str, Any]) -> np.ndarray:
    """``Llama3RoPE``: transformers' formula with the smoothed band open at both ends."""
    s, low, high = float(p["factor"]), float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
    original = float(p.get("original_max_position_embeddings", 8192))
    period = base ** (np.arange(0, d, 2) / d)
    wavelen = 2 * math.pi * period
    period = np.where(wavelen > original / low, period * s, period)
    smooth = (original / wavelen - low) / (high - low)
    medium = (wavelen > original / high) & (wavelen < original / low)
    return 1.0 / np.where(medium, period / ((1 - smooth) / s + smooth), period)


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The rope type ``initialize_rope`` reads: ``type``, else ``rope_type``, else ``default``."""
    kind = "default" if scaling is None else (scaling.get("type") or scaling.get("rope_type", "default"))
    if not isinstance(kind, str):
        raise RopeExtendError(f"rope_type must be a name, got {kind!r}"[:300])
    return kind


def rope(d: int, base: float, scaling: dict[str, Any] | None, n: int | None, length: int):
    """``(inverse frequencies, q/k scale, notes)`` of ``initialize_rope`` for one layer (``n``:
    ``max_position_embeddings``) serving ``length`` tokens."""
    kind = rope_type(scaling)
    if kind not in KNOWN:
        raise RopeExtendError(f"the audit does not model {ENGINE}'s rope type {kind!r}; known: {KNOWN}"[:300])
    plain = base ** -(np.arange(0, d, 2) / d)
    if scaling is None or kind == "default":
        return plain, 1.0, []
    reference._check_rope(scaling)  # the audit's one check of a rope dict's values
    if "factor" not in scaling:
        raise RopeExtendError(f"{ENGINE} cannot load this {kind} rope_scaling: it has no factor (KeyError)")
    s = float(scaling["factor"])
    if kind == "linear":
        return plain / s, 1.0, []
    if kind == "llama3":
        return _llama3(d, base, scaling), 1.0, []
    if kind == "yarn":
        inv, scale = _yarn(d, base, scaling)
        ignored = "attention_factor" in scaling
        return inv, scale, [f"{ENGINE} does not read attention_factor (its YaRN scale is mscale's)"] if ignored else []
    if n is None:
        raise RopeExtendError(f"{ENGINE}'s {kind} needs max_position_embeddings, which the config lacks")
    if kind == "dynamic":
        if d == 2:  # d / (d - 2): mlx-lm divides by zero
            raise RopeExtendError(f"{ENGINE}'s dynamic cannot compute a base for a rotary dimension of 2")
        at = max(length, n)
        grown = base * (s * at / n - (s - 1)) ** (d / (d - 2))
        said = f"dynamic: the base of each forward's own length (here {at}); cached keys keep the base they got"
        return grown ** -(np.arange(0, d, 2) / d), 1.0, [said]
    for key in ("original_max_position_embeddings", "short_factor", "long_factor"):
        if key not in scaling:
            raise RopeExtendError(f"{ENGINE} cannot load this longrope rope_scaling: it has no {key} (KeyError)")
    original = int(scaling["original_max_position_embeddings"])
    long = np.asarray(scaling["long_factor"], dtype=np.float64)
    if long.shape != (d // 2,):
        raise RopeExtendError(f"longrope long_factor has {long.size} values; rotary dimension/2 is {d // 2}")
    ratio = n / original
    scale = 1.0 if ratio <= 1 else math.sqrt(1 + math.log(ratio) / math.log(original))
    said = f"LongRoPE: {ENGINE} uses the long factors for every sequence, transformers the short ones up to {original}"
    return plain / long, scale, [said]


def layers(path: Path, length: int | None) -> tuple[list[tuple[str | None, Rope]], int, list[str]]:
    """``([(None, Rope)] per layer, served length, notes)``: what mlx-lm computes for the folder ``path``."""
    file = path / "config.json" if path.is_dir() else path
    data = read_json(file, name=f"the config {file}", fix="give the config.json of a model folder")
    if not isinstance(data, dict):
        raise RopeExtendError(f"{file} is not a JSON object")
    try:
        module, base, scaling, notes = settings(data)
        count = check_int("num_hidden_layers", data.get("num_hidden_layers"), minimum=1)
        if count > MAX_LAYERS:
            raise RopeExtendError(f"{count} layers: the audit reads at most {MAX_LAYERS}")
        n = data.get("max_position_embeddings")
        n = None if n is None else check_length("max_position_embeddings", n)
        if data.get("head_dim"):
            d = check_int("head_dim", data["head_dim"], minimum=2)
        else:
            hidden = check_int("hidden_size", data.get("hidden_size"), minimum=1)
            d = hidden // check_int("num_attention_heads", data.get("num_attention_heads"), minimum=1)
        if d % 2 or d < 2 or d > MAX_ROTARY_DIM:
            raise RopeExtendError(f"head dimension {d}: the audit reads an even one from 2 to {MAX_ROTARY_DIM}")
        served = length or n or 4096
        inv, scale, said = rope(d, base, scaling, n, served)
    except RopeExtendError as exc:
        raise RopeExtendError(f"{file}: {exc}") from None
    said_as = {**(scaling or {}), "rope_theta": base, "rope_type": rope_type(scaling)}
    one = Rope(inv, scale, f"{ENGINE} ({module}): {reference.describe(said_as)}", *reference.named(said_as))
    return [(None, one)] * count, served, notes + said
