"""transformers' rotary-module conventions, and the runtime rope-extend installs in a rotary module.

A rotary module is any module whose class name contains ``RotaryEmbedding`` and that keeps transformers'
buffers: ``inv_freq`` (one set) or ``{layer_type}_inv_freq`` (Gemma 3: one set per attention type), with
``attention_scaling`` / ``{layer_type}_attention_scaling`` beside them. Its ``forward(x, position_ids[,
layer_type])`` returns cos and sin; transformers decorates it (``dynamic_rope_update``, ``no_grad``).

``RotaryRuntime`` is installed as a module's ``forward``. It

- restores float32 frequencies if ``model.to(torch.bfloat16)`` / ``.half()`` cast the buffer (at
  position 32767 a bf16 ``inv_freq`` puts cos off by up to 2);
- for the dynamic methods (``dynamic``, ``dynamic_yarn``, ``longrope``), follows the longest position
  seen in the current sequence: a forward whose positions start at 0 begins a new sequence, later
  forwards (decoding with a cache) extend it; frequencies are measured against the original ``L``;

then calls the module's own undecorated forward, so cos/sin are computed exactly as transformers does.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..methods import registry as M
from . import config as C

INSTALLED = ("forward", "_apply")  # instance attributes the runtime sets on a rotary module


# ------------------------------------------------------------------------------------------ finding
def buffer_name(layer_type: str | None) -> str:
    return "inv_freq" if layer_type is None else f"{layer_type}_inv_freq"


def scale_name(layer_type: str | None) -> str:
    return "attention_scaling" if layer_type is None else f"{layer_type}_attention_scaling"


def module_layer_types(module: nn.Module) -> list[str | None]:
    """The frequency sets a rotary module keeps: [None] for ``inv_freq``, else its layer types."""
    if "inv_freq" in module._buffers:
        return [None]
    layer_types = getattr(module, "layer_types", None) or []
    found = [lt for lt in layer_types if buffer_name(lt) in module._buffers]
    if not found:
        raise UnsupportedModelError(
            f"{type(module).__name__} does not follow transformers' *RotaryEmbedding convention (an inv_freq "
            "buffer, or {layer_type}_inv_freq buffers): rope-extend cannot scale it"
        )
    return found


def rotary_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for every text rotary embedding module in ``model``; raises if there is none.

    Modules that carry a config with ``rope_parameters`` are the language model's; rotary modules without
    one (a vision tower's, say) are left alone when the language model has its own.
    """
    found = [(name, m) for name, m in model.named_modules() if "RotaryEmbedding" in type(m).__name__]
    if not found:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no rotary embedding module (a module whose class name contains "
            "'RotaryEmbedding', as in transformers' Llama, Mistral, Qwen, Gemma and Phi models): nothing to scale"
        )
    with_config = [(n, m) for n, m in found if getattr(getattr(m, "config", None), "rope_parameters", None)]
    return with_config or found


def module_config(model: nn.Module, module: nn.Module):
    config = getattr(module, "config", None)
    if config is None:
        config = getattr(model, "config", None)
        config = C.text_config(config) if config is not None else None
    if config is None or not getattr(config, "rope_parameters", None):
        raise UnsupportedModelError(
            f"cannot find the rope_parameters of {type(module).__name__}: neither it nor the model has a config "
            "with rope_parameters"
        )
    return config


# ------------------------------------------------------------------------------------------ runtime
STEP = 16  # dynamic frequencies change when the length grows past L * (1 + 1/STEP)^k (see ``bucket``)


def bucket(length: int, original: int) -> int:
    """The length dynamic frequencies are computed at: ``length`` up to ``L``, beyond it the next boundary of
    the grid ``b_0 = L``, ``b_(k+1) = b_k + ceil(b_k / 16)`` (steps of about 6%).

    Cached keys are re-rotated when the frequencies change (``hf.cache``); on this grid that happens about 23
    times between ``L`` and ``4L`` whatever ``L`` is, instead of at every new token, which bounds the work
    and the rounding. Cached and uncached forwards use the same grid, so they agree.
    """
    if length <= original:
        return length
    edge = original
    while edge < length:
        edge += -(-edge // STEP)
    return edge


@dataclass
class Entry:
    """One frequency set a runtime manages."""

    scaling: M.Scaling
    dim: int
    base: float
    seen: int | None = None  # dynamic methods: the longest length of the current sequence
    static: tuple[torch.Tensor, float] | None = None  # static methods: computed once

    def __post_init__(self):
        if not self.scaling.method.dynamic:
            self.static = self.scaling.compute(self.dim, self.base)

    @property
    def dynamic(self) -> bool:
        return self.static is None

    def length(self, seen: int | None) -> int | None:
        """The length the frequencies are computed at when the longest length seen is ``seen``."""
        return None if seen is None else bucket(seen, self.scaling.original_max_position_embeddings)

    def initial(self) -> tuple[torch.Tensor, float]:
        """The frequencies before any forward: the static ones, or the dynamic ones at ``L``."""
        return self.static if self.static is not None else self.scaling.compute(self.dim, self.base)

    def current(self) -> tuple[torch.Tensor, float]:
        """The frequencies in use: the static ones, or the dynamic ones at the length seen so far."""
        if self.static is not None:
            return self.static
        return self.scaling.compute(self.dim, self.base, self.length(self.seen))


class RotaryRuntime:
    """Installed as a rotary module's ``forward``; see the module docstring."""

    def __init__(self, module: nn.Module, entries: dict[str | None, Entry]):
        self.module = module
        self.entries = entries
        self.ready: set = set()  # sets the cache keeper already advanced for the coming forward

    def apply(self, fn, *args, **kwargs):
        """``nn.Module._apply`` (what ``.to``/``.half``/``.cuda``/``.to_empty`` call), then the frequencies
        again: float32 after a cast, and recomputed when a meta buffer was materialized (``to_empty`` leaves
        uninitialized memory there, and ``load_state_dict`` does not fill these non-persistent buffers)."""
        on_meta = {lt for lt in self.entries if _on_meta(self.module._buffers.get(buffer_name(lt)))}
        out = type(self.module)._apply(self.module, fn, *args, **kwargs)
        for layer_type, entry in self.entries.items():
            buffer = self.module._buffers.get(buffer_name(layer_type))
            if buffer is None or buffer.device.type == "meta":
                continue  # filled at the first forward
            if layer_type in on_meta or buffer.dtype != torch.float32:
                set_frequencies(self.module, layer_type, entry.current()[0], buffer.device)
        return out

    def __call__(self, x, position_ids, *args, **kwargs):
        layer_type = args[0] if args else kwargs.get("layer_type")
        entry = self.entries.get(layer_type)
        if entry is not None:
            if layer_type in self.ready:  # the cache keeper saw these positions: no second host sync
                self.ready.discard(layer_type)
            elif entry.dynamic:
                # One host sync for both ends; positions starting at 0 mean a new sequence.
                low, high = torch.stack([position_ids.min(), position_ids.max()]).tolist()
                self.advance(layer_type, next_seen(entry, int(low), int(high)), x.device)
            elif _stale(self.module._buffers.get(buffer_name(layer_type))):
                set_frequencies(self.module, layer_type, entry.static[0], x.device)
        with torch.no_grad():
            return _raw_forward(type(self.module))(self.module, x, position_ids, *args, **kwargs)

    def advance(self, layer_type, seen: int, device) -> bool:
        """Follow a dynamic set to the longest length ``seen``; returns whether its frequencies changed."""
        entry = self.entries[layer_type]
        stale = _stale(self.module._buffers.get(buffer_name(layer_type)))
        changed = entry.length(seen) != entry.length(entry.seen)
        entry.seen = seen
        if changed or stale:
            freqs, scale = entry.current()
            set_frequencies(self.module, layer_type, freqs, device)
            setattr(self.module, scale_name(layer_type), scale)
        return changed

    def cos_sin(self, layer_type, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin (attention scale included) for ``position_ids`` with the frequencies in use,
        computed by the module's own forward, so laid out as the model lays them out."""
        x = torch.empty(0, dtype=torch.float32, device=position_ids.device)
        extra = () if layer_type is None else (layer_type,)
        with torch.no_grad():
            return _raw_forward(type(self.module))(self.module, x, position_ids, *extra)


def next_seen(entry: Entry, low: int, high: int) -> int:
    """The longest length after a forward over positions ``low .. high``: a forward from position 0 starts a
    new sequence."""
    length = high + 1
    return length if low == 0 or entry.seen is None else max(entry.seen, length)


_RAW_FORWARD: dict[type, Any] = {}


def _raw_forward(cls: type):
    """The class's forward without its decorators (transformers' ``dynamic_rope_update`` and ``no_grad``):
    the runtime does what the dynamic decorator did, measured against ``L``. Looked up per class, not
    stored on the runtime, so a patched model still pickles."""
    raw = _RAW_FORWARD.get(cls)
    if raw is None:
        raw = _RAW_FORWARD[cls] = inspect.unwrap(cls.forward)
    return raw


def set_frequencies(module: nn.Module, layer_type: str | None, freqs: torch.Tensor, device=None) -> None:
    """Replace the frequency buffers (current and ``original_``) with float32 ``freqs`` on the module's device
    (``device`` when the buffer is missing, or on meta and ``device`` says where it is being materialized)."""
    name = buffer_name(layer_type)
    current = module._buffers.get(name)
    if current is not None and (current.device.type != "meta" or device is None):
        device = current.device  # a model still on meta stays there until it is materialized
    freqs = freqs.to(device=device, dtype=torch.float32)
    module._buffers[name] = freqs
    original = "original_inv_freq" if layer_type is None else f"{layer_type}_original_inv_freq"
    if original in module._buffers:
        module._buffers[original] = freqs.clone()


def install(module: nn.Module, entries: dict[str | None, Entry]) -> RotaryRuntime:
    runtime = RotaryRuntime(module, entries)
    module.forward = runtime
    module._apply = runtime.apply
    return runtime


def _stale(buffer: torch.Tensor | None) -> bool:
    """A frequency buffer that must be rewritten: missing, cast away from float32, or still on meta."""
    return buffer is None or buffer.dtype != torch.float32 or buffer.device.type == "meta"


def _on_meta(buffer: torch.Tensor | None) -> bool:
    return buffer is not None and buffer.device.type == "meta"


def set_rope_type(module: nn.Module, layer_type: str | None, rope_type: str) -> None:
    if layer_type is None:
        module.rope_type = rope_type
    elif isinstance(getattr(module, "rope_type", None), dict):
        module.rope_type[layer_type] = rope_type
