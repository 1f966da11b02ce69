"""Length-adaptive dynamic_yarn served by the real vLLM engine (rope-extend's plugin), against transformers.

Runs where vLLM is importable with rope-extend's plugin registered (its own venv: tests/export/vllm_run.py is
started with this interpreter), else skips. SmolLM2-135M exported with L = 1024 (``--original-length 1024``) so
that 2L and 4L are 2k and 4k tokens; buckets x2, x4. Three engines, one after another (float32, CPU, eager):

- adaptive, prefix caching off: one mixed batch of a request inside L, one filling 2L and one filling 4L (prompt
  log-probs and 8 greedy tokens each) equals the unscaled model, rope-extend's yarn x2 and yarn x4 in transformers;
- adaptive, prefix caching on: the same 2040-token prompt served at x2 (max_tokens 8), then at x4 (max_tokens 16:
  2056 tokens), then both again: each equals the run without caching, the first x4 read nothing from the cache the
  x2 request filled, the repeats read it;
- static yarn x4 (``--approximate``): the 4L request equals the adaptive engine's, the one inside L does not (the
  reason for the adaptive form);
- each bucket's edge, pure scoring (``max_tokens=1``: the model is fed the prompt only), in one batch of the first
  engine: a prompt of exactly L tokens equals transformers' dynamic_yarn on it (the unscaled model), one of L + 1
  and one of exactly 2L equal yarn x2 (dynamic_yarn's ``l / L`` at 2L; the patched model rounds 2L up to its grid,
  2125 tokens, so it runs yarn x2.075 there: the export's note says so).

The throughput batches of docs/serving.md were timed once by hand; the test leaves them out so the CI's vLLM step
stays short (about 6 minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.engines, pytest.mark.slow, pytest.mark.real_model]
vllm = pytest.importorskip("vllm")

RUN = Path(__file__).with_name("vllm_run.py")
L = 1024
SHORT, X2, X4 = 700, 2040, 4088  # + 8 generated tokens: inside L, exactly 2L, exactly 4L
GEN = 8


def _plugin_registered() -> bool:
    from importlib.metadata import entry_points

    return any(e.value.startswith("rope_extend.export.vllm_plugin") for e in entry_points(group="vllm.general_plugins"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if not _plugin_registered():
        pytest.skip("rope-extend's vllm.general_plugins entry point is not installed in this environment")
    from rope_extend import fetch
    from rope_extend.export import export
    from rope_extend.loading import load_tokenizer, resolve_name

    try:
        source = resolve_name("smollm2-135m")
        texts = fetch.fetch("canterbury")
    except Exception as exc:  # noqa: BLE001 (no network and nothing cached: the marker's skip)
        pytest.skip(f"SmolLM2-135M or the texts cannot be obtained: {exc}")
    ids = load_tokenizer(source)(Path(texts, "lcet10.txt").read_text(encoding="utf-8")[:150000])["input_ids"]
    root = tmp_path_factory.mktemp("vllm-adaptive")
    adaptive = export(
        source, "vllm", root / "adaptive", method="dynamic_yarn", factor=4, original_max_position_embeddings=L
    )
    static = export(
        source,
        "vllm",
        root / "static",
        method="dynamic_yarn",
        factor=4,
        original_max_position_embeddings=L,
        approximate=True,
    )
    return {"ids": ids, "root": root, "adaptive": adaptive.out, "static": static.out, "source": source}


def serve(setup, model, prefix_caching, batches, name):
    spec = {"model": str(model), "max_model_len": 4 * L, "prefix_caching": prefix_caching, "enforce_eager": True}
    spec["batches"] = batches
    path, out = setup["root"] / f"{name}.json", setup["root"] / f"{name}-out.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    done = subprocess.run(
        [sys.executable, str(RUN), str(path), str(out)], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text(encoding="utf-8"))["batches"]


def mixed(ids):
    starts = (0, 5000, 10000)
    return [
        {"ids": ids[s : s + n], "max_tokens": GEN, "prompt_logprobs": True}
        for s, n in zip(starts, (SHORT, X2, X4), strict=True)
    ]


EDGES = (L, L + 1, 2 * L)  # scored with max_tokens=1: L positions fed (plain), L + 1 (x2), 2L (x2)


def edges(ids):
    return [{"ids": ids[24000 : 24000 + n], "max_tokens": 1, "prompt_logprobs": True} for n in EDGES]


PREFIX = {"start": 20000, "n": 2040}


def prefix_batches(ids):
    q = ids[PREFIX["start"] : PREFIX["start"] + PREFIX["n"]]
    x2, x4 = {"ids": q, "max_tokens": 8}, {"ids": q, "max_tokens": 16}
    return [[x2], [x4], [x4], [x2]]


@pytest.fixture(scope="module")
def runs(setup):
    ids = setup["ids"]
    off = serve(setup, setup["adaptive"], False, [mixed(ids), *prefix_batches(ids)[:2], edges(ids)], "off")
    on = serve(setup, setup["adaptive"], True, prefix_batches(ids), "on")
    static = serve(setup, setup["static"], False, [mixed(ids)], "static")
    return {"off": off, "on": on, "static": static}


@pytest.fixture(scope="module")
def reference(setup):
    """Prompt log-probs and greedy tokens in transformers: the unscaled model, rope-extend's yarn x2 and x4."""
    import rope_extend
    from rope_extend.loading import load_model

    model = load_model(setup["source"]).float().eval()
    out = []
    for request, factor in zip(mixed(setup["ids"]), (1, 2, 4), strict=True):
        if factor > 1:
            rope_extend.patch(model, "yarn", factor=factor, original_max_position_embeddings=L)
        x = torch.tensor([request["ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(x).logits[0].double(), -1)[:-1].gather(-1, x[0, 1:, None])[:, 0]
            tokens = model.generate(x, max_new_tokens=GEN, do_sample=False)[0, x.shape[1] :].tolist()
        out.append((logp, tokens))
    return out


@pytest.fixture(scope="module")
def edge_reference(setup):
    """Prompt log-probs in transformers of each edge request: rope-extend's dynamic_yarn (x4 from L = 1024) on the
    L-token prompt, the unscaled model beside it, and yarn x2 on the L + 1 and 2L-token prompts."""
    import rope_extend
    from rope_extend.loading import load_model

    def logp(model, request):
        x = torch.tensor([request["ids"]])
        with torch.no_grad():
            return torch.log_softmax(model(x).logits[0].double(), -1)[:-1].gather(-1, x[0, 1:, None])[:, 0]

    requests = edges(setup["ids"])
    model = load_model(setup["source"]).float().eval()
    plain = logp(model, requests[0])
    rope_extend.patch(model, "dynamic_yarn", factor=4, original_max_position_embeddings=L)
    dynamic = logp(model, requests[0])
    rope_extend.unpatch(model)
    rope_extend.patch(model, "yarn", factor=2, original_max_position_embeddings=L)
    x2 = [logp(model, r) for r in requests[1:]]
    return {"plain": plain, "dynamic": dynamic, "x2": x2}


def _prompt(answer) -> torch.Tensor:
    return torch.tensor(answer["prompt_logprobs"][1:], dtype=torch.float64)


def test_mixed_batch_each_request_its_own_numbers(runs, reference):
    for answer, (logp, tokens), name in zip(
        runs["off"][0]["answers"], reference, ("inside L", "2L", "4L"), strict=True
    ):
        got = _prompt(answer)
        assert (got - logp).abs().max() < 1e-3, name  # float32 kernels: 4e-5 to 7e-5 measured
        assert abs(got.sum() - logp.sum()) / abs(logp.sum()) < 1e-5, name
        assert answer["tokens"] == tokens, name


def test_static_yarn_changes_the_short_request_only(runs):
    adaptive, static = runs["off"][0]["answers"], runs["static"][0]["answers"]
    assert (_prompt(adaptive[2]) - _prompt(static[2])).abs().max() < 1e-3  # 4L: yarn x4 in both
    assert adaptive[2]["tokens"] == static[2]["tokens"]
    # inside L static yarn x4 is another model: the whole point of the adaptive form
    assert (_prompt(adaptive[0]) - _prompt(static[0])).abs().max() > 0.1


def test_prefix_caching_never_shares_blocks_across_factors(runs):
    off = [b["answers"][0] for b in runs["off"][1:3]]  # x2, x4 without caching
    on = [b["answers"][0] for b in runs["on"]]  # x2, x4, x4, x2 with caching
    assert off[0]["logprobs"] != off[1]["logprobs"][:8]  # the factor matters to this prompt
    for got, want in zip(on, [off[0], off[1], off[1], off[0]], strict=True):
        assert got["tokens"] == want["tokens"]
        assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)) < 1e-3
    assert on[0]["cached"] == 0 and on[1]["cached"] == 0  # x4 found no block of the x2 request
    assert on[2]["cached"] > 0 and on[3]["cached"] > 0  # each factor reads its own blocks


def test_each_bucket_edge_scored_as_transformers(runs, edge_reference):
    """Pure scoring (max_tokens=1) at the edges: L tokens are L positions fed, the unscaled model, as transformers'
    dynamic_yarn on them (the plugin counted prompt + max_tokens and served them at x2 before); L + 1 and 2L are
    yarn x2 (2L was served at x4)."""
    answers = runs["off"][3]["answers"]
    assert [len(a["prompt_logprobs"]) for a in answers] == list(EDGES)
    assert all(len(a["tokens"]) == 1 for a in answers)
    assert (edge_reference["dynamic"] - edge_reference["plain"]).abs().max() < 1e-5  # dynamic_yarn inside L: plain
    wants = [edge_reference["dynamic"], *edge_reference["x2"]]
    for answer, want, name in zip(answers, wants, ("L", "L + 1", "2L"), strict=True):
        got = _prompt(answer)
        assert (got - want).abs().max() < 1e-3, name
        assert abs(got.sum() - want.sum()) / abs(want.sum()) < 1e-5, name
