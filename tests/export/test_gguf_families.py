"""GGUF exports of every family the writer knows: run in llama.cpp (llama-cpp-python 0.3.36) against the patched
transformers model (marker ``engines``), and the refusals, before anything is written, of what llama.cpp's
architecture for a family would run differently.

Each llama.cpp case: a tiny random model of the family's own config class (tests/tiny.py; Qwen3-MoE here), its
weights drawn 5x wider than transformers' default so that positions visibly change the logits, patched with a
static method at factor 4 (L=256), exported with ``rope_extend.export(model, "gguf", ...)`` in float32 and run in
llama.cpp on the same 384 token ids (past L; the sliding layers of Gemma 2/3 see a 64-token window). Max
|logit difference| / max |reference logit| must stay under ``TOLERANCE``, the 8-token greedy continuations must
be equal, and the unscaled reference must be ``MISSED`` tolerances away past L (the scaling was not dropped).
Measured (transformers 5.24, 2 threads): llama llama3 5.7e-4, qwen2 yarn 7.4e-4, qwen3 yarn 1.1e-3, qwen3_moe
linear 6.8e-4, phi3 longrope 6.7e-4, phi3 llama3 5.8e-4, gemma linear 1.6e-4, gemma2 yarn 6.1e-4, gemma3 linear
6.8e-4, gemma3 yarn 6.6e-4; unscaled 5e-2 (gemma) to 1.0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T

import rope_extend
from rope_extend.export import export
from tests.tiny import _COMMON, tiny_model, tiny_tokenizer

L, TOKENS, NEW = 256, 384, 8
TOLERANCE = 2e-3  # max |logit difference| / max |reference logit|
MISSED = 10  # the unscaled reference is at least this many tolerances away past L
INIT = 0.1  # weights 5x transformers' default: attention sharp enough that positions change the logits
HALF = 8  # rotary pairs of the tiny heads (head_dim 16)
LONGROPE = {"short_factor": [1.0 + i / 64 for i in range(HALF)], "long_factor": [1.0 + i / 4 for i in range(HALF)]}
CASES = [  # (family, method, parameters, llama.cpp architecture)
    ("llama", "llama3", {}, "llama"),
    ("qwen2", "yarn", {}, "qwen2"),
    ("qwen3", "yarn", {}, "qwen3"),
    ("qwen3_moe", "linear", {}, "qwen3moe"),
    ("phi3", "longrope", LONGROPE, "phi3"),
    ("phi3", "llama3", {}, "phi3"),  # a frequency divisor, written as both long and short factors
    ("gemma", "linear", {}, "gemma"),
    ("gemma2", "yarn", {}, "gemma2"),
    ("gemma3", "linear", {}, "gemma3"),  # the global layers only; the sliding ones keep base 10000, unscaled
    ("gemma3", "yarn", {}, "gemma3"),
]


def tiny(family: str):
    if family != "qwen3_moe":
        return tiny_model(family, initializer_range=INIT)
    torch.manual_seed(0)
    config = T.Qwen3MoeConfig(
        **_COMMON,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        initializer_range=INIT,
    )
    return T.Qwen3MoeForCausalLM(config).eval()


def llama_cpp_logits(path, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=512, n_batch=512, logits_all=True, n_threads=2, verbose=False)
    try:
        llm.eval(ids)
        logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
        greedy = []
        for _ in range(NEW):
            greedy.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([greedy[-1]])
    finally:
        llm.close()
    return logits, greedy


def transformers_logits(model, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=int)
        )
    return logits, out[0, len(ids) :].tolist()


@pytest.mark.engines
@pytest.mark.parametrize(("family", "method", "params", "arch"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_llama_cpp_matches_the_patched_family(tmp_path, family, method, params, arch):
    pytest.importorskip("llama_cpp")
    gguf = pytest.importorskip("gguf")
    model = tiny(family)
    ids = torch.randint(3, 460, (TOKENS,), generator=torch.Generator().manual_seed(1)).tolist()
    plain, _ = transformers_logits(model, ids)
    rope_extend.patch(model, method, factor=4.0, **params)
    want, want_greedy = transformers_logits(model, ids)
    result = export(
        model, "gguf", tmp_path / "m.gguf", tokenizer=tiny_tokenizer(), tokenizer_pre="smollm", approximate=True
    )
    field = gguf.GGUFReader(result.out).fields["general.architecture"]
    assert bytes(field.parts[-1]).decode() == arch
    got, got_greedy = llama_cpp_logits(result.out, ids)
    scale = float(np.abs(want).max())
    diff = float(np.abs(got - want).max()) / scale
    missed = float(np.abs(got[L:] - plain[L:]).max()) / scale
    print(f"{family} {method}: max |diff| / logit scale {diff:.2e} (unscaled: {missed:.2e}); {result.how}")
    assert diff < TOLERANCE
    assert missed > MISSED * TOLERANCE
    assert got_greedy == want_greedy


# ----------------------------------------------------------------------------------------------- refusals
REFUSED = [  # (family, config overrides, method, parameters, what the message says)
    ("qwen2", {}, "llama3", {}, "reads no rope_freqs tensor"),
    ("qwen3", {}, "yarn", {"beta_fast": 16.0}, "betas other than 32/1"),
    ("qwen3", {}, "longrope", LONGROPE, "reads no rope_factors_long/short"),
    ("gemma3", {}, "yarn", {"attention_factor": 1.3}, "to the sliding layers too"),
    ("gemma2", {"query_pre_attn_scalar": 32}, "linear", {}, "query_pre_attn_scalar 32"),
    ("gemma2", {"final_logit_softcapping": None}, "linear", {}, "always soft-caps"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}, "linear", {}, "window"),
    ("qwen3_moe", {"norm_topk_prob": False}, "linear", {}, "renormalises"),
    ("phi", {}, "linear", {}, "not 'phi'"),
]


@pytest.mark.parametrize(("family", "overrides", "method", "params", "message"), REFUSED, ids=[r[-1] for r in REFUSED])
def test_what_llama_cpp_runs_differently_is_refused_before_writing(
    tmp_path, family, overrides, method, params, message
):
    pytest.importorskip("gguf")
    model = (
        tiny(family)
        if family == "qwen3_moe"
        else tiny_model(family, **{k: v for k, v in overrides.items() if v is not None})
    )
    for key, value in overrides.items():  # None too, which tiny_config leaves out
        setattr(model.config, key, value)
    with pytest.raises(rope_extend.UnsupportedModelError, match=message):
        export(
            model,
            "gguf",
            tmp_path / "m.gguf",
            tokenizer=tiny_tokenizer(),
            tokenizer_pre="smollm",
            method=method,
            factor=4.0,
            approximate=True,
            **params,
        )
    assert list(tmp_path.iterdir()) == []


def test_gemma3_keeps_the_sliding_layers_base_and_the_shipped_global_scaling(tmp_path):
    """Gemma 3 4B and up ship ``linear`` x8 on the global layers only: the file says it for the global layers
    and gives the sliding ones their own base (``rope.freq_base_swa``) and their pattern."""
    gguf = pytest.importorskip("gguf")
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    model = tiny_model("gemma3", rope_parameters=rope)
    result = export(model, "gguf", tmp_path / "m.gguf", tokenizer=tiny_tokenizer(), tokenizer_pre="smollm")
    fields = gguf.GGUFReader(result.out).fields

    def value(key):
        field = fields[f"gemma3.{key}"]
        return [field.parts[i].tolist()[0] for i in field.data] if len(field.data) > 1 else field.parts[-1].tolist()[0]

    assert bytes(fields["gemma3.rope.scaling.type"].parts[-1]).decode() == "linear"
    assert value("rope.scaling.factor") == 8.0 and value("rope.freq_base") == 1000000.0
    assert value("rope.freq_base_swa") == 10000.0 and value("attention.sliding_window") == 64
    assert value("attention.sliding_window_pattern") == [True, False, True, False]
    with pytest.raises(
        rope_extend.UnsupportedModelError,
        match="gemma3_text keeps one rope dict per layer type; the vllm export writes one flat",
    ):
        export(model, "vllm", tmp_path / "v")  # the folder targets still write one flat rope dict


def test_a_sentencepiece_tokenizer_is_refused_with_the_flags_that_add_the_rope(tmp_path):
    """A BPE with byte fallback in no shape the writer knows (no ``▁`` for spaces: neither byte-level nor
    SentencePiece, ``gguf_spm``) is refused: the refusal gives the rope as llama.cpp's ``--override-kv`` flags
    for a file converted elsewhere."""
    pytest.importorskip("gguf")
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3}
    piece = T.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], byte_fallback=True))
    )
    model = tiny_model("gemma2")
    rope_extend.patch(model, "yarn", factor=4.0)
    with pytest.raises(rope_extend.UnsupportedModelError, match="byte-level BPE") as error:
        export(model, "gguf", tmp_path / "m.gguf", tokenizer=piece)
    assert "--override-kv gemma2.rope.scaling.type=str:yarn --override-kv gemma2.rope.scaling.factor=float:4.0" in str(
        error.value
    )
    assert list(tmp_path.iterdir()) == []
