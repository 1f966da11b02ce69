"""How each attention layer of a model rotates its queries and keys, found by probing the model itself.

The attention methods re-rotate queries and keys that the family's own code has already rotated, so they
must rotate the same dimensions in the same pairing with the same frequencies. Families differ:

- direction: every family turns by ``+p theta`` except NanoChat, whose ``rotate_half`` flips the signs;
- pairing: ``half`` (dimension ``i`` with ``i + r/2``: Llama's ``rotate_half``, GPT-OSS's split halves) or
  ``interleaved`` (``2i`` with ``2i + 1``: GLM, Ernie 4.5, Helium, Llama 4's complex numbers, Cohere);
- which dimensions: the first ``r`` of the head (partial rotary: Phi, GPT-NeoX, GLM) or the last ``r``
  (MLA: DeepSeek-V2/V3, MiniCPM3, whose heads are ``[nope | rope]``);
- which frequency set (Gemma 3 and 4: one per layer type), and layers that do not rotate at all (NoPE:
  SmolLM3, Llama 4, Cohere 2, EXAONE 4, AFMoE).

Rather than trust names, ``probe`` runs the decoder once on two rows of the same tokens: row 0 with every
position 0 (no rotation, RoPE's identity), row 1 with positions spread over ``0 .. L-1``. An attention
function registered for the probe records the queries and keys every layer passes to it and returns zeros
for both rows, so every layer sees the same hidden states in both rows and row 1's queries and keys are row
0's rotated by the positions, in the family's own convention. Each layer is then matched against the
candidate layouts (pairing x first/last dimensions x the model's frequency sets), computed by rope-extend
from ``inv_freq``: a layer whose keys do not move is NoPE (its queries decide where its keys are all zero, as
in a randomly initialised ZAYA); a layer that matches no candidate, or that never
reaches transformers' attention interface, is reported, and the attention methods refuse the model.
"""

from __future__ import annotations

import weakref
from dataclasses import KW_ONLY, dataclass, field, replace

import torch
from torch import nn

from ..errors import UnsupportedModelError
from . import cache_name, causal, rotary
from .names import TABLES_ATTR

PROBE_NAME = "rope_extend_probe"
PROBE_TOKENS = 12
# Arguments of transformers' attention functions that rope-extend's attention handles (or that do not change
# what attention computes); a layer that passes any other one is refused rather than silently ignored.
KNOWN_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "sliding_window",
        "softcap",
        "s_aux",
        "is_causal",
        "output_attentions",
        "use_cache",
        "past_key_values",
        "past_key_value",
        "cache",
        "layer_idx",
        "layer_type",
        "position_embeddings",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
    }
)


cache_argument = cache_name.passed  # the cache a decoder's forward was called with, under either name


@dataclass
class _Table:
    """cos and sin of the whole positions ``first .. end-1`` for one frequency set (``Layout.cos_sin``)."""

    buffer: weakref.ref  # the frequency buffer it was built from
    version: int  # and that buffer's version counter then (in-place changes bump it)
    first: int
    end: int
    cos: torch.Tensor
    sin: torch.Tensor

    def of(self, buffer: torch.Tensor) -> bool:
        """Built from these very frequencies (the same tensor, not changed in place since)."""
        return self.buffer() is buffer and self.version == buffer._version

    def covers(self, lo: int, hi: int) -> bool:
        return self.first <= lo and hi < self.end

    def rows(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = (delta - self.first).long()
        return self.cos.index_select(0, index), self.sin.index_select(0, index)


@dataclass(frozen=True)
class Layout:
    """The rotation of one layer: ``pairing`` of dimensions ``start .. start+dim`` of a head, with the
    frequencies ``rotary.{layer_type}_inv_freq``."""

    pairing: str  # "half" or "interleaved"
    start: int
    dim: int
    rotary: nn.Module = field(compare=False)
    layer_type: str | None = None
    sign: int = 1  # -1: the family turns the other way (NanoChat's rotate_half flips the signs)

    def frequencies(self, device) -> torch.Tensor:
        return rotary.frequency_buffer(self.rotary, self.layer_type).to(device=device, dtype=torch.float64)

    def rotate(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., n, d]`` rotated by ``delta[t]`` positions on row ``t`` (angles in float64; ``x``'s dtype)."""
        angles = delta.to(device=x.device, dtype=torch.float64)[:, None] * self.frequencies(x.device)[None]
        return self.turn(x, angles)

    def turn(self, x: torch.Tensor, angles: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """``x`` ``[..., n, d]`` with each rotary pair turned by ``angles`` ``[..., n, dim/2]`` (float64, broadcast
        over ``x``'s leading dimensions) in the layer's convention, and the rotary dimensions times ``scale`` (an
        attention scale carried by cos and sin); ``x``'s dtype."""
        angles = self.sign * angles.to(device=x.device, dtype=torch.float64)
        cos, sin = (scale * angles.cos()).to(x.dtype), (scale * angles.sin()).to(x.dtype)
        return self.apply(x, cos, sin)

    def apply(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out: torch.Tensor | None = None,
        scratch: torch.Tensor | None = None,
    ):
        """``x`` with each rotary pair ``(a, b)`` turned to ``(a cos - b sin, b cos + a sin)`` (``cos``/``sin``
        ``[..., n, dim/2]`` in ``x``'s dtype, signs already in), written into ``out`` when given (any dtype:
        computed in ``x``'s, cast once on the write). ``scratch`` (``[2, *x.shape[:-1], dim/2]`` in ``x``'s dtype)
        holds the products, so that no memory is allocated; the same operations, so the same bits."""
        a, b = self._pairs(x)
        if out is not None:
            into_a, into_b = self._pairs(out)
            if scratch is None:
                torch.sub(a * cos, b * sin, out=into_a)
                torch.add(b * cos, a * sin, out=into_b)
            else:
                one, two = scratch[0], scratch[1]
                torch.sub(torch.mul(a, cos, out=one), torch.mul(b, sin, out=two), out=into_a)
                torch.add(torch.mul(b, cos, out=one), torch.mul(a, sin, out=two), out=into_b)
            if self.dim != x.shape[-1]:
                out[..., : self.start] = x[..., : self.start]
                out[..., self.start + self.dim :] = x[..., self.start + self.dim :]
            return out
        if self.pairing == "half":
            turned = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        else:
            turned = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
        if self.dim == x.shape[-1]:
            return turned
        return torch.cat([x[..., : self.start], turned, x[..., self.start + self.dim :]], dim=-1)

    def _pairs(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two members of every rotary pair of ``t`` (views), in the layer's pairing."""
        part = t[..., self.start : self.start + self.dim]
        if self.pairing == "half":
            return part[..., : self.dim // 2], part[..., self.dim // 2 :]
        return part[..., 0::2], part[..., 1::2]

    def cos_sin(self, delta: torch.Tensor, dtype: torch.dtype, table: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the turn by the positions ``delta`` ``[n]`` as ``rotate`` computes them (``sign *
        delta * inv_freq`` in float64, then ``dtype``). With ``table``, whole positions (an integer ``delta``) are
        looked up in a table that the layers sharing this frequency set share and keep across calls (a decode
        step computes none), grown by doubling to cover ``delta`` and rebuilt when the frequencies change;
        fractional ones (leaky ReRoPE), and all without ``table`` (nothing kept), are computed: the same values."""
        if delta.is_floating_point() or not table:
            angles = self.sign * (delta.to(torch.float64)[:, None] * self.frequencies(delta.device)[None])
            return angles.cos().to(dtype), angles.sin().to(dtype)
        name = rotary.buffer_name(self.layer_type)
        buffer = rotary.frequency_buffer(self.rotary, self.layer_type)
        tables = self.rotary.__dict__.setdefault(TABLES_ATTR, {})  # kept on the rotary module: goes with the model
        key = (name, self.sign, delta.device, dtype)
        lo, hi = (int(v) for v in torch.aminmax(delta))  # one host sync
        entry = tables.get(key)
        if entry is not None and not entry.of(buffer):
            entry = None
        if entry is not None and entry.covers(lo, hi):
            return entry.rows(delta)
        first, end = lo, hi + 1
        if entry is not None:  # grow on the side that ran out
            width = entry.end - entry.first
            first = min(first, entry.first - width if lo < entry.first else entry.first)
            end = max(end, entry.end + width if hi >= entry.end else entry.end)
        whole = torch.arange(first, end, dtype=torch.float64, device=delta.device)
        angles = self.sign * (whole[:, None] * self.frequencies(delta.device)[None])
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        tables[key] = entry = _Table(weakref.ref(buffer), buffer._version, first, end, cos, sin)
        return entry.rows(delta)

    def describe(self) -> str:
        where = f"dims {self.start}..{self.start + self.dim - 1}"
        turn = ", turning backwards" if self.sign < 0 else ""
        return f"{self.pairing} pairing, {where}{turn}" + (
            f", {self.layer_type} frequencies" if self.layer_type else ""
        )


@dataclass
class LayerProbe:
    """What the probe saw of one attention module."""

    kind: str  # "rope", "nope" or "unknown"
    layout: Layout | None = None
    kwargs: frozenset = frozenset()  # the non-None extra arguments it passes to the attention function
    error: float | None = None  # the best candidate's relative error, for an "unknown" layer
    _: KW_ONLY  # the rest by keyword
    why: str | None = None  # for an "unknown" layer that could not be matched at all
    width: int | None = None  # the key head size its attention function received
    noncausal: str | None = None  # why its attention is not plain causal attention (``hf.causal``), or None
    cached_width: int | None = None  # the key size its cache layer stores (``probe(cached=True)``), if known
    # whether its cache layer stores the very keys its attention saw (``probe(cached=True)``; None: not known). A
    # latent cache (Mistral 4's MLA keeps the unrotated latent as "keys" and the rotated part as "values") may
    # store keys of the same size as the attention's by chance, so the size alone does not tell
    cached_same: bool | None = None


class _Recorder:
    def __init__(self):
        self.seen: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, frozenset, str | None]] = {}

    def __call__(self, module, query, key, value, attention_mask, *, dropout=0.0, scaling=None, **kwargs):
        """transformers' attention-function signature (models pass the five tensors positionally, the rest by
        keyword): records the layer's rotated query and key, its extra arguments and whether it is causal, once
        per module; returns zeros ``(B, T, H, D_v)``."""
        extra = frozenset(k for k, v in kwargs.items() if v is not None)
        if module not in self.seen:
            noncausal = causal.flag(module, kwargs.get("is_causal"))
            if noncausal is None and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
                noncausal = causal.dense(attention_mask, query.shape[-2], key.shape[-2])
            self.seen[module] = (query.detach().float(), key.detach().float(), extra, noncausal)
        b, _, n, _ = query.shape
        return torch.zeros(b, n, query.shape[1], value.shape[-1], dtype=query.dtype, device=query.device), None


def decoder_of(model: nn.Module) -> nn.Module:
    """The text decoder (the module that runs the layers on ids), through multimodal wrappers.

    ``get_decoder`` is followed only to a model (some families name their output projection ``decoder``)."""
    from transformers import PreTrainedModel

    inner = model
    for _ in range(4):
        get = getattr(inner, "get_decoder", None)
        nxt = get() if callable(get) else None
        if nxt is None or nxt is inner or not isinstance(nxt, PreTrainedModel):
            break
        inner = nxt
    return inner


def probe_positions(length: int, n: int = PROBE_TOKENS) -> list[int]:
    """``n`` increasing positions from 0 to ``length - 1``, dense at the start (quadratic spacing)."""
    out = [0]
    for t in range(1, n):
        out.append(max(out[-1] + 1, round((length - 1) * (t / (n - 1)) ** 2)))
    return out


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def candidates(modules: list[nn.Module], head_dim: int) -> list[Layout]:
    out = []
    for module in modules:
        for lt in rotary.module_layer_types(module):
            dim = 2 * rotary.frequency_buffer(module, lt).numel()
            if dim > head_dim:
                continue
            for start in dict.fromkeys((0, head_dim - dim)):
                for pairing in ("half", "interleaved"):
                    for sign in (1, -1):
                        out.append(Layout(pairing, start, dim, module, lt, sign))
    return out


def probe(
    model: nn.Module, config, rotary: list[nn.Module], length: int, cached: bool = False
) -> dict[nn.Module, LayerProbe]:
    """Run the probe (see the module docstring) and classify every module that called attention.

    ``config`` is the text config whose ``_attn_implementation`` the layers read; ``rotary`` the text rotary
    modules; ``length`` the original length ``L`` (probe positions stay below it). ``cached``: the probe's forward
    fills a ``DynamicCache`` too, and each layer's ``cached_width`` is the key size it stored there (a compressed
    MLA cache stores other keys than its attention sees), so that a cache whose keys cannot be turned is refused
    before a forward runs, not when its keys first need turning."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    recorder = _Recorder()
    AttentionInterface.register(PROBE_NAME, recorder)
    AttentionMaskInterface.register(PROBE_NAME, sdpa_mask)
    decoder = decoder_of(model)
    get_embeddings = getattr(decoder, "get_input_embeddings", None)
    embeddings = get_embeddings() if get_embeddings is not None else None
    vocab = getattr(embeddings, "num_embeddings", None) or 100
    param = next(decoder.parameters())
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(vocab, 1000), (1, PROBE_TOKENS), generator=generator).repeat(2, 1).to(param.device)
    positions = torch.tensor([[0] * PROBE_TOKENS, probe_positions(length)], device=param.device)
    before = config._attn_implementation
    was_training = decoder.training
    config._attn_implementation = PROBE_NAME
    try:
        decoder.eval()
        with torch.no_grad():
            store = _probe_cache(config) if cached else None
            extra = cache_name.cache_kwargs(store) if store is not None else {}
            decoder(input_ids=ids, position_ids=positions, use_cache=store is not None, **extra)
    except (TypeError, ValueError, RuntimeError, KeyError, AttributeError, IndexError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UnsupportedModelError(
            f"the attention methods find how the layers rotate by running the text decoder on token ids alone, "
            f"and {type(decoder).__name__} cannot run that way ({type(e).__name__}: {first[:200]}); "
            "use a frequency method (yarn, linear, ...)"
        ) from e
    finally:
        config._attn_implementation = before
        decoder.train(was_training)
    delta = positions[1].to(torch.float64)
    tolerance = max(2e-3, 16 * torch.finfo(param.dtype).eps) if param.is_floating_point() else 2e-3
    widths = _cached_widths(store) if cached else {}
    return {
        module: replace(
            _classify(query, key, extra, rotary, delta, tolerance),
            noncausal=noncausal,
            cached_width=widths.get(getattr(module, "layer_idx", None)),
            cached_same=_cached_same(store, getattr(module, "layer_idx", None), key) if cached else None,
        )
        for module, (query, key, extra, noncausal) in recorder.seen.items()
    }


def _probe_cache(config):
    from transformers import DynamicCache

    return DynamicCache(config=config)


def _cached_widths(store) -> dict[int | None, int]:
    """Layer index -> the key size of what its cache layer holds after the probe's forward (looked up by an
    attention module's ``layer_idx``, None for one without)."""
    out: dict[int | None, int] = {}
    for index, layer in enumerate(getattr(store, "layers", [])):
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.numel():
            out[index] = keys.shape[-1]
    return out


def _cached_same(store, index, key: torch.Tensor) -> bool | None:
    """Whether layer ``index``'s cache holds the keys its attention saw (``key`` [B, H, T, D], float): the last
    slots it kept (a sliding window keeps fewer), its key heads repeated or tiled up to the attention's where the
    model does so before the attention function. None where the cache holds no keys for it (nothing to turn)."""
    layers = getattr(store, "layers", [])
    if not isinstance(index, int) or index >= len(layers):
        return None
    cached = getattr(layers[index], "keys", None)
    if not isinstance(cached, torch.Tensor) or not cached.numel():
        return None
    if cached.dim() != 4 or cached.shape[0] != key.shape[0] or cached.shape[-1] != key.shape[-1]:
        return False
    kept = min(cached.shape[-2], key.shape[-2])
    cached, key = cached[:, :, -kept:].float(), key[:, :, -kept:]
    if cached.shape[1] == key.shape[1]:
        return bool(torch.allclose(cached, key, rtol=1e-5, atol=1e-6))
    if key.shape[1] % cached.shape[1]:
        return False
    times = key.shape[1] // cached.shape[1]
    # grouped-query heads (repeat_kv: each key head next to its copies) or tiled (JetMoE's attention experts)
    spread = (cached.repeat_interleave(times, dim=1), cached.repeat(1, times, 1, 1))
    return any(torch.allclose(c, key, rtol=1e-5, atol=1e-6) for c in spread)


def _classify(query, key, extra, rotary, delta, tolerance) -> LayerProbe:
    """One layer's probe: row 1's queries and keys against row 0's, rotated by every candidate layout."""
    q0, q1, k0, k1 = query[:1], query[1:], key[:1], key[1:]
    width = key.shape[-1]
    if query.shape[-2] != PROBE_TOKENS or key.shape[-2] != PROBE_TOKENS:
        why = f"its attention sees {key.shape[-2]} keys for {query.shape[-2]} queries: compressed or extra keys"
        return LayerProbe("unknown", None, extra, why=why, width=width)
    if not (k1.any() or q1.any()):
        why = "its queries and keys are zero on the probe's tokens, so how it rotates cannot be seen"
        return LayerProbe("unknown", None, extra, why=why, width=width)
    # keys that do not move: NoPE (by the queries where the keys are all zero: a layer's weights may zero them)
    if _relative_error(*((k0, k1) if k1.any() else (q0, q1))) <= tolerance:
        return LayerProbe("nope", None, extra, width=width)
    best, best_error = None, float("inf")
    for layout in candidates(rotary, width):
        if layout.dim > query.shape[-1]:
            continue
        error = max(_relative_error(layout.rotate(k0, delta), k1), _relative_error(layout.rotate(q0, delta), q1))
        if error < best_error:
            best, best_error = layout, error
    if best is not None and best_error <= tolerance:
        return LayerProbe("rope", best, extra, width=width)
    return LayerProbe("unknown", None, extra, best_error, width=width)


def layer_probes(
    model: nn.Module, config, rotary: list[nn.Module], length: int, cached: bool = False
) -> dict[int, LayerProbe]:
    """``probe``'s findings keyed by decoder layer index (the modules with an integer ``layer_idx``)."""
    found = probe(model, config, rotary, length, cached)
    indexed = ((getattr(m, "layer_idx", None), p) for m, p in found.items())
    return {index: p for index, p in indexed if isinstance(index, int)}


def cached_layout(
    probes: dict[int, LayerProbe], index: int, width: int | None, unprobed: str | None = None
) -> tuple[Layout | None, str | None]:
    """How to turn layer ``index``'s cached keys of size ``width``: ``(layout, None)``; ``(None, None)`` for a NoPE
    layer (nothing to turn); ``(None, why)`` when it cannot be done (``unprobed``: why the probe itself failed;
    ``width`` None only with it, to ask for that reason)."""
    seen = probes.get(index)
    if seen is not None and seen.kind == "nope":
        return None, None
    if seen is not None and seen.kind == "rope" and width != seen.width:
        return None, (
            f"layer {index} caches keys of size {width}, not the {seen.width} its attention sees (a compressed "
            "cache), so rope-extend cannot tell which dimensions rotate"
        )
    if seen is not None and seen.kind == "rope" and seen.cached_same is False:
        return None, (
            f"layer {index}'s cache holds other keys than its attention sees (a latent or compressed cache), so "
            "rope-extend cannot turn them"
        )
    if seen is not None and seen.kind == "rope":
        return seen.layout, None
    if unprobed:
        return None, unprobed
    if seen is not None:
        return None, f"layer {index} rotates its keys in a way rope-extend cannot reproduce"
    return None, f"layer {index} does not call transformers' attention interface"
