"""The matrix's models and references: what each cell's logits must equal.

- A frequency method (and the control): the patched model's own uncached forward over the whole sequence, with
  transformers' eager attention (so the reference does not share the kernel under test). A dynamic method's
  frequencies depend on the length, so step ``t`` of a generation is checked against the uncached forward of the
  first ``t`` tokens (what ``generate(use_cache=False)`` computes), one forward per step. With a KV cache, it is
  checked against what docs/serving.md promises (``References.frozen``): each token's hidden states are those of
  the forward that fed it, and every cached key carries the frequencies in use. An uncached recompute differs from
  that in every layer past the first (earlier tokens' hidden states were computed with the frequencies of their
  length: on the Gemma 3 shape by 0.009-0.029 of the largest logit), so it is no reference for a cache.
- An attention method, and log-n: the explicit O(n^2) attention of tests/families (``_reference_logits``: every
  pair's relative position from tests/test_attention's ``relative``, each layer in its own rotation convention;
  local sliding layers and NoPE layers plain, under the model's own masks).
- Beam search: the same search over the reference's log-probabilities (the top ``BEAMS`` continuations by summed
  log-probability at every step; no hypothesis can end, ``min_new_tokens`` holds EOS back as it does in
  ``generate``).
- An evicting ``SinkCache``: no uncached forward is its reference (the keys it keeps were computed while the
  dropped tokens were visible, StreamingLLM's design; tests/test_sinks checks each step against a recompute on a
  one-layer model). Its reference is a fresh ``SinkCache`` fed the same tokens in the chunks a correct generation
  feeds: the prompt, then one token per step, and a continuation's unseen tokens in one forward.

Models are built once per shape and implementation (fixed seed: every implementation has the same weights, so a
reference computed on one serves all of them, memoized by shape, variant and tokens).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect

import torch
import transformers as T

import rope_extend
from rope_extend.hf.layout import decoder_of
from rope_extend.hf.reading import rotary_geometry, scaled_layer_types, text_config
from tests import tiny
from tests.families import tiny as families
from tests.families.test_attention_families import _reference_logits
from tests.matrix.cells import FACTOR, SINKS, WINDOW, Cell, L, kind, params

# the cache keyword of forward and generate: ``cache`` since transformers 5.24 (``past_key_values`` deprecated)
CACHE_ARG = "cache" if "cache" in inspect.signature(T.LlamaForCausalLM.forward).parameters else "past_key_values"


@functools.cache
def model(shape: str, implementation: str):
    """The shape's tiny model (seed 0), trained length ``L``, sliding windows ``WINDOW``."""
    if shape in tiny.FAMILIES:  # llama, gemma3: tests/tiny.py
        extra = {"sliding_window": WINDOW} if shape == "gemma3" else {}
        config = tiny.tiny_config(shape, max_position_embeddings=L, **extra)
        cls = tiny.FAMILIES[shape][1]
    else:  # any family of transformers' registry: tests/families/tiny.py
        config = copy.deepcopy(families.tiny_config(shape))
        text = config.get_text_config(decoder=True)
        text.max_position_embeddings = L
        if getattr(text, "sliding_window", None):
            text.sliding_window = WINDOW
        cls = families.model_class(shape)
    torch.manual_seed(0)
    built = cls._from_config(config, attn_implementation=implementation).eval()
    built.requires_grad_(False)
    return built


def patch_arguments(variant: str, patched_model) -> dict:
    """``params(variant)``, and LongRoPE's per-frequency factors (1 below L, rising to 4 above) for the shape."""
    out = params(variant)
    if variant.removesuffix("+logn") == "longrope":
        config = text_config(patched_model.config)
        half = rotary_geometry(config, scaled_layer_types(config)[0])[0] // 2
        out |= {"short_factor": [1.0] * half, "long_factor": [1.0 + (FACTOR - 1.0) * i / half for i in range(half)]}
    return out


def eos_ids(m) -> list[int]:
    eos = m.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def forward(m, cell: Cell, ids: torch.Tensor) -> torch.Tensor:
    """The reference logits of every position of ``ids`` [batch, n] in one uncached forward (float32)."""
    if kind(cell.variant) == "attention":
        method = cell.method or "none"
        rel = {k: v for k, v in params(cell.variant).items() if k not in ("logn", "factor")}
        return _reference_logits(m, method, rel, ids, cell.logn)
    with _eager(m), torch.no_grad():
        return m(input_ids=ids, use_cache=False).logits.float()


@contextlib.contextmanager
def _eager(m):
    """``m`` runs transformers' eager attention inside (the reference does not share the kernel under test)."""
    config = text_config(m.config)
    saved = config._attn_implementation
    config._attn_implementation = "eager"
    try:
        yield
    finally:
        config._attn_implementation = saved


class References:
    """Reference logits, memoized by (shape, variant, tokens): the same for every implementation and cache."""

    def __init__(self):
        self.full: dict = {}
        self.beams: dict = {}

    def whole(self, m, cell: Cell, ids: torch.Tensor) -> torch.Tensor:
        """One uncached forward over ``ids`` [1, n]: logits [n, vocab]."""
        key = (cell.shape, cell.variant, tuple(ids[0].tolist()))
        if key not in self.full:
            self.full[key] = forward(m, cell, ids)[0]
        return self.full[key]

    def steps(self, m, cell: Cell, ids: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """The logits that predict ``ids[0, p]`` for each ``p``, from the uncached forward of ``ids[:, :p]`` (a
        dynamic method; with a cache, ``frozen``: ``positions`` are then the ends of every forward that ran) or of
        the whole sequence (the same numbers for the others: attention is causal)."""
        if kind(cell.variant) == "dynamic" and cell.cache != "none" and cell.mode != "forward":
            return self.frozen(m, cell, ids, positions)
        if kind(cell.variant) == "dynamic":
            return torch.stack([self.whole(m, cell, ids[:, :p])[-1] for p in positions])
        return self.whole(m, cell, ids)[[p - 1 for p in positions]]

    def frozen(self, m, cell: Cell, ids: torch.Tensor, ends: list[int]) -> torch.Tensor:
        """A dynamic method with a KV cache, as documented (docs/serving.md): a token's hidden states are those of
        the forward that fed it (with the frequencies of that forward's length), and every cached key carries the
        frequencies in use. Written without a cache and without rotating any key: the forward that feeds
        ``ids[:, a:e]`` (``a`` the previous end, 0 first) is an uncached forward over ``ids[:, :e]`` whose decoder
        layers get, in rows ``0 .. a-1``, the hidden states recorded when those rows were fed; each layer's own code
        then computes their keys with the frequencies of length ``e``. Memoized by the tokens and the forwards that
        fed them (beam hypotheses share their prefixes). Returns the last logits of each forward."""
        out, held, schedule = [], None, ()
        for end in ends:
            schedule += (end,)
            key = ("frozen", cell.shape, cell.variant, tuple(ids[0, :end].tolist()), schedule)
            if key not in self.full:
                self.full[key] = _frozen_forward(m, ids[:, :end], held)
            held, last = self.full[key]
            out.append(last)
        return torch.stack(out)

    def beam(self, m, cell: Cell, prompt: torch.Tensor, beams: int, new: int) -> torch.Tensor:
        """The best sequence of a beam search over the reference's log-probabilities."""
        key = (cell.shape, cell.variant, cell.cache != "none", tuple(prompt[0].tolist()), beams, new)
        if key not in self.beams:
            seqs, scores = prompt, torch.zeros(1)
            eos = eos_ids(m)
            first = prompt.shape[1]
            for _ in range(new):
                # every forward's end: the prompt's, then one token at a time (what a cached search feeds)
                logits = torch.stack(
                    [self.steps(m, cell, s[None], list(range(first, s.numel() + 1)))[-1] for s in seqs]
                )
                logp = torch.log_softmax(logits, -1)
                logp[:, eos] = float("-inf")  # min_new_tokens
                top = (scores[:, None] + logp).flatten().topk(beams)
                rows, tokens = top.indices // logp.shape[-1], top.indices % logp.shape[-1]
                seqs, scores = torch.cat([seqs[rows], tokens[:, None]], 1), top.values
            self.beams[key] = seqs[0]
        return self.beams[key]


def decoder_layers(m) -> list:
    """The text decoder's layers: its ``layers``, else its longest ``ModuleList`` (Falcon's ``h``, DBRX's
    ``blocks``, a decoder that ``get_decoder`` does not reach)."""
    decoder = decoder_of(m)
    if isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):
        return list(decoder.layers)
    lists = [x for x in decoder.modules() if isinstance(x, torch.nn.ModuleList)]
    if not lists:
        raise AttributeError(f"{type(decoder).__name__} has no list of layers")
    return list(max(lists, key=len))


def _frozen_forward(m, ids: torch.Tensor, held: list[torch.Tensor] | None):
    """``References.frozen``'s one forward: ``(inputs, logits)``, the hidden states every decoder layer got (``[1, n,
    hidden]`` each, rows ``0 .. a-1`` taken from ``held``) and the last row's logits."""
    layers = decoder_layers(m)
    seen: list[torch.Tensor | None] = [None] * len(layers)

    def hook(index):
        def replace(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            if held is not None:
                hidden = torch.cat([held[index].to(hidden.dtype), hidden[:, held[index].shape[1] :]], 1)
            seen[index] = hidden
            if args:
                return (hidden, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": hidden}

        return replace

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with _eager(m), torch.no_grad():
            logits = m(input_ids=ids, use_cache=False).logits[0, -1].float()
    finally:
        for handle in handles:
            handle.remove()
    return seen, logits


def sink_steps(m, ids: torch.Tensor, window: int, chunks: list[int]) -> torch.Tensor:
    """Feed ``ids`` [1, n] through a fresh ``SinkCache`` in ``chunks``: the last logits after each chunk."""
    cache = rope_extend.SinkCache(m, sink_tokens=SINKS, window=window)
    out, start = [], 0
    with torch.no_grad():
        for size in chunks:
            piece = ids[:, start : start + size]
            logits = m(input_ids=piece, use_cache=True, **{CACHE_ARG: cache}).logits
            out.append(logits[0, -1].float())
            start += size
    return torch.stack(out)
