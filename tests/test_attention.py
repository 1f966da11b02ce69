"""Attention methods (``rope_extend.hf.attention``) against an eager reference with explicit positions.

The reference takes the queries and keys transformers rotated at their true positions, and for every pair
(i, j) rotates key j further so that the pair's relative position is the method's ``rel[i, j]``, written
out below from the formulas of methods.md and issue 11; then plain softmax attention.
"""

import ast
import importlib
import inspect
import math
import pkgutil
from collections import defaultdict

import pytest
import torch
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

import rope_extend
from rope_extend import RopeExtendError, UnsupportedModelError
from rope_extend.hf import attention as A
from rope_extend.hf.attention import kernels, passes
from tests.tiny import FAMILIES, tiny_config, tiny_model

L = 32
N = 80  # 2.5 L
FAMILY_NAMES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "phi", "gpt_neox"]
METHODS = {
    "self_extend": dict(group_size=4, window=8),
    "dual_chunk": dict(chunk_size=24, local_window=4),
    "rerope": dict(window=8),
    "leaky_rerope": dict(window=8, k=4.0),
    "string": dict(shifted_offset=12, local_window=4),
}


def relative(method, params, i, j):
    """The method's relative position of query i and key j <= i (plain numbers)."""
    d = i - j
    if method == "self_extend":
        g, w = params["group_size"], params["window"]
        return d if d < w else (i // g + w - w // g) - j // g
    if method == "dual_chunk":
        c, w = params["chunk_size"], params["local_window"]
        s = c - w
        kp = j % s
        if i // s == j // s:
            return i % s - kp
        if i // s == j // s + 1:
            return min(i % s + s, c) - kp
        return min(2 * s - 1, c) - kp
    if method == "rerope":
        return min(d, params["window"])
    if method == "leaky_rerope":
        w, k = params["window"], params["k"]
        return d if d < w else w + (d - w) / k
    if method == "string":  # HKUNLP/STRING: shift the relative positions at and past S down by S - W
        shift, w = params["shifted_offset"], params["local_window"]
        return d if d < shift else d - shift + w
    return d  # plain RoPE (logn only)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Reference:
    """An attention function with the method's explicit position matrix (eager, O(n^2) memory).

    It turns keys with the frequencies the model's rotary holds when attention runs: registered on an unpatched
    model, the ones transformers computes from the config (a shipped ``llama3``, ``yarn``, or ``longrope`` at
    the current length). ``logit_scale`` multiplies the scores (a method's attention factor m on cos and sin:
    m squared); ``length`` is the L of log-n."""

    def __init__(self, model, method, params, logn=False, logit_scale=1.0, length=L):
        self.method, self.params, self.logn = method, params, logn
        self.logit_scale, self.length = logit_scale, length
        self.rotary = model.get_decoder().rotary_emb
        self.calls = 0

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kw):
        self.calls += 1
        if getattr(module, "sliding_window", None) and module.config.model_type.startswith("gemma"):
            bias = torch.zeros(attention_mask.shape).masked_fill(~attention_mask, torch.finfo(torch.float32).min)
            eager = __import__(type(module).__module__, fromlist=["x"]).eager_attention_forward
            return eager(module, query, key, value, bias, scaling=scaling, softcap=softcap)
        n, groups = query.shape[2], query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        buffers = dict(self.rotary.named_buffers())
        inv = buffers.get("inv_freq", buffers.get("full_attention_inv_freq"))
        rel = torch.tensor([[relative(self.method, self.params, i, j) for j in range(n)] for i in range(n)])
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        delta = (i - rel - j).to(torch.float64)  # move key j to i - rel[i, j]
        angles = (delta[..., None] * inv.double()).float()
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [n, n, rot]
        rot = cos.shape[-1]
        k = key[:, :, None].expand(-1, -1, n, -1, -1)  # [b, h, i, j, d]
        k = torch.cat([k[..., :rot] * cos + _rotate_half(k[..., :rot]) * sin, k[..., rot:]], -1)
        q = query
        if self.logn:
            q = q * torch.tensor([max(1.0, math.log(p + 1) / math.log(self.length)) for p in range(n)])[:, None]
        scores = torch.einsum("bhid,bhijd->bhij", q, k) * scaling * self.logit_scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(j > i, float("-inf"))
        if attention_mask is not None and attention_mask.dtype == torch.bool:  # a sliding window, padding
            scores = scores.masked_fill(~attention_mask[..., :n, :n], float("-inf"))
        weights = torch.softmax(scores.float(), -1)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def small(family, **over):
    kw = {"max_position_embeddings": L, **over}
    if family == "phi3":
        kw["original_max_position_embeddings"] = L
    if family in ("gemma2", "gemma3"):
        kw["sliding_window"] = 16
    return kw


def model_for(family, **over):
    return tiny_model(family, **small(family, **over))


def ids(n=N, batch=2, seed=1):
    torch.manual_seed(seed)
    return torch.randint(3, 500, (batch, n))


def run(model, x):
    with torch.no_grad():
        return model(x).logits


def reference_logits(model, method, params, x, logn=False, **kw):
    reference = Reference(model, method, params, logn, **kw)
    AttentionInterface.register("rope_extend_test_reference", reference)
    AttentionMaskInterface.register("rope_extend_test_reference", sdpa_mask)
    config = model.config
    saved = config._attn_implementation
    config._attn_implementation = "rope_extend_test_reference"
    try:
        logits = run(model, x)
    finally:
        config._attn_implementation = saved
    assert reference.calls >= config.get_text_config().num_hidden_layers  # every layer went through it
    return logits


# the names the tests monkeypatch (here, test_attention_nope, test_slots), each in the submodules of
# hf.attention whose functions read it: a name is patched where it is read, so that the patch reaches the code
PATCHED = {
    "BLOCK": {"passes"},
    "REUSE_ROWS": {"passes"},
    "ROTATE": {"passes"},
    "_rotate": {"passes"},
    "_partial": {"passes"},
    "compute_dtype": {"passes"},
    "TILE": {"kernels"},
    "SPLIT": {"kernels"},
    "_flash_cpu": {"kernels"},
    "logn_scale": {"passes", "positions"},
    "_attend": {"forward"},
}


def test_each_monkeypatched_name_is_patched_where_it_is_read():
    """A name another submodule starts to read (``from .kernels import SPLIT``) would escape the tests' patches,
    which set it in the modules above: this fails first."""
    readers = defaultdict(set)
    for info in pkgutil.iter_modules(A.__path__):
        tree = ast.parse(inspect.getsource(importlib.import_module(f"{A.__name__}.{info.name}")))
        for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(function):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in PATCHED:
                    readers[node.id].add(info.name)
    assert dict(readers) == PATCHED
    assert not [name for name in PATCHED if hasattr(A, name)]  # a copy on the package would take a patch silently


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(passes, "BLOCK", 12)  # several query blocks per sequence, blocks not aligned to chunks
    monkeypatch.setattr(kernels, "TILE", 20)
    monkeypatch.setattr(kernels, "SPLIT", 4)  # masked CPU passes are cut into unmasked / causal / masked columns


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_exact_against_explicit_positions(family):
    model = model_for(family)
    x = ids()
    for method, params in METHODS.items():
        rope_extend.patch(model, method, **params)
        # the reference after the patch: queries and keys as the patched rotary gives them (STRING's attention
        # factor scales cos and sin there, in every layer that shares the rotary), positions moved by the reference
        want = reference_logits(model, method, params, x)
        got = run(model, x)
        rope_extend.unpatch(model)
        assert (got - want).abs().max().item() < 2e-5, (family, method)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_decode_path_exact_against_explicit_positions(family, monkeypatch):
    """Every row through the path of a decode step (at most ``REUSE_ROWS`` rows): kept work space and table;
    Dual Chunk turns the queries once per chunk of keys instead of turning the keys, STRING never turns its
    keys. Equal to the explicit reference; the keys are turned only for the methods that must."""
    monkeypatch.setattr(passes, "REUSE_ROWS", 10**6)
    turned = []
    real = passes._rotate
    monkeypatch.setattr(passes, "_rotate", lambda *args: turned.append(1) or real(*args))
    model, x = model_for(family), ids()
    for method, params in METHODS.items():
        rope_extend.patch(model, method, **params)
        want = reference_logits(model, method, params, x)
        turned.clear()
        got = run(model, x)
        rope_extend.unpatch(model)
        assert (got - want).abs().max().item() < 2e-5, (family, method)
        assert bool(turned) == (method not in ("dual_chunk", "string")), method


@pytest.mark.parametrize("method", ["self_extend", "dual_chunk"])
def test_sliding_window_model_keeps_its_window(method):
    """Mistral with a sliding window shorter than the sequence: the method's positions inside the window."""
    model = model_for("mistral", sliding_window=48)
    x = ids()
    want = reference_logits(model, method, METHODS[method], x)
    plain = run(model, x)
    rope_extend.patch(model, method, **METHODS[method])
    got = run(model, x)
    assert (got - want).abs().max().item() < 1e-4
    assert (got - plain).abs().max().item() > 1e-3  # the method changed something


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_logn_exact(family):
    model = model_for(family)
    x = ids()
    want = reference_logits(model, "self_extend", METHODS["self_extend"], x, logn=True)
    rope_extend.patch(model, "self_extend", logn=True, **METHODS["self_extend"])
    assert (run(model, x) - want).abs().max().item() < 2e-5
    rope_extend.unpatch(model)
    want = reference_logits(model, "none", {}, x, logn=True)
    rope_extend.patch(model, "linear", factor=1, logn=True)  # log-n alone over plain RoPE
    assert (run(model, x) - want).abs().max().item() < 2e-5


@pytest.mark.parametrize("family", ["llama", "gemma3", "phi"])
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_generation_with_cache_equals_without(family, method):
    model = model_for(family)
    rope_extend.patch(model, method, **METHODS[method])
    prompt = ids(n=24, batch=1, seed=3)
    kw = dict(max_new_tokens=30, do_sample=False, min_new_tokens=30, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(prompt, use_cache=True, **kw)
        uncached = model.generate(prompt, use_cache=False, **kw)
    assert cached.shape[1] == 54 > 1.5 * L
    assert torch.equal(cached, uncached)


def test_left_padding_matches_unpadded_rows():
    model = model_for("llama")
    rope_extend.patch(model, "dual_chunk", **METHODS["dual_chunk"])
    x = ids(n=60, batch=1)
    alone = run(model, x)
    padded = torch.cat([torch.zeros(1, 7, dtype=torch.long), x[:, :-7]], dim=1)
    batch = torch.cat([x, padded])
    mask = torch.ones_like(batch)
    mask[1, :7] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(batch, attention_mask=mask, position_ids=position_ids).logits
    assert (out[0] - alone[0]).abs().max().item() < 2e-5
    assert (out[1, 7:] - alone[0, :-7]).abs().max().item() < 2e-5
    assert torch.isfinite(out).all()


def _query_grads(model, x, implementation=None):
    """Gradients of a loss by the query projections only: layer 0's keys and values need none, so only the
    queries carry autograd there (what LoRA on q_proj does)."""
    model.requires_grad_(False)
    weights = [layer.self_attn.q_proj.weight for layer in model.model.layers]
    for w in weights:
        w.requires_grad_(True)
        w.grad = None
    saved = model.config._attn_implementation
    if implementation is not None:
        model.config._attn_implementation = implementation
    try:
        model(x).logits.float().pow(2).mean().backward()
    finally:
        model.config._attn_implementation = saved
    return [w.grad.clone() for w in weights]


@pytest.mark.parametrize("method", ["self_extend", "dual_chunk"])
def test_gradients_equal_the_explicit_reference(method):
    """Training through an attention method: the gradients are the explicit reference's. aten's flash kernels
    give no gradient through the log-sum-exp that merges the passes, so autograd takes the plain-torch path;
    and the rotated keys saved for the backward must not sit in memory the next layer reuses (``_workspace``)."""
    model = model_for("llama")
    x = ids()
    reference = Reference(model, method, METHODS[method])
    AttentionInterface.register("rope_extend_test_reference", reference)
    AttentionMaskInterface.register("rope_extend_test_reference", sdpa_mask)
    want = _query_grads(model, x, "rope_extend_test_reference")
    rope_extend.patch(model, method, **METHODS[method])
    got = _query_grads(model, x)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() < 1e-5 * w.abs().max().item() + 1e-7
    x, mask = padded_batch(n=60)  # padded rows see no key in any pass: no NaN comes back from them
    model(x, attention_mask=mask).logits[:, 7:].float().pow(2).mean().backward()
    assert all(torch.isfinite(layer.self_attn.q_proj.weight.grad).all() for layer in model.model.layers)


def test_rotation_tables_and_work_space_follow_the_frequencies_and_go_with_unpatch(monkeypatch):
    """A decode step takes cos and sin from a table of whole positions shared by the layers; a change of the
    frequencies in place rebuilds it, and unpatch leaves nothing on the rotary module. A prefill longer than
    ``REUSE_ROWS`` keeps nothing there, and gives the same logits."""
    from rope_extend.hf import layout as LY

    model = model_for("llama")
    rope_extend.patch(model, "self_extend", **METHODS["self_extend"])
    x = ids(n=60, batch=1)
    rotary = model.model.rotary_emb
    with monkeypatch.context() as m:
        m.setattr(passes, "REUSE_ROWS", 59)
        fresh = run(model, x)
    assert LY.TABLES_ATTR not in rotary.__dict__ and A.WORKSPACE_ATTR not in rotary.__dict__
    first = run(model, x)  # 60 rows: kept
    assert torch.equal(first, fresh)
    (table,) = rotary.__dict__[LY.TABLES_ATTR].values()
    assert table.covers(59 // 4 - 59, 0) and torch.equal(run(model, x), first)  # far keys: j // 4 - j
    with torch.no_grad():
        rotary.inv_freq.mul_(0.5)  # in place: the table must follow
    changed = run(model, x)
    with torch.no_grad():
        rotary.inv_freq.mul_(2.0)
    assert not torch.allclose(changed, first)
    (table,) = rotary.__dict__[LY.TABLES_ATTR].values()
    assert table.of(rotary.inv_freq) is False  # built for the halved frequencies, rebuilt at the next call
    assert torch.equal(run(model, x), first)
    assert A.WORKSPACE_ATTR in rotary.__dict__
    rope_extend.unpatch(model)
    assert LY.TABLES_ATTR not in rotary.__dict__ and A.WORKSPACE_ATTR not in rotary.__dict__


def test_left_padding_with_generate_position_ids_is_exact():
    """generate fills padded positions with 1: those rows are off their consecutive positions, but they see
    no key and no row sees them, so the real tokens are exact."""
    model = model_for("llama")
    rope_extend.patch(model, "self_extend", **METHODS["self_extend"])
    x, mask = padded_batch(n=60)
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    alone = run(model, x[1:, 7:])
    with torch.no_grad():
        out = model(x, attention_mask=mask, position_ids=position_ids).logits
    assert (out[1, 7:] - alone[0]).abs().max().item() < 2e-5


def _packed_ids():
    return torch.cat([torch.arange(30), torch.arange(50)])[None]


@pytest.mark.parametrize(
    "case",
    [
        "packed",  # documents packed in a row, positions restarting: transformers confines attention to each
        "pose",  # PoSE's position jump
        "right_padding",  # cumulative ids with right padding: the last id is not the last real token's
        "packed_with_mask",  # packed, and an all-ones attention mask given
    ],
)
@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flex_attention", "flash_attention_2"])
def test_positions_the_rule_would_get_wrong_are_refused(case, implementation, monkeypatch):
    """The methods place row t at the last position id minus (n - 1 - t); position ids that disagree on a token
    some real token sees would give a silently wrong result, so they are refused with the allowed form."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", flash_stand_in)
    model = model_for("llama")
    model.config._attn_implementation = implementation
    rope_extend.patch(model, "dual_chunk", **METHODS["dual_chunk"])
    x = ids(n=80, batch=1)
    kw = {"position_ids": _packed_ids()}
    if case == "pose":
        kw["position_ids"] = torch.cat([torch.arange(40), torch.arange(40) + 70])[None]
    elif case == "right_padding":
        x, mask = torch.cat([x, x]), torch.ones(2, 80, dtype=torch.long)
        mask[1, -7:] = 0
        kw = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)}
    elif case == "packed_with_mask":
        kw["attention_mask"] = torch.ones_like(x)
    with torch.no_grad(), pytest.raises(RopeExtendError, match="position_ids are not consecutive.*Allowed"):
        model(x, **kw)
    with torch.no_grad():  # consecutive ids run
        assert torch.isfinite(model(x, position_ids=torch.arange(80)[None]).logits).all()


def test_unpatch_bit_identical_idempotent_and_reported():
    model = model_for("qwen2")
    x = ids()
    before = run(model, x)
    rope_extend.patch(model, "self_extend", group_size=4, window=8)
    first = run(model, x)
    rope_extend.patch(model, "self_extend", group_size=4, window=8)
    assert torch.equal(run(model, x), first)
    scaling = rope_extend.patched(model)
    assert scaling.method.name == "self_extend" and scaling.target_length == (L - 8) * 4 + 8
    rope_extend.patch(model, "dual_chunk")  # replaces, never compounds
    assert rope_extend.patched(model).method.name == "dual_chunk"
    rope_extend.unpatch(model)
    assert torch.equal(run(model, x), before)
    assert model.config._attn_implementation == "sdpa"
    assert not any(A.PLAN_ATTR in m.__dict__ for m in model.modules())


def test_save_and_reload_keeps_the_method(tmp_path):
    model = model_for("llama")
    x = ids()
    rope_extend.patch(model, "rerope", window=8, logn=True)
    want = run(model, x)
    model.save_pretrained(tmp_path)
    cls = FAMILIES["llama"][1]
    again = cls.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert again.config.rope_parameters["rope_type"] == "rerope"
    assert again.config.rope_parameters["logn"] is True
    assert (run(again, x) - want).abs().max().item() < 1e-6


def test_logn_in_a_transformers_rope_type_is_a_known_key(monkeypatch):
    from transformers import modeling_rope_utils as mru

    warned = []
    monkeypatch.setattr(mru.logger, "warning", lambda msg, *a, **k: warned.append(str(msg)))
    config = rope_extend.configure(tiny_config("llama"), "yarn", factor=4, logn=True)
    assert config.rope_parameters["logn"] is True
    type(config).from_dict(config.to_dict())  # validation runs again on load
    assert not [w for w in warned if "Unrecognized keys" in w]
    type(config)(**{**config.to_dict(), "rope_parameters": {**config.rope_parameters, "bogus": 1}})
    assert [w for w in warned if "Unrecognized keys" in w and "bogus" in w and "logn" not in w]


def test_configure_builds_the_method():
    config = rope_extend.configure(tiny_config("gemma3", **small("gemma3")), "dual_chunk", chunk_size=24)
    assert config.rope_parameters["full_attention"]["rope_type"] == "dual_chunk"
    assert config.rope_parameters["sliding_attention"].get("rope_type", "default") == "default"
    torch.manual_seed(0)
    built = FAMILIES["gemma3"][1](config).eval()
    assert built.config._attn_implementation == A.NAME
    model = model_for("gemma3")
    rope_extend.patch(model, "dual_chunk", chunk_size=24)
    built.load_state_dict(model.state_dict())
    x = ids()
    assert (run(built, x) - run(model, x)).abs().max().item() < 1e-6


@pytest.mark.parametrize(
    "method, params, message",
    [
        ("self_extend", dict(group_size=0), "group_size must be an integer >= 1"),
        ("self_extend", dict(window=L), "window must be < the original length L=32"),
        ("self_extend", dict(group_size=4, window=8, factor=10), "reaches 104 tokens"),
        ("dual_chunk", dict(chunk_size=L), "chunk_size must be < the original length L=32"),
        ("dual_chunk", dict(chunk_size=16, local_window=16), "local_window must be < chunk_size"),
        ("rerope", dict(window=40), "window must be < the original length"),
        ("leaky_rerope", dict(window=8, k=1), "k must be > 1.0"),
        ("rerope", dict(logn="yes"), "logn must be true or false"),
        ("rerope", dict(group_size=2), "unknown parameter 'group_size' for method 'rerope'"),
        ("dual_chunk", dict(temperature=-0.1), "temperature must be >= 0.0"),
        ("dual_chunk", dict(temperature="yarn"), "temperature must be a finite number"),
        ("string", dict(shifted_offset=L), "shifted_offset must be < the original length L=32"),
        ("string", dict(shifted_offset=8, local_window=8), "local_window must be < shifted_offset"),
        ("string", dict(attention_factor=0), "attention_factor must be > 0.0"),
        ("string", dict(shifted_offset=12, local_window=4, factor=2), r"reaches 40 tokens \(L \+ shifted_offset"),
    ],
)
def test_bad_parameters_raise_before_touching(method, params, message):
    model = model_for("llama")
    before = model.config.to_dict()
    with pytest.raises(RopeExtendError, match=message):
        rope_extend.patch(model, method, **params)
    assert model.config.to_dict() == before and rope_extend.patched(model) is None


def test_string_scales_every_logit_by_the_square_of_its_attention_factor():
    """The authors multiply cos and sin by 1 + 0.1 ln 2; with shifted_offset past the sequence (no pair is
    shifted) STRING is plain RoPE with that scale on queries and keys, and attention_factor=1 is plain RoPE."""
    model = model_for("llama")
    x = ids(n=24)
    plain = run(model, x)
    rope_extend.patch(model, "string", shifted_offset=30, local_window=4, attention_factor=1.0)
    assert (run(model, x) - plain).abs().max().item() < 2e-5
    rope_extend.patch(model, "string", shifted_offset=30, local_window=4)
    assert model.get_decoder().rotary_emb.attention_scaling == pytest.approx(1 + 0.1 * math.log(2))
    scaled = run(model, x)
    rope_extend.unpatch(model)
    for layer in model.get_decoder().layers:  # the same logits from scaling the softmax scale by its square
        layer.self_attn.scaling *= (1 + 0.1 * math.log(2)) ** 2
    assert (run(model, x) - scaled).abs().max().item() < 2e-5


@pytest.mark.parametrize("temperature", [0.05, 0.1])
def test_dual_chunk_temperature_scales_every_logit_by_the_square_of_its_factor(temperature):
    """ChunkLlama's 0.05 ln(n/L) + 1 (and YaRN's 0.1, Qwen2.5-1M in vLLM) on cos and sin. With the chunk past the
    sequence (every pair intra-chunk, true positions) DCA at factor s is plain RoPE with every logit scaled by
    (1 + t ln s)^2; temperature 0 is the paper's DCA (plain RoPE here)."""
    model = model_for("llama")
    x = ids(n=24)
    plain = run(model, x)
    rope_extend.patch(model, "dual_chunk", chunk_size=30, local_window=4, factor=4, temperature=0)
    assert (run(model, x) - plain).abs().max().item() < 2e-5
    rope_extend.patch(model, "dual_chunk", chunk_size=30, local_window=4, factor=4, temperature=temperature)
    m = 1 + temperature * math.log(4)
    assert model.get_decoder().rotary_emb.attention_scaling == pytest.approx(m)
    scaled = run(model, x)
    rope_extend.unpatch(model)
    for layer in model.get_decoder().layers:
        layer.self_attn.scaling *= m**2
    assert (run(model, x) - scaled).abs().max().item() < 2e-5
    assert (scaled - plain).abs().max().item() > 1e-3  # the temperature changed something


def test_dual_chunk_temperature_with_chunks_exact_cached_and_reloaded(tmp_path):
    """Past the chunk, with the temperature at factor 4: exact against the explicit positions (the reference reads
    the patched rotary's scaled cos and sin), greedy generation with the cache equals without, and the config
    keeps the temperature through save and reload."""
    model = model_for("qwen2")
    x = ids()
    params = dict(METHODS["dual_chunk"], factor=4, temperature=0.1)
    rope_extend.patch(model, "dual_chunk", **params)
    want = reference_logits(model, "dual_chunk", METHODS["dual_chunk"], x)
    assert (run(model, x) - want).abs().max().item() < 2e-5
    prompt = ids(n=40, batch=1)
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
        uncached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    assert model.config.rope_parameters["temperature"] == 0.1
    model.save_pretrained(tmp_path)
    again = type(model).from_pretrained(tmp_path)
    assert again.config.rope_parameters["temperature"] == 0.1
    assert (run(again, x) - run(model, x)).abs().max().item() < 1e-6


def test_unknown_implementation_refused():
    model = model_for("llama")
    model.config._attn_implementation = "kernels-community/flash-attn"
    with pytest.raises(UnsupportedModelError, match="one of eager, sdpa, flash_attention_2.*kernels-community"):
        rope_extend.patch(model, "self_extend")
    assert rope_extend.patched(model) is None


def test_patched_names_the_kernels():
    model = model_for("gemma3")
    model.config._attn_implementation = "sdpa"
    rope_extend.patch(model, "self_extend", **METHODS["self_extend"])
    assert rope_extend.patched(model).kernel == "cpu_flash; other layers: sdpa"  # gemma3's local layers
    assert "kernel='cpu_flash; other layers: sdpa'" in repr(rope_extend.patched(model))
    rope_extend.patch(model, "linear", factor=2)  # a frequency method keeps the model's own attention
    assert rope_extend.patched(model).kernel == "sdpa"
    rope_extend.patch(model, "linear", factor=2, logn=True)  # log-n alone scales queries, keeps sdpa
    assert rope_extend.patched(model).kernel == "sdpa"
    model = model_for("llama")
    rope_extend.patch(model, "dual_chunk", **METHODS["dual_chunk"])
    assert rope_extend.patched(model).kernel == "cpu_flash"
    assert rope_extend.patched(model) == rope_extend.patched(model)  # the kernel is not part of the identity
    model = model_for("gemma2")  # logit softcapping: plain torch over key tiles
    model.config._attn_implementation = "sdpa"
    rope_extend.patch(model, "rerope", **METHODS["rerope"])
    assert rope_extend.patched(model).kernel == "torch_tiles; other layers: sdpa"


def padded_batch(n=N, pad=7):
    x = ids(n=n)
    mask = torch.ones_like(x)
    mask[1, :pad] = 0
    return x, mask


def logits_with(model, implementation, method, params, x, mask):
    model.config._attn_implementation = implementation
    rope_extend.patch(model, method, **params)
    with torch.no_grad():
        out = model(x, attention_mask=mask).logits
    assert model.config._attn_implementation == A.registered_name(implementation)
    rope_extend.unpatch(model)
    assert model.config._attn_implementation == implementation
    return out


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: local layers keep FlexAttention
def test_flex_attention_model_equals_the_sdpa_model(family, monkeypatch):
    """A model loaded with flex_attention: the method's layers read its BlockMask (padding, and the window of
    layers the method leaves alone), the other layers keep FlexAttention; logits as with sdpa."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model, (x, mask) = model_for(family), padded_batch()
    calls = spy(monkeypatch, "flex_attention", ALL_ATTENTION_FUNCTIONS["flex_attention"])
    assert_equals_sdpa(model, "flex_attention", ("self_extend", "dual_chunk"), x, mask, calls, family)


def spy(monkeypatch, implementation, fn) -> list:
    """Replace ``implementation`` by ``fn``, counting its calls (the returned list)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls = []
    monkeypatch.setitem(
        ALL_ATTENTION_FUNCTIONS._global_mapping, implementation, lambda *a, **k: calls.append(1) or fn(*a, **k)
    )
    return calls


def assert_equals_sdpa(model, implementation, methods, x, mask, calls, family):
    """Each method's logits over ``implementation`` equal those over sdpa; only the layers the method leaves
    alone (gemma3's two sliding layers) call the implementation itself."""
    for method in methods:
        want = logits_with(model, "sdpa", method, METHODS[method], x, mask)
        calls.clear()
        got = logits_with(model, implementation, method, METHODS[method], x, mask)
        assert (got[0] - want[0]).abs().max().item() < 1e-5, method
        assert (got[1, 7:] - want[1, 7:]).abs().max().item() < 1e-5, method
        assert len(calls) == (2 if family == "gemma3" else 0)  # the two sliding layers


def flash_stand_in(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, softcap=None, **kwargs
):
    """What FlashAttention computes, in plain torch on the CPU: a padding mask ``[b, m]`` or None, causal from
    the bottom right, and the layer's window."""
    n, m = query.shape[2], key.shape[2]
    i, j = torch.arange(m - n, m)[:, None], torch.arange(m)[None, :]
    allow = (j <= i)[None, None]
    if sliding_window:
        allow = allow & (i - j < sliding_window)
    if attention_mask is not None:
        allow = allow & attention_mask.bool()[:, None, None, :]
    groups = query.shape[1] // key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), attn_mask=allow, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_flash_attention_model_equals_the_sdpa_model(family, monkeypatch):
    """A model loaded with flash_attention_2 (FlashAttention stood in for by plain torch: no CUDA here): the
    method's layers read its padding mask and the layer's sliding window; the other layers keep its kernel."""
    calls = spy(monkeypatch, "flash_attention_2", flash_stand_in)
    over = {"sliding_window": 48} if family == "mistral" else {}  # mistral: the method's layers have a window
    model, (x, mask) = model_for(family, **over), padded_batch()
    assert_equals_sdpa(model, "flash_attention_2", ("self_extend", "rerope"), x, mask, calls, family)
    with torch.no_grad():  # and the stand-in is FlashAttention: the unpatched flash model equals the sdpa one
        model.config._attn_implementation = "flash_attention_2"
        flash = model(x, attention_mask=mask).logits
        model.config._attn_implementation = "sdpa"
        assert (flash[0] - model(x, attention_mask=mask).logits[0]).abs().max().item() < 1e-5


@pytest.mark.parametrize("implementation", ["flex_attention", "flash_attention_2"])
def test_generation_over_flex_and_flash_models_equals_the_sdpa_model(implementation, monkeypatch):
    """Greedy generation past L, with the cache and without, is the sdpa-patched model's (llama: every layer is
    the method's; transformers' own FlexAttention fails to compile Gemma 3's decode steps on the CPU)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", flash_stand_in)
    model = model_for("llama")
    prompt = ids(n=24, batch=1, seed=3)
    kw = dict(max_new_tokens=30, do_sample=False, min_new_tokens=30, pad_token_id=0)
    rope_extend.patch(model, "self_extend", **METHODS["self_extend"])
    with torch.no_grad():
        want = model.generate(prompt, **kw)
    rope_extend.unpatch(model)
    model.config._attn_implementation = implementation
    rope_extend.patch(model, "self_extend", **METHODS["self_extend"])
    with torch.no_grad():
        cached = model.generate(prompt, use_cache=True, **kw)
        uncached = model.generate(prompt, use_cache=False, **kw)
    assert want.shape[1] == 54 > 1.5 * L
    assert torch.equal(cached, want) and torch.equal(uncached, want)


def test_methods_listing_and_suite_spec(capsys):
    from rope_extend.cli import main
    from rope_extend.evaluation.suite import MethodSpec

    assert main(["methods"]) == 0
    listing = capsys.readouterr().out
    assert "self_extend" in listing and "attention" in listing and "LongLM" in listing and "logn" in listing
    assert MethodSpec(method="dual_chunk").name() == "dual_chunk"
    assert MethodSpec(method="self_extend", factor=4).name() == "self_extend x4"
    with pytest.raises(RopeExtendError, match=r"exactly one of factor \(.*\) and target_length"):
        MethodSpec(method="yarn")


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])  # gemma2: softcapping, the plain-torch path
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_passes_within_two_epsilons_of_the_float32_path(family, dtype, monkeypatch):
    """The passes run in the model's dtype (the kernels accumulate in float32). Measured on these models: logits
    within 1.2 epsilon (bf16) and 0.8 epsilon (fp16) of the largest logit of the path that upcasts every pass to
    float32; asserted: 2 epsilons."""
    x = ids()
    seen = []
    real_partial = passes._partial
    monkeypatch.setattr(
        passes, "_partial", lambda q, k, v, *a: seen.append({q.dtype, k.dtype, v.dtype}) or real_partial(q, k, v, *a)
    )
    for method, params in METHODS.items():
        model = model_for(family).to(dtype)
        rope_extend.patch(model, method, **params)
        seen.clear()
        got = run(model, x).float()
        assert seen and all(s == {dtype} for s in seen), (method, seen[:3])
        seen.clear()
        with monkeypatch.context() as m:
            m.setattr(passes, "compute_dtype", lambda d: torch.float32)
            want = run(model, x).float()
        assert seen and all(s == {torch.float32} for s in seen), (method, seen[:3])  # the patch reached the passes
        tolerance = 2 * torch.finfo(dtype).eps * want.abs().max().item()
        assert (got - want).abs().max().item() <= tolerance, (method, (got - want).abs().max().item(), tolerance)


def test_rotating_keys_in_pieces_is_exact(monkeypatch):
    model, x = model_for("llama"), ids()
    rope_extend.patch(model, "self_extend", **METHODS["self_extend"])
    whole = run(model, x)
    monkeypatch.setattr(passes, "ROTATE", 7)  # keys rotated 7 at a time, pieces not aligned to anything
    assert torch.equal(run(model, x), whole)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cut_passes_equal_whole_masked_passes(family, monkeypatch):
    model, x = model_for(family), ids()
    counts = {"causal": 0}
    real = kernels._flash_cpu

    def spy(q, k, v, allow, scaling, causal=False):
        counts["causal"] += causal
        return real(q, k, v, allow, scaling, causal)

    monkeypatch.setattr(kernels, "_flash_cpu", spy)
    for method, params in METHODS.items():
        rope_extend.patch(model, method, **params)
        cut = run(model, x)
        causal = counts["causal"]
        with monkeypatch.context() as m:
            m.setattr(kernels, "SPLIT", 10**6)  # never cut
            whole = run(model, x)
        assert counts["causal"] == causal, method  # uncut: no causal square ran
        rope_extend.unpatch(model)
        assert (cut - whole).abs().max().item() < 1e-5, method
    assert counts["causal"] > 0  # the diagonal blocks ran with the kernel's causal skipping


@pytest.mark.parametrize("shape", ["band", "far_square", "band_padded"])
def test_cpu_pass_cut_at_its_squares_equals_the_masked_kernel(shape, monkeypatch):
    """A self_extend block's passes: the near band (a mirror square, columns every row sees, a causal square) and
    the far keys' causal square each run with the kernel's causal skipping and no mask; a padded band keeps the
    mask where it must. Equal to the whole masked pass."""
    monkeypatch.setattr(kernels, "SPLIT", 4)
    n, w = 12, 20  # rows of the block, window
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, n, 16, generator=g)
    i = torch.arange(n)[:, None]
    if shape == "far_square":
        j = torch.arange(n)[None, :]
        allow, causal_pieces = j <= i, 1
    else:  # keys i - w + 1 .. i of row i, columns from the first row's first key
        j = torch.arange(n + w - 1)[None, :]
        allow, causal_pieces = (j >= i) & (j <= i + w - 1), 2
    allow = allow[None, None].expand(2, 1, -1, -1).clone()
    if shape == "band_padded":
        allow[1, :, :, :3] = False  # batch row 1 has 3 padded keys: its mirror square is no longer one
        causal_pieces = 1
    k, v = (torch.randn(2, 2, allow.shape[-1], 16, generator=g) for _ in range(2))
    calls = []
    real = kernels._flash_cpu

    def spy(q, k, v, allow, scaling, causal=False):
        calls.append((causal, allow is not None))
        return real(q, k, v, allow, scaling, causal)

    monkeypatch.setattr(kernels, "_flash_cpu", spy)
    out, lse = kernels._partial_cpu(q, k, v, allow, 0.25)
    want, want_lse = real(q, k, v, allow, 0.25)
    assert (out.float() - want).abs().max().item() < 1e-5
    assert (lse - want_lse).abs().max().item() < 1e-5
    assert sum(causal for causal, _ in calls) == causal_pieces
    assert not any(causal and masked for causal, masked in calls)


@pytest.mark.parametrize("family", ["persimmon", "chameleon"])
@pytest.mark.parametrize("method", ["self_extend", "dual_chunk"])
def test_left_padding_on_layers_given_no_position_ids(family, method):
    """Persimmon's and Chameleon's layers do not pass ``position_ids`` to the attention function: the method takes
    the decoder's (``PositionKeeper``), so a left-padded row equals the row alone (Self-Extend's groups and Dual
    Chunk's chunks count from absolute positions, which key slots would shift by the padding)."""
    from tests.families.tiny import build

    model = build(family)
    rope_extend.patch(model, method, **METHODS[method])
    x = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    pad = 5
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), x], 1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(x)], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        alone = model(input_ids=x).logits[0].float()
        row = model(input_ids=padded, attention_mask=mask, position_ids=positions).logits[0, pad:].float()
    assert (row - alone).abs().max().item() < 1e-4 * alone.abs().max().item()
