"""Every RoPE family in transformers' registry x every attention method: exact, or refused clearly.

``attention_cell`` is one cell of the sweep (``test_families.py`` runs it on every family and checks the outcome
against the committed snapshot). For each family that ``tiny.build`` makes, and each attention method (Self-Extend,
Dual Chunk, ReRoPE, STRING, log-n), ``patch`` either raises a rope-extend error naming the family and the method
and leaves the model as it was, or its logits equal a reference (atol 2e-4 relative to the logits' scale) that
computes every layer's attention explicitly, O(n^2):

- layers that keep plain attention (local sliding / chunked layers by ``config.layer_types``, NoPE layers, and
  every layer under a frequency method) attend with true positions, under the model's own mask and its own
  causality (sdpa's convention: causal when no mask is given and the module is ``is_causal``);
- every other layer rotates key ``j`` further for query ``i`` so that the pair's relative position is the
  method's ``rel(i, j)`` written out from methods.md (tests/test_attention.py's ``relative``), in the layer's
  rotation convention as ``hf.layout.probe`` measured it on the family's own code; ``test_probe_*`` below
  pins the probe against conventions read from the families' source;
- log-n (the ``logn`` column: linear x4 from ``L`` = 32, so that the temperature reaches ``ln 100 / ln 32``
  within the ``N`` tokens) multiplies the query at ``p`` by ``max(1, ln(p + 1) / ln L)`` on every layer but
  the local ones, RoPE and NoPE layers alike.

A method that would change no layer of a family (every RoPE layer local, every other one NoPE: Cohere 2,
EXAONE 4, Llama 4, ...) is refused, and log-n where the family scales its NoPE queries itself (Llama 4's
``attn_temperature_tuning``).

Anything else (a crash in transformers or torch, a mismatch) fails. The docs' families table (``docs/families.md``)
is rendered from the snapshot of the same outcomes (``python -m tests.families.table --update``).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

import rope_extend
from rope_extend import RopeExtendBaseError
from rope_extend.hf import attention as A
from rope_extend.hf import layout as Lo
from rope_extend.hf.families.context import LOCAL_LAYER_TYPES
from rope_extend.hf.reading import text_config
from tests.families import snapshot
from tests.families.tiny import build, text_inputs
from tests.test_attention import relative

N = 100  # tokens: Self-Extend's and ReRoPE's far pairs, Dual Chunk's three kinds of chunk (s = 40)
METHODS = {
    "self_extend": dict(group_size=4, window=16),
    "dual_chunk": dict(chunk_size=48, local_window=8),
    "rerope": dict(window=16),
    "string": dict(shifted_offset=32, local_window=8),
    "logn": dict(factor=4, original_max_position_embeddings=32, logn=True),
}
LOGN = "linear"  # the method the logn column patches with (log-n over a frequency method)


class Reference:
    """Explicit attention: ``layouts[module]`` is the layer's rotation, None for plain attention; log-n scales the
    queries of the modules in ``scaled``."""

    def __init__(self, method, params, layouts, scaled, length):
        self.method, self.params, self.layouts, self.scaled, self.length = method, params, layouts, scaled, length

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kw):
        layout = self.layouts.get(module)
        b, h, n, _ = query.shape
        groups = h // key.shape[1]
        key, value = key.float().repeat_interleave(groups, 1), value.float().repeat_interleave(groups, 1)
        q = query.float()
        if module in self.scaled:
            factor = [max(1.0, math.log(p + 1) / math.log(self.length)) for p in range(n)]
            q = q * torch.tensor(factor)[:, None]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        if layout is None:
            scores = torch.einsum("bhid,bhjd->bhij", q, key)
        else:
            rel = torch.tensor([[relative(self.method, self.params, a, c) for c in range(n)] for a in range(n)])
            delta = (i - rel - j).to(torch.float64)  # move key j to i - rel[i, j]
            k = key[:, :, None].expand(-1, -1, n, -1, -1).reshape(b, h, n * n, -1)
            k = layout.rotate(k, delta.reshape(-1)).reshape(b, h, n, n, -1)
            scores = torch.einsum("bhid,bhijd->bhij", q, k)
        scores = scores * (scaling if scaling is not None else module.head_dim**-0.5)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if layout is not None or (attention_mask is None and getattr(module, "is_causal", True)):
            scores = scores.masked_fill(j > i, float("-inf"))  # plain layers: the model's own convention, as sdpa's
        if attention_mask is not None:
            mask = attention_mask[..., :n, :n]
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
        sinks = kw.get("s_aux")
        if sinks is not None:
            scores = torch.cat([scores, sinks.float().reshape(1, -1, 1, 1).expand(b, -1, n, 1)], dim=-1)
        weights = torch.softmax(scores, -1)[..., :n]
        out = torch.matmul(weights, value).transpose(1, 2).contiguous()
        return out.to(query.dtype), None


def _reference_logits(model, method, params, x, logn):
    config = text_config(model.config)
    types = list(getattr(config, "layer_types", None) or ())
    mixed = bool(types) and not all(t in LOCAL_LAYER_TYPES for t in types)
    layouts, scaled = {}, set()
    for module in A.attention_modules(model, config) + [m for m in model.modules() if A.PLAN_ATTR in m.__dict__]:
        plan = module.__dict__.get(A.PLAN_ATTR)
        idx = getattr(module, "layer_idx", None)
        local = mixed and isinstance(idx, int) and idx < len(types) and types[idx] in LOCAL_LAYER_TYPES
        # a frequency method (the logn column) moves no position: every layer attends as the model's own does
        moved = plan is not None and plan.rules is not None
        layouts[module] = None if local or not moved else plan.layout
        if logn and not local:  # RoPE and NoPE layers alike
            scaled.add(module)
    length = rope_extend.patched(model).original_max_position_embeddings
    name = "rope_extend_test_families_reference"
    AttentionInterface.register(name, Reference(method, params, layouts, scaled, length))
    AttentionMaskInterface.register(name, sdpa_mask)
    # the reference runs on the patched model's rotary (plain RoPE: a shipped scaling is replaced), with the
    # model's own masks, and in place of rope-extend's attention function
    patched_impl = config._attn_implementation
    config._attn_implementation = name
    try:
        return _logits(model, x)
    finally:
        config._attn_implementation = patched_impl


def inputs() -> torch.Tensor:
    """The ``N`` token ids every attention cell runs on."""
    return torch.randint(3, 200, (1, N), generator=torch.Generator().manual_seed(1))


def attention_cell(family, method) -> str:
    """The cell of an attention method on ``family`` (``tests.families.sweep.Family``: its built ``model``, whose
    logits on ``inputs()`` are ``attention_ref``): ``exact`` (logits within 2e-4 of the explicit reference, relative
    to their scale), ``exact at its reach`` for a family that ships a scaling (patched with ``target_length`` at the
    method's reach, which replaces that scaling), or the refusal, which names the family and the method and leaves
    the model as it was; an AssertionError on anything else. The model is unpatched after, bit-identical."""
    model_type, model, x = family.name, family.built, inputs()
    params = dict(METHODS[method])
    name, logn = (method, False) if method != "logn" else (LOGN, True)
    try:
        rope_extend.patch(model, name, **params)
        kind = snapshot.EXACT
    except RopeExtendBaseError as exc:
        shorter = re.search(r"target_length=(\d+) to accept the shorter context", str(exc))
        try:
            if shorter is None:
                raise
            # a family whose config ships a scaling (GPT-OSS's yarn): the method at its own reach, over plain RoPE
            rope_extend.patch(model, name, target_length=int(shorter.group(1)), **params)
            kind = snapshot.REACH
        except RopeExtendBaseError as refused:
            message = str(refused)
            assert model_type in message and name in message and "\n" not in message, message
            assert rope_extend.patched(model) is None, f"{model_type} {method}: refused, yet the model is patched"
            assert torch.equal(_logits(model, x), family.attention_ref), f"{model_type} {method}: refused, yet changed"
            return snapshot.refused(message, model_type, name)
    try:
        patched = _logits(model, x)
        rel_params = {
            k: v for k, v in params.items() if k not in ("logn", "factor", "original_max_position_embeddings")
        }
        reference = _reference_logits(model, name, rel_params, x, logn)
    finally:
        rope_extend.unpatch(model)
    scale = float(reference.abs().max()) or 1.0
    error = float((patched - reference).abs().max()) / scale
    assert error < 2e-4, f"{model_type} {method}: patched logits off the explicit reference by {error:.3g}"
    assert torch.equal(_logits(model, x), family.attention_ref), f"{model_type} {method}: unpatch is not bit-identical"
    return kind


def _logits(model, x):
    """The logits of a text-only forward on ``x`` (``tiny.text_inputs``: with what the family cannot do without),
    with the same random numbers each time for a family whose forward draws some (Diffusion Gemma's noise)."""
    torch.manual_seed(0)
    with torch.no_grad():
        return model(**text_inputs(model.config.model_type, x)).logits.float()


# ------------------------------------------------------------------------------------------ the probe itself
def _probed(model_type):
    model = build(model_type)
    config = text_config(model.config)
    rotary = [m for m in model.modules() if "RotaryEmbedding" in type(m).__name__]
    found = Lo.probe(model, config, rotary, 128)
    return model, {getattr(m, "layer_idx", None): p for m, p in found.items()}


@pytest.mark.parametrize(
    ("model_type", "pairing", "last", "sign"),
    [
        ("llama", "half", False, 1),
        ("phi", "half", False, 1),  # partial rotary: the first dims
        ("helium", "interleaved", False, 1),
        ("cohere", "interleaved", False, 1),
        ("llama4_text", "interleaved", False, 1),  # complex numbers over adjacent pairs
        ("deepseek_v3", "half", True, 1),  # MLA: [nope | rope]
        ("minicpm3", "half", True, 1),
        ("nanochat", "half", False, -1),  # rotate_half returns (x2, -x1)
    ],
)
def test_probe_finds_the_family_convention(model_type, pairing, last, sign):
    _, found = _probed(model_type)
    ropes = [p for p in found.values() if p.kind == "rope"]
    assert ropes
    for p in ropes:
        assert p.layout.pairing == pairing
        assert (p.layout.start > 0) == last
        assert p.layout.sign == sign


@pytest.mark.parametrize("model_type", ["smollm3", "llama4_text", "cohere2", "exaone4"])
def test_probe_finds_nope_layers(model_type):
    model, found = _probed(model_type)
    config = text_config(model.config)
    flags = getattr(config, "no_rope_layers", None)
    if flags is not None:  # SmolLM3 / Llama 4: 1 = rotate, 0 = NoPE
        expected = {i for i, f in enumerate(flags) if not f}
    else:  # Cohere 2, EXAONE 4: full-attention layers are NoPE
        expected = {i for i, t in enumerate(config.layer_types) if t == "full_attention"}
    assert expected
    assert {i for i, p in found.items() if p.kind == "nope"} == expected


def test_a_family_without_the_attention_interface_is_refused():
    model = build("falcon")
    with pytest.raises(RopeExtendBaseError, match="falcon.*attention interface"):
        rope_extend.patch(model, "self_extend", group_size=4, window=16)
    assert rope_extend.patched(model) is None
