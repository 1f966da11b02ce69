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
  forwards (decoding with a cache) extend it; frequencies are measured against the original ``L``. Under
  sequence or context parallelism a forward holds one shard of the sequence: ``whole_sequence(low, high)``
  gives the whole sequence's first and last position, so every rank picks the frequencies 1 process picks;

then calls the module's own undecorated forward, so cos/sin are computed exactly as transformers does.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..methods.resolved import Scaling
from . import families
from .reading import frequencies, rope_dict, text_config
from .rope_types import rope_type_of, split_rope_type

# (first, last position) of the whole sequence while a forward holds only a shard of it (``whole_sequence``)
_WHOLE: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("rope_extend_whole", default=None)


@contextlib.contextmanager
def whole_sequence(low: int, high: int) -> Iterator[None]:
    """Forwards inside this block hold a shard of a sequence whose positions run from ``low`` to ``high`` (a
    sequence- or context-parallel rank's slice; pads added for an even split excluded): the dynamic methods pick
    their frequencies from this span instead of the shard's own, so a rank that sees 1/N of the sequence does
    not pick a smaller factor, and a rank whose shard does not start at position 0 still starts a new sequence.
    The caller knows the whole window before slicing it, so no collective is needed."""
    token = _WHOLE.set((int(low), int(high)))
    try:
        yield
    finally:
        _WHOLE.reset(token)


# ------------------------------------------------------------------------------------------ finding
def buffer_name(layer_type: str | None) -> str:
    return "inv_freq" if layer_type is None else f"{layer_type}_inv_freq"


def frequency_buffer(module: nn.Module, layer_type: str | None) -> torch.Tensor:
    """The frequency buffer of ``layer_type``, read from ``_buffers`` so that a non-persistent one is found too."""
    buffer = module._buffers[buffer_name(layer_type)]
    # transformers' rotary modules register a tensor under every name module_layer_types lists, and a patch writes
    # tensors only (set_frequencies, set_buffer); None is only a type ``_buffers`` allows
    assert buffer is not None, f"{type(module).__name__} has no {buffer_name(layer_type)} tensor"
    return buffer


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


def rotary_modules(model: nn.Module, required: bool = True) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for every rotary embedding module of ``model``'s language model; raises if none.

    The language model's are those built from its text config (``config.get_text_config(decoder=True)``) or a
    copy of it; a vision or audio tower's rotary module (Qwen-VL, Mistral 3, Gemma 4) is never scaled. A model whose
    rotary modules carry no config (older custom code) has them all scaled when none carries a vision one. The one
    finder of rotary modules (``patch``, the sinks, a model built from a config); ``required=False`` (every model's
    ``post_init``, most of which rope-extend has nothing to do with) finds none instead of raising.
    """
    found = [(name, m) for name, m in model.named_modules() if "RotaryEmbedding" in type(m).__name__]
    if not found and not required:
        return []
    if not found:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no rotary embedding module (a module whose class name contains "
            "'RotaryEmbedding', as in transformers' Llama, Mistral, Qwen, Gemma and Phi models): nothing to scale"
        )
    config = getattr(model, "config", None)
    text = text_config(config) if config is not None else None
    # the text config itself, or a copy of it (Granite SWA builds one rotary module per rope_theta from copies)
    mine = [(n, m) for n, m in found if text is not None and type(getattr(m, "config", None)) is type(text)]
    if mine:
        return mine
    without_config = [(n, m) for n, m in found if getattr(m, "config", None) is None]
    if without_config and len(without_config) == len(found):
        return found
    if not required:
        return []
    raise UnsupportedModelError(
        f"{type(model).__name__}: none of its rotary modules ({', '.join(n for n, _ in found)}) is built "
        "from the language model's config (config.get_text_config(decoder=True)): rope-extend cannot tell which "
        "one is the language model's"
    )


def module_config(model: nn.Module, module: nn.Module):
    config = getattr(module, "config", None)
    if config is None:
        config = getattr(model, "config", None)
        config = text_config(config) if config is not None else None
    if config is None or not getattr(config, "rope_parameters", None):
        raise UnsupportedModelError(
            f"cannot find the rope_parameters of {type(module).__name__}: neither it nor the model has a config "
            "with rope_parameters"
        )
    return config


def _transformers_before(version: str) -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) < Version(version)


_LONGROPE_PER_LAYER_BUG = _transformers_before("5.21")


def check_rebuilds(module: nn.Module, config) -> None:
    """Refuse a scaled ``config`` that the module's own class would not build from (Ernie 4.5 VL's text rotary
    raises on any rope type but ``default``): the configured model could not be reloaded. A constructor that
    fails for another reason (other arguments) is not rope-extend's to judge.

    transformers before 5.21 cannot run a reloaded ``longrope`` rotary that keeps one frequency set per layer
    type (Gemma 3, DeepSeek-V4): its ``longrope_frequency_update`` raises ``UnboundLocalError`` at the second
    call past ``L`` (the second long forward, or the second step of generation)."""
    if _LONGROPE_PER_LAYER_BUG and module_layer_types(module) != [None]:
        types = {split_rope_type(rope_type_of(rope_dict(config, lt) or {}))[1] for lt in module_layer_types(module)}
        if "longrope" in types:
            import transformers

            raise UnsupportedModelError(
                f"transformers {transformers.__version__} cannot run a saved longrope model whose rotary keeps one "
                f"frequency set per layer type ({type(module).__name__}): its longrope_frequency_update fails at the "
                "second forward past the original length (fixed in transformers 5.21); upgrade transformers, or use "
                "another method"
            )
    try:
        with torch.device("meta"):
            type(module)(config)
    except ValueError as exc:
        raise UnsupportedModelError(
            f"{type(module).__name__} cannot be built from the scaled config, so the model could not be saved and "
            f"reloaded: {exc}"
        ) from exc
    except Exception:  # noqa: BLE001 - see the docstring
        return


# ------------------------------------------------------------------------------------------ softmax scale
def softmax_scales(model: nn.Module, config) -> list[tuple[nn.Module, Any]]:
    """``(attention module, family function)`` for the attention modules built from ``config`` whose softmax
    scale transformers derives from ``rope_parameters`` when it builds them: the MLA families (DeepSeek V2/V3,
    Kimi, GLM-4 MoE Lite, MiniCPM3, LongCat, Youtu, Mistral 4) set ``self.scaling = yarn_apply_mscale(
    config.rope_parameters, self.qk_head_dim ** -0.5)``, which multiplies it by ``mscale(s, mscale_all_dim)^2``
    for a scaled type with ``mscale_all_dim``. ``softmax_scale`` recomputes it after the rope dict changes."""
    found = []
    for module in model.modules():
        apply = getattr(sys.modules.get(type(module).__module__), families.MSCALE_FUNCTION, None)
        if (
            apply is not None
            and getattr(module, "config", None) is config
            and isinstance(getattr(module, "qk_head_dim", None), int)
            and isinstance(getattr(module, "scaling", None), float)
        ):
            found.append((module, apply))
    return found


def softmax_scale(module: nn.Module, apply, config) -> float:
    """The softmax scale the family's attention computes from ``config.rope_parameters`` at build."""
    head_dim = cast(int, module.qk_head_dim)  # an int: checked by the finder above (torch types it Tensor | Module)
    return float(apply(config.rope_parameters, head_dim ** (-0.5)))


# ------------------------------------------------------------------------------------------ runtime
STEP = 16  # dynamic frequencies change when the length grows past L * (1 + 1/STEP)^k (see ``bucket``)


def bucket(length: int, original: int) -> int:
    """The length dynamic frequencies are computed at: ``length`` up to ``L``, beyond it the next boundary of
    the grid ``b_0 = L``, ``b_(k+1) = b_k + ceil(b_k / 16)`` (steps of about 6%).

    Cached keys are re-rotated when the frequencies change (``hf.cache_keeper``); on this grid that happens about 23
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

    scaling: Scaling
    dim: int
    base: float
    rotating: int | None = None  # proportional RoPE: the frequencies past this many stay zero
    seen: int | None = None  # dynamic methods: the longest length of the current sequence
    static: tuple[torch.Tensor, float] | None = None  # static methods: computed once
    first: tuple[torch.Tensor, float] | None = None  # the frequencies at ``L`` when the planner computed them

    def __post_init__(self):
        if not self.scaling.dynamic:
            self.static = self.first if self.first is not None else self.compute()

    @property
    def dynamic(self) -> bool:
        return self.static is None

    def length(self, seen: int | None) -> int | None:
        """The length the frequencies are computed at when the longest length seen is ``seen``."""
        return None if seen is None else bucket(seen, self.scaling.original_max_position_embeddings)

    def initial(self) -> tuple[torch.Tensor, float]:
        """The frequencies before any forward: the static ones, or the dynamic ones at ``L``."""
        if self.static is not None:
            return self.static
        return self.first if self.first is not None else self.compute()

    def current(self) -> tuple[torch.Tensor, float]:
        """The frequencies in use: the static ones, or the dynamic ones at the length seen so far."""
        if self.static is not None:
            return self.static
        return self.compute(self.length(self.seen))

    def compute(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        with torch.device("cpu"):  # not on meta when built inside from_pretrained's meta-device context
            return frequencies(self.scaling, self.dim, self.base, self.rotating, seq_len)


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
            elif entry.static is not None and _stale(self.module._buffers.get(buffer_name(layer_type))):
                set_frequencies(self.module, layer_type, entry.static[0], x.device)
        with torch.no_grad():
            return _raw_forward(type(self.module))(self.module, x, position_ids, *args, **kwargs)

    def advance(self, layer_type, seen: int | None, device) -> bool:
        """Follow a dynamic set to the longest length ``seen`` (None: none yet, as before the first forward;
        the cache keeper's probe restores that); returns whether its frequencies changed."""
        entry = self.entries[layer_type]
        stale = _stale(self.module._buffers.get(buffer_name(layer_type)))
        changed = entry.length(seen) != entry.length(entry.seen)
        entry.seen = seen
        if changed or stale:
            freqs, scale = entry.current()
            set_frequencies(self.module, layer_type, freqs, device)
            setattr(self.module, scale_name(layer_type), scale)
        return changed

    def init_fn(self, config=None, device=None, *args, **kwargs) -> tuple[torch.Tensor, float]:
        """Stands in for the module's ``rope_init_fn``: the frequencies in use and their attention scale."""
        freqs, scale = self.entries[None].current()
        return freqs.to(device) if device is not None else freqs, scale


def next_seen(entry: Entry, low: int, high: int) -> int:
    """The longest length after a forward over positions ``low .. high``: a forward from position 0 starts a
    new sequence. Inside ``whole_sequence`` the whole sequence's span stands in for the shard's (every caller, the
    runtime and the cache keeper's pre-hook, asks here)."""
    whole = _WHOLE.get()
    if whole is not None:
        low, high = whole
    length = high + 1
    return length if low == 0 or entry.seen is None else max(entry.seen, length)


_RAW_FORWARD: dict[type, Any] = {}


def _raw_forward(cls: type[nn.Module]):
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
    # instance attributes that shadow the class's, by design (listed in ROTARY_INSTALLED)
    module.forward = runtime
    module._apply = runtime.apply  # type: ignore[method-assign]
    if "rope_init_fn" in module.__dict__ and None in entries:
        # PhiMoE recomputes its frequencies with rope_init_fn at every forward and never reads inv_freq
        module.rope_init_fn = runtime.init_fn  # type: ignore[assignment]  # torch types attributes Tensor | Module
    return runtime


def _stale(buffer: torch.Tensor | None) -> bool:
    """A frequency buffer that must be rewritten: missing, cast away from float32, or still on meta."""
    return buffer is None or buffer.dtype != torch.float32 or buffer.device.type == "meta"


def _on_meta(buffer: torch.Tensor | None) -> bool:
    return buffer is not None and buffer.device.type == "meta"


def set_rope_type(module: nn.Module, layer_type: str | None, rope_type: str) -> None:
    by_layer = getattr(module, "rope_type", None)
    if layer_type is None:
        module.rope_type = rope_type  # type: ignore[assignment]  # a str attribute: torch types them Tensor | Module
    elif isinstance(by_layer, dict):
        by_layer[layer_type] = rope_type


def buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """A rotary module's buffers by name (unset ones left out): what a patch snapshots and restores. Read from
    ``module._buffers``, so that non-persistent buffers (``inv_freq``) are included and keep that flag."""
    return {name: value for name, value in module._buffers.items() if value is not None}


def set_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Put ``value`` back as buffer ``name``, keeping whether it is persistent (``register_buffer`` would not)."""
    module._buffers[name] = value


def original_frequencies(module: nn.Module, config, name: str, device) -> torch.Tensor:
    """A frequency buffer as transformers builds it from the unpatched ``config`` (its own
    ``ROPE_INIT_FUNCTIONS``): for a model that was on the meta device when it was patched, whose buffers were
    materialized since (the snapshot holds no data)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    stem = name.removesuffix("inv_freq").removesuffix("original_").removesuffix("_")
    layer_type = stem or None
    rope_type = rope_dict(config, layer_type).get("rope_type", "default")
    # the rotary class's static method (torch types a module attribute Tensor | Module)
    default = cast(Callable[..., tuple[torch.Tensor, float]], module.compute_default_rope_parameters)
    init = default if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
    freqs, _ = init(config, layer_type=layer_type) if layer_type is not None else init(config)
    return freqs.to(device=device, dtype=torch.float32)
