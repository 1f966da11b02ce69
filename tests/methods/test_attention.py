"""The position rules of the attention methods (``rope_extend.methods.attention``): pure math."""

import math

import pytest
import torch

from rope_extend import RopeExtendError
from rope_extend.methods import registry as M
from rope_extend.methods._common import Geometry
from rope_extend.methods.attention import DualChunkParams, LeakyReRopeParams, ReRopeParams, SelfExtendParams, logn_scale
from rope_extend.methods.string import StringParams

L = 64
RULES = {
    "self_extend": SelfExtendParams(group_size=4, window=16).rules(L),
    "dual_chunk": DualChunkParams(chunk_size=40, local_window=8).rules(L),
    "rerope": ReRopeParams(window=16).rules(L),
    "leaky_rerope": LeakyReRopeParams(window=16, k=4.0).rules(L),
    "string": StringParams(shifted_offset=20, local_window=4).rules(L),
}


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("first", [0, 37])  # keys from position 0, or a sliding cache starting at 37
def test_passes_cover_every_causal_pair_once_with_its_kind(name, first):
    rules = RULES[name]
    n = 200
    for a, b in rules.blocks(first, n, 24):
        assert a < b <= a + 24
        seen = torch.zeros(b - a, n, dtype=torch.int64)
        i = torch.arange(a, b)[:, None]
        for kind, j0, j1, full in rules.passes(a, b, first):
            j = torch.arange(j0, j1)[None, :]
            member = rules.region(kind, i, j) & (j <= i)
            if full:
                assert member.all(), (name, kind, a, b, j0, j1)
            seen[:, j0:j1] += member.long()
        j = torch.arange(n)[None, :]
        want = ((j <= i) & (j >= first)).long()
        assert torch.equal(seen, want), (name, a, b)


def test_relative_positions_stay_inside_L():
    i, j = torch.arange(3000)[:, None], torch.arange(3000)[None, :]
    causal = j <= i
    for name in ("dual_chunk", "rerope"):
        rules = RULES[name]
        for kind in rules.kinds:
            rel = rules.query_position(kind, i) - rules.key_position(kind, j)
            inside = rel[rules.region(kind, i, j) & causal]
            assert inside.min() >= 0 and inside.max() < L
    se = RULES["self_extend"]  # within its usable length (L - W) G + W = 208
    i, j = torch.arange(208)[:, None], torch.arange(208)[None, :]
    rel = se.query_position("far", i) - se.key_position("far", j)
    assert rel[se.region("far", i, j) & (j <= i)].max() < L


def test_dual_chunk_positions_as_in_the_issue():
    r = RULES["dual_chunk"]  # C = 40, w = 8, s = 32
    i = torch.tensor([70])  # chunk 2, i mod s = 6
    assert r.query_position("intra", i).item() == 6
    assert r.query_position("successive", i).item() == 38  # min(6 + 32, 40)
    assert r.query_position("successive", torch.tensor([95])).item() == 40  # min(31 + 32, 40)
    assert r.query_position("inter", i).item() == 40  # min(2 s - 1, C)
    assert r.key_position("inter", torch.tensor([33])).item() == 1


def test_self_extend_and_leaky_positions():
    se = RULES["self_extend"]  # G = 4, W = 16
    assert se.query_position("far", torch.tensor([100])).item() == 100 // 4 + 16 - 4
    assert se.key_position("far", torch.tensor([9])).item() == 2
    lk = RULES["leaky_rerope"]
    rel = lk.query_position("far", torch.tensor([100])) - lk.key_position("far", torch.tensor([40]))
    assert rel.item() == pytest.approx(16 + (60 - 16) / 4)


def test_string_shifts_far_positions_and_reaches_L_plus_S_minus_W():
    st = RULES["string"]  # S = 20, W = 4: reach 64 + 20 - 4 = 80
    assert StringParams(shifted_offset=20, local_window=4).usable_length(L) == 80
    i, j = torch.arange(80)[:, None], torch.arange(80)[None, :]
    far = st.region("far", i, j) & (j <= i)
    rel = st.query_position("far", i) - st.key_position("far", j)
    assert torch.equal(far, (i - j >= 20) & (j <= i))
    assert torch.equal(rel[far], (i - j - 16).expand(80, 80)[far]) and rel[far].max() == L - 1
    defaults = StringParams().rules(4096)  # the authors' S = 0.33 L, W = 128
    assert (defaults.window, defaults.local_window) == (1351, 128)


def test_logn_scale():
    p = torch.tensor([0, 63, 64, 4095])
    want = [1.0, 1.0, math.log(65) / math.log(64), math.log(4096) / math.log(64)]
    assert logn_scale(p, 64).tolist() == pytest.approx(want)


def test_defaults_come_from_L():
    assert DualChunkParams().rules(4096).chunk_size == 3072 and DualChunkParams().rules(4096).local_window == 256
    assert SelfExtendParams().rules(4096).window == 1024
    assert SelfExtendParams(group_size=8, window=1024).usable_length(4096) == 25600


def test_dual_chunk_temperature_is_chunkllamas_mscale():
    """ChunkLlama's get_mscale(s) = 0.05 ln s + 1 for s > 1, else 1, as the attention scale at the factor."""
    geo = Geometry(dim=64, base=10000.0, original_max_position_embeddings=4096)
    for s in (1.0, 2.0, 4.0, 16.0, 100.0):
        _, scale = M.get("dual_chunk").compute(DualChunkParams(), geo, s, None)
        assert scale == pytest.approx(0.05 * math.log(s) + 1.0 if s > 1 else 1.0)
        _, yarn = M.get("dual_chunk").compute(DualChunkParams(temperature=0.1), geo, s, None)
        assert yarn == pytest.approx(0.1 * math.log(s) + 1.0)  # YaRN's attention factor (Qwen2.5-1M)
        assert M.get("dual_chunk").compute(DualChunkParams(temperature=0), geo, s, None)[1] == 1.0


def test_factor_defaults_and_limits():
    se = M.resolve(M.get("self_extend"), original_max_position_embeddings=64, params={"group_size": 4, "window": 16})
    assert se.target_length == 208 and se.rules() is not None
    dca = M.resolve(M.get("dual_chunk"), original_max_position_embeddings=64, params={"logn": True})
    assert dca.factor == 1.0 and dca.logn and "logn" in dca.describe()
    with pytest.raises(RopeExtendError, match="give exactly one of factor"):
        M.resolve(M.get("yarn"), original_max_position_embeddings=64, params={"logn": True})
    with pytest.raises(RopeExtendError, match="reaches 208 tokens"):
        M.resolve(
            M.get("self_extend"), factor=4, original_max_position_embeddings=64, params={"group_size": 4, "window": 16}
        )


@pytest.mark.parametrize("name", list(RULES))
def test_key_runs_and_unmoved_keys_are_what_the_positions_say(name):
    """``run_length``: ``key_position(j) - j`` is constant over each run of keys from 0 (a few queries may turn
    once per run instead of turning the keys); ``moves_keys`` False: the keys stay at ``j``."""
    rules = RULES[name]
    j = torch.arange(500)
    for kind in rules.kinds:
        shift = rules.key_position(kind, j) - j
        if not rules.moves_keys(kind):
            assert torch.equal(shift, torch.zeros_like(shift)), (name, kind)
        if rules.run_length is not None:
            for start in range(0, 500, rules.run_length):
                run = shift[start : start + rules.run_length]
                assert torch.equal(run, run[:1].expand_as(run)), (name, kind, start)
    assert (rules.run_length is not None) == (name == "dual_chunk")
    assert any(rules.moves_keys(k) for k in rules.kinds) == (name != "string")


def test_a_multiplier_that_would_overflow_the_scores_is_refused():
    """Issue 51, item 3: dual_chunk temperature=1e30 and string attention_factor=1e20 gave NaN logits and a 0%
    result with exit 0. The cos/sin multiplier is bounded by MAX_ATTENTION_FACTOR (every logit by its square)."""
    from rope_extend.errors import RopeExtendError
    from rope_extend.methods._common import MAX_ATTENTION_FACTOR
    from rope_extend.methods.attention import DualChunkParams
    from rope_extend.methods.string import StringParams

    with pytest.raises(RopeExtendError, match=r"temperature=1e\+30 at factor 4 .*temperature <= 6\.492"):
        DualChunkParams(temperature=1e30).attention_factor(4.0)
    assert DualChunkParams(temperature=0.05).attention_factor(4.0) == pytest.approx(1 + 0.05 * math.log(4))
    most = (MAX_ATTENTION_FACTOR - 1) / math.log(4.0)
    assert DualChunkParams(temperature=most).attention_factor(4.0) == pytest.approx(MAX_ATTENTION_FACTOR)
    with pytest.raises(RopeExtendError, match="attention_factor must be <= 10, got 1e\\+20"):
        StringParams(attention_factor=1e20)
    assert StringParams(attention_factor=MAX_ATTENTION_FACTOR).attention_factor == MAX_ATTENTION_FACTOR
