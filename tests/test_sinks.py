"""Attention sinks (``rope_extend.sinks``, StreamingLLM): the cache stays within sinks + window, positions stay
inside it, and every step's logits equal a recompute of the kept tokens; a continued generation, beam search and
chunked prefill are exact, and inputs that repeat or skip tokens the cache has seen are refused."""

import logging
import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers as T

import rope_extend
from rope_extend import RopeExtendError, SinkCache, UnsupportedModelError, cache_kwargs
from rope_extend.hf import cache_name
from tests.tiny import tiny_model

SINKS, WINDOW = 3, 13


def kept_tokens(seq, sinks=SINKS, window=WINDOW):
    return seq if len(seq) <= sinks + window else seq[:sinks] + seq[-window:]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3", "phi", "gpt_neox", "cohere"])
def test_every_step_equals_a_recompute_of_the_kept_tokens(family):
    """One layer, so a token's key and value depend on the token and its position only: after each step the
    logits equal an uncached forward of the kept tokens (sinks, then the window) at positions 0 .. n-1. Half
    pairing, interleaved (Cohere), partial rotary (Phi, GPT-NeoX), q/k norms (Qwen3), a sliding window and
    two frequency sets (Gemma 2, 3)."""
    model = tiny_model(family, max_position_embeddings=64, num_hidden_layers=1).eval()
    torch.manual_seed(0)
    seq = torch.randint(3, 500, (10,)).tolist()
    cache = SinkCache(model, sink_tokens=SINKS, window=WINDOW)
    worst = 0.0
    with torch.no_grad():
        out = model(torch.tensor([seq]), **cache_kwargs(cache), use_cache=True)
        for step in range(40):
            token = int(out.logits[0, -1].argmax()) if step % 3 else int(torch.randint(3, 500, ()))
            seq.append(token)
            out = model(torch.tensor([[token]]), **cache_kwargs(cache), use_cache=True)
            kept = kept_tokens(seq)
            assert cache.held == len(kept) <= SINKS + WINDOW and cache.get_seq_length() == len(seq)
            want = model(torch.tensor([kept])).logits[0, -1]
            worst = max(worst, (out.logits[0, -1] - want).abs().max().item())
    assert cache.evicted == len(seq) - SINKS - WINDOW == 34
    assert worst < 1e-4, worst


def _positions_seen(model):
    seen = []
    rotary = model.get_decoder().rotary_emb

    def record(module, args, kwargs):
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        seen.append(int(positions.max()))

    handle = rotary.register_forward_pre_hook(record, with_kwargs=True)
    return seen, handle


@pytest.mark.parametrize("family, method", [("llama", None), ("qwen2", "yarn"), ("gemma3", None)])
def test_generate_stays_within_the_cache_and_equals_the_full_cache_until_it_fills(family, method):
    model = tiny_model(family, max_position_embeddings=64).eval()
    if method:
        rope_extend.patch(model, method, factor=2)
    torch.manual_seed(0)
    ids = torch.randint(3, 500, (1, 10))
    with torch.no_grad():
        roomy = model.generate(ids, max_new_tokens=30, do_sample=False, **cache_kwargs(SinkCache(model, 4, 100)))
        full = model.generate(ids, max_new_tokens=30, do_sample=False)
        assert torch.equal(roomy, full)  # nothing evicted: the same as transformers' DynamicCache
        cache = SinkCache(model, sink_tokens=4, window=20)
        seen, handle = _positions_seen(model)
        try:
            out = model.generate(ids, max_new_tokens=200, do_sample=False, **cache_kwargs(cache))
        finally:
            handle.remove()
    assert out.shape == (1, 210)
    assert max(seen) == 23  # positions never leave the cache
    assert all(layer.keys.shape[-2] == 24 for layer in cache.layers) and cache.evicted == 209 - 24
    shorter = SinkCache(model, sink_tokens=4, window=20)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=40, do_sample=False, **cache_kwargs(shorter))
    assert shorter.nbytes() == cache.nbytes() > 0  # 50 tokens or 210: the same bytes


def test_the_prompt_window_padding_and_parameters_are_checked():
    model = tiny_model("llama", max_position_embeddings=64).eval()
    ids = torch.randint(3, 500, (2, 12))
    with pytest.raises(RopeExtendError, match="12 new tokens in one forward, more than the window of 8"):
        model.generate(ids, max_new_tokens=2, **cache_kwargs(SinkCache(model, 2, 8)))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(RopeExtendError, match="attention mask has padding"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, **cache_kwargs(SinkCache(model, 2, 30)))
    with pytest.raises(RopeExtendError, match="window must be an integer >= 1"):
        SinkCache(model, 2, 0)
    with pytest.raises(RopeExtendError, match="sink_tokens must be an integer >= 0"):
        SinkCache(model, -1, 8)


@pytest.mark.parametrize("method", ["dynamic", "self_extend", "dual_chunk"])
def test_methods_that_assign_positions_themselves_are_refused(method):
    model = tiny_model("llama", max_position_embeddings=64).eval()
    rope_extend.patch(model, method, **({"factor": 2} if method == "dynamic" else {}))
    with pytest.raises(UnsupportedModelError, match="attention sinks assign positions inside the cache"):
        SinkCache(model, 4, 20)


def test_a_cache_made_before_a_dynamic_patch_is_refused_at_the_forward():
    model = tiny_model("llama", max_position_embeddings=64).eval()
    cache = SinkCache(model, 4, 20)
    rope_extend.patch(model, "dynamic_yarn", factor=2)
    with pytest.raises(UnsupportedModelError, match="dynamic_yarn is a dynamic method"):
        model.generate(torch.randint(3, 500, (1, 6)), max_new_tokens=2, **cache_kwargs(cache))


def _one_layer(family="llama"):
    return tiny_model(family, max_position_embeddings=64, num_hidden_layers=1).eval()


def _reference_logits(model, seq):
    """The per-step reference: an uncached forward of the kept tokens at positions 0 .. n-1."""
    return model(torch.tensor([kept_tokens(seq)])).logits[0, -1]


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize("rows", [1, 2])
def test_a_continued_generate_equals_one_uninterrupted_generate(sample, rows):
    """generate(out, cache=cache) after generate(ids, cache=cache) gives the tokens of one generate of both
    lengths (the same forwards: the continuation's first one feeds only out's last token). 10 + 70 tokens through
    a cache of 24: it fills and evicts 55 tokens, across the break."""
    model = tiny_model("llama", max_position_embeddings=64).eval()
    torch.manual_seed(0)
    ids = torch.randint(3, 500, (1, 10)).expand(rows, -1)  # equal rows: no padding
    options = dict(do_sample=sample, top_k=0 if sample else None)
    fed = []
    handle = model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        with torch.no_grad():
            torch.manual_seed(1)
            whole = model.generate(ids, **cache_kwargs(SinkCache(model, 4, 20)), max_new_tokens=70, **options)
            cache = SinkCache(model, 4, 20)
            torch.manual_seed(1)
            out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=30, **options)
            fed.clear()
            out = model.generate(out, **cache_kwargs(cache), max_new_tokens=40, **options)
    finally:
        handle.remove()
    assert fed[0] == 1  # before: 16, the tokens past the capped cache length fed again at new positions
    assert torch.equal(out, whole)
    assert cache.held == 24 and cache.get_seq_length() == 79 and cache.evicted == 55


def test_continuing_with_new_tokens_equals_the_per_step_reference():
    """generate(torch.cat([out, new], 1), cache=cache), the issue's case: the first forward feeds out's last
    token and the 6 new ones into a full cache (7 evictions in one forward, the mask causal among them), and every
    step's logits equal the uncached forward of the kept tokens (one layer)."""
    model = _one_layer()
    torch.manual_seed(0)
    ids = torch.randint(3, 500, (1, 10))
    cache = SinkCache(model, SINKS, WINDOW)
    with torch.no_grad():
        out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=20, do_sample=False)
        new = torch.randint(3, 500, (1, 6))
        result = model.generate(
            torch.cat([out, new], 1),
            **cache_kwargs(cache),
            max_new_tokens=20,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
        seq, start = result.sequences[0].tolist(), out.shape[1] + 6
        worst = max(
            (logits[0] - _reference_logits(model, seq[: start + i])).abs().max().item()
            for i, logits in enumerate(result.logits)
        )
    assert len(result.logits) == 20 and cache.evicted == len(seq) - 1 - SINKS - WINDOW
    assert worst < 1e-4, worst


def test_beam_search_scores_equal_the_per_step_reference():
    """Beam search reorders the cache's rows; every row keeps its own beam's sinks and window, so the returned
    score is the sum of the reference log-probabilities of its tokens (one layer, 30 tokens through a cache of 16)."""
    model = _one_layer()
    torch.manual_seed(0)
    ids = torch.randint(3, 500, (1, 10))
    cache = SinkCache(model, SINKS, WINDOW)
    with torch.no_grad():
        result = model.generate(
            ids,
            **cache_kwargs(cache),
            max_new_tokens=30,
            min_new_tokens=30,
            num_beams=3,
            do_sample=False,
            length_penalty=0.0,  # the score is the plain sum of log-probabilities
            return_dict_in_generate=True,
            output_scores=True,
        )
        seq = result.sequences[0].tolist()
        want = sum(torch.log_softmax(_reference_logits(model, seq[:t]), -1)[seq[t]].item() for t in range(10, 40))
    assert cache.layers[0].keys.shape[:3] == (3, 2, SINKS + WINDOW)  # three beams, each its own rows
    assert abs(result.sequences_scores[0].item() - want) < 1e-4
    with pytest.raises(RopeExtendError, match="the cache holds 3 rows and this forward brings 1"):
        model.generate(result.sequences, **cache_kwargs(cache), max_new_tokens=2)


def test_a_long_prompt_in_prefill_chunks_equals_the_per_step_reference():
    """A prompt longer than the window, fed by generate in chunks of the window (prefill_chunk_size)."""
    model = _one_layer()
    torch.manual_seed(0)
    prompt = torch.randint(3, 500, (1, 40))
    cache = SinkCache(model, SINKS, WINDOW)
    with torch.no_grad():
        result = model.generate(
            prompt,
            **cache_kwargs(cache),
            max_new_tokens=5,
            do_sample=False,
            prefill_chunk_size=WINDOW,
            return_dict_in_generate=True,
            output_logits=True,
        )
        seq = result.sequences[0].tolist()
        worst = max(
            (lg[0] - _reference_logits(model, seq[: 40 + i])).abs().max().item() for i, lg in enumerate(result.logits)
        )
    assert worst < 1e-4, worst
    with pytest.raises(RopeExtendError, match="prefill_chunk_size=13"):
        model.generate(prompt, **cache_kwargs(SinkCache(model, SINKS, WINDOW)), max_new_tokens=2)


def test_inputs_that_repeat_or_skip_seen_tokens_are_refused():
    """The count seen is what every forward must continue: position ids from elsewhere, a mask of another length,
    the same prompt twice, or a cache asked to undo tokens (assisted decoding) are refused before the forward."""
    model = tiny_model("llama", max_position_embeddings=64).eval()
    ids = torch.randint(3, 500, (1, 10))
    cache = SinkCache(model, 4, 20)
    with torch.no_grad():
        out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=30, do_sample=False)  # 39 seen, 24 held
        before = [layer.keys.clone() for layer in cache.layers]
        with pytest.raises(RopeExtendError, match="positions start at 24, but the cache has seen 39"):
            model(out[:, -1:], **cache_kwargs(cache), position_ids=torch.tensor([[24]]))  # in-cache positions
        with pytest.raises(RopeExtendError, match="the attention mask covers 1 tokens, but the cache has seen 39"):
            model(out[:, -1:], **cache_kwargs(cache), attention_mask=torch.ones(1, 1, dtype=torch.long))
        with pytest.raises(RopeExtendError, match="but the cache has seen 39"):
            model.generate(ids, **cache_kwargs(cache), max_new_tokens=2)  # the first prompt again
        assert (
            all(torch.equal(a, layer.keys) for a, layer in zip(before, cache.layers, strict=True))
            and cache.get_seq_length() == 39
        )
        model(out[:, -1:], **cache_kwargs(cache), position_ids=torch.tensor([[39]]))  # the sequence's own: taken
        model(out[:, -1:], **cache_kwargs(cache), attention_mask=torch.ones(1, 41, dtype=torch.long))
        with pytest.raises((RopeExtendError, ValueError), match="crop"):  # 5.24 refuses it itself, 5.17 reaches crop
            model.generate(ids, **cache_kwargs(SinkCache(model, 4, 20)), max_new_tokens=20, prompt_lookup_num_tokens=3)
        with pytest.raises(RopeExtendError, match="SinkCache cannot be cropped"):
            cache.crop(30)


def test_the_temperature_of_llama4_nope_layers_follows_the_cache_positions():
    """Llama 4's NoPE layers scale their queries by log1p(floor((p + 1) / floor_scale)) at the position p a layer
    reads from the cache length: during the forward that is the kept count, as in the uncached reference of the
    kept tokens, not the count seen (which generate reads between forwards). floor_scale 4 makes it move."""
    config = T.Llama4TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        intermediate_size_mlp=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        no_rope_layers=[0],  # the one layer has no RoPE
        attn_temperature_tuning=True,
        floor_scale=4,
        attn_scale=2.0,
        num_local_experts=1,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = T.Llama4ForCausalLM(config).eval()
    seq = torch.randint(3, 500, (10,)).tolist()
    cache = SinkCache(model, SINKS, WINDOW)
    worst = 0.0
    with torch.no_grad():
        out = model(torch.tensor([seq]), **cache_kwargs(cache), use_cache=True)
        for _ in range(30):
            seq.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([seq[-1:]]), **cache_kwargs(cache), use_cache=True)
            worst = max(worst, (out.logits[0, -1] - _reference_logits(model, seq)).abs().max().item())
    assert cache.get_seq_length() == 40 and cache.held == SINKS + WINDOW
    assert worst < 1e-4, worst


def test_phi3_generate_with_original_max_position_embeddings_is_refused():
    """Phi-3's generate swaps the cache for a new one when the sequence first passes
    original_max_position_embeddings: the sinks would stop there, silently (seen before: a DynamicCache came back)."""
    model = tiny_model("phi3", max_position_embeddings=64, original_max_position_embeddings=32).eval()
    with pytest.raises(UnsupportedModelError, match=r"Phi3ForCausalLM.generate replaces the cache .*\(32\)"):
        SinkCache(model, 4, 20)


def test_both_argument_names():
    """``cache=`` (transformers >= 5.24) and ``past_key_values=`` (every version; 5.24 warns) give the same
    logits; on a transformers that names it past_key_values, ``cache=`` (which its forwards would ignore) is
    refused. ``cache_kwargs`` picks the installed name and never warns."""
    model = tiny_model("llama", max_position_embeddings=64).eval()
    torch.manual_seed(0)
    seq = torch.randint(3, 500, (1, 30))

    def run(**name):
        cache = SinkCache(model, 4, 8)
        with torch.no_grad():
            outs = [model(seq[:, :8], use_cache=True, **{k: cache for k in name})]
            outs += [model(seq[:, t : t + 1], use_cache=True, **{k: cache for k in name}) for t in range(8, 30)]
        return torch.stack([o.logits[0, -1] for o in outs]), cache

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        mine, cache = run(**{cache_name.name(): True})
    assert cache.get_seq_length() == 30 and cache.evicted == 18
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        old, _ = run(past_key_values=True)
    assert torch.equal(mine, old)
    if cache_name.name() == "cache":
        with pytest.warns(FutureWarning, match="past_key_values"):
            run(past_key_values=True)
        new, _ = run(cache=True)
        assert torch.equal(new, old)
    else:
        with pytest.raises(RopeExtendError, match="names the cache argument past_key_values"):
            run(cache=True)
    out = model(seq[:, :3], use_cache=True, **cache_kwargs(SinkCache(model, 4, 8)))
    assert isinstance(cache_name.returned(out), SinkCache)


def _sink_example():
    """The documented SinkCache example (docs/serving.md), as its docs test runs it."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", page, re.DOTALL | re.MULTILINE)
    (code,) = [b for b in blocks if "SinkCache(" in b]
    return code


def test_the_documented_example_does_not_warn(caplog):
    """transformers 5.24 deprecates past_key_values (a FutureWarning from generate and forwards, a log line from
    out.past_key_values); the docs' example passes the name the installed transformers takes, so it runs clean
    on 5.24 and on 5.17. The once-only log cache is cleared first, so an earlier test cannot hide the line."""
    code = _sink_example()
    logging.Logger.warning_once.cache_clear()
    logger = logging.getLogger("transformers")
    logger.addHandler(caplog.handler)
    try:
        with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="transformers"):
            warnings.simplefilter("error", FutureWarning)
            exec(compile(code, "docs/serving.md SinkCache example", "exec"), {"__name__": "sink_example"})  # noqa: S102
    finally:
        logger.removeHandler(caplog.handler)
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]


def test_a_compressed_cache_is_refused_when_the_sink_cache_is_made():
    """DeepSeek-V3 (MLA) caches keys of another size than its attention sees, so evicting could not turn them:
    refused when the SinkCache is made, before any forward (not at the first eviction, after forwards ran)."""
    from tests.families.tiny import build

    model = build("deepseek_v3")
    with pytest.raises(rope_extend.UnsupportedModelError, match="attention sinks turn .*layer 0 caches keys of size"):
        rope_extend.SinkCache(model, sink_tokens=4, window=16)


@pytest.mark.parametrize(
    ("family", "layers"),
    [
        ("qwen3_next", r"layers 0-2 \(linear_attention\)"),  # gated delta nets, then one attention layer
        ("lfm2", r"layers 0, 1 \(conv\)"),  # short convolutions
        ("falcon_h1", r"layers 0, 1 \(hybrid\)"),  # Mamba heads beside attention in every layer
    ],
)
def test_a_recurrent_or_convolution_state_is_refused_when_the_sink_cache_is_made(family, layers):
    """A hybrid's linear-attention, Mamba and convolution layers cache a state that sums up every token seen, so no
    token can be evicted from it; the SinkCache was accepted and the first forward died in transformers with an
    IndexError. Refused when it is made, naming the layers and their kinds (from the config's layer types, by the
    ``state_layers`` family rule), and the model still generates with its own cache."""
    from tests.families.tiny import build

    model = build(family)
    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises(UnsupportedModelError) as refused:
        SinkCache(model, sink_tokens=2, window=8)
    message = str(refused.value)
    assert re.search(rf"^SinkCache: \w+ForCausalLM's {layers} keep a recurrent or convolution state", message), message
    assert "no token can be evicted" in message and "use a DynamicCache" in message and "\n" not in message
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # nothing installed on the model that changes it
    out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape == (1, 9)


@pytest.mark.parametrize("method", ["linear", "yarn"])
def test_log_n_with_a_frequency_method_is_refused_in_its_own_words(method):
    """log-n with a frequency method scales each query by its position in the sequence; the message said that
    linear and yarn are "attention-level methods", which they are not."""
    model = tiny_model("llama", max_position_embeddings=64).eval()
    rope_extend.patch(model, method, factor=2, logn=True)
    with pytest.raises(UnsupportedModelError) as refused:
        SinkCache(model, 4, 20)
    message = str(refused.value)
    assert f"log-n ({method} with logn=True) scales each query by its position in the sequence" in message
    assert "attention-level" not in message and f"{method} is an" not in message
    assert "use a static frequency method (yarn, ntk, linear, llama3) without logn, or none" in message
