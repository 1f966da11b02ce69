"""torch.compile of a patched model's forward, decoding with a static cache (rope_extend.hf.compiled), with
inductor on the CPU: a static frequency method (yarn), a dynamic one (dynamic: the cache keeper re-rotates the
cached keys when the frequencies change), an attention method (self_extend) and log-n (in the graph, under
fullgraph=True too). Each compiled decode gives the eager decode's tokens and logits (within 1e-5) and the
uncached reference's greedy tokens, logits within 2e-5 of it (the dynamic method: tokens only, its cached logits
differ from an uncached forward's by design, tests/test_cache.py); fullgraph=True is refused, with the reason,
where rope-extend must read values on the host. About a minute a cell on 2 CPU cores: marked slow."""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import StaticCache

import rope_extend
from rope_extend import cache_kwargs
from tests.test_attention import METHODS, L, model_for, reference_logits

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")]

PROMPT, STEPS = 24, 12  # 36 tokens: past L = 32, and past the dynamic method's first change of frequencies
CELLS = {  # name -> (method, parameters)
    "yarn": ("yarn", {"factor": 4}),
    "dynamic": ("dynamic", {"factor": 4}),
    "self_extend": ("self_extend", METHODS["self_extend"]),
    "logn": ("linear", {"factor": 1, "logn": True}),
}


def patched(cell):
    method, params = CELLS[cell]
    return rope_extend.patch(model_for("llama"), method, **params)


def prompt():
    return torch.randint(3, 500, (1, PROMPT), generator=torch.Generator().manual_seed(0))


def decode(model, forward):
    """An eager prefill, then ``STEPS`` greedy steps through ``forward`` with a ``StaticCache``: the logits of the
    prefill's last token and of every step ``[STEPS + 1, vocab]``, and the tokens."""
    x = prompt()
    cache = StaticCache(config=model.config, max_cache_len=48)
    with torch.no_grad():
        logits = [model(x, **cache_kwargs(cache), attention_mask=torch.ones_like(x)).logits[0, -1]]
        for _ in range(STEPS):
            x = torch.cat([x, logits[-1].argmax().view(1, 1)], 1)
            out = forward(
                x[:, -1:],
                **cache_kwargs(cache),
                position_ids=torch.tensor([[x.shape[1] - 1]]),
                attention_mask=torch.ones_like(x),
            )
            logits.append(out.logits[0, -1])
    return torch.stack(logits), x


def reference(model, cell, tokens):
    """The uncached logits of the positions that chose the generated tokens."""
    method, params = CELLS[cell]
    if method in METHODS:
        logits = reference_logits(model, method, params, tokens)
    elif cell == "logn":
        logits = reference_logits(model, "none", {}, tokens, logn=True)
    else:
        with torch.no_grad():
            logits = model(tokens).logits
    return logits[0, PROMPT - 1 :]


@pytest.mark.parametrize("cell", list(CELLS))
def test_compiled_decoding_with_a_static_cache(cell):
    torch._dynamo.reset()  # a fresh cache of compiled frames: no recompile limit reached by an earlier test
    counters.clear()
    model = patched(cell)
    got, tokens = decode(model, torch.compile(model.forward, fullgraph=cell == "logn"))
    assert counters["stats"]["unique_graphs"] > 0  # it did compile
    eager, eager_tokens = decode(model, model.forward)
    assert torch.equal(tokens, eager_tokens)
    assert (got - eager).abs().max().item() < 1e-5
    want = reference(model, cell, tokens)
    assert tokens.shape[1] > L and torch.equal(tokens[0, PROMPT:], want[:-1].argmax(-1))
    if cell != "dynamic":
        assert (got - want[: STEPS + 1]).abs().max().item() < 2e-5


def test_generate_compiles_its_decoding_with_a_static_cache():
    """generate's own compile path (a static cache and ``compile_config``; on the CPU only with
    ``_compile_all_devices``): greedy tokens and logits as the reference's."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    model = patched("self_extend")
    config = CompileConfig()
    config._compile_all_devices = True
    with torch.no_grad():
        out = model.generate(
            prompt(),
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            do_sample=False,
            pad_token_id=0,
            cache_implementation="static",
            compile_config=config,
            return_dict_in_generate=True,
            output_logits=True,
        )
    assert hasattr(model, "_compiled_call")
    want = reference(model, "self_extend", out.sequences)[:-1]
    assert torch.equal(out.sequences[0, PROMPT:], want.argmax(-1))
    assert (torch.cat(out.logits) - want).abs().max().item() < 2e-5


@pytest.mark.parametrize(
    "cell, reason",
    [
        ("self_extend", "rope-extend's self_extend attention splits each layer into passes by position ids"),
        ("dynamic", r"rope-extend's dynamic methods \(dynamic, dynamic_yarn, longrope\) read the sequence length"),
    ],
)
def test_fullgraph_is_refused_with_the_reason(cell, reason):
    torch._dynamo.reset()
    model = patched(cell)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=reason):
        decode(model, torch.compile(model.forward, fullgraph=True, backend="eager"))
