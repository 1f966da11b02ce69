"""Tiled MLPs (``hf.tiling``, the ``memory`` recipe keys): exact, reversible, and refused where they cannot be exact.

The equality tests compare one LoRA forward/backward through rope-extend's loss (``training.loss.model_loss``) with
and without DeepSpeed's TiledMLP on every decoder MLP: the loss and every trained gradient must agree to float32
rounding (measured 7e-9), and the MLPs must really have run in tiles (their projections are counted).
"""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("deepspeed")

from rope_extend.errors import RopeExtendError, UnsupportedModelError
from rope_extend.hf import checkpointing
from rope_extend.hf.tiling import decoder_mlps, packed, tile_mlps, tiled, tiles_for, untile
from rope_extend.training import RecipeError, load_args, train
from rope_extend.training.loss import model_loss
from tests.training.test_loop import FAST as LOOP_FAST

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def build(targets, *, lora_dropout=0.0, save=None, seed=0):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="sdpa")).float()
    model.config.use_cache = False
    if targets is None:  # full training
        return model.train()
    model = get_peft_model(
        model,
        LoraConfig(r=4, lora_alpha=8, lora_dropout=lora_dropout, target_modules=targets, modules_to_save=save),
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero: draw it so that every LoRA gradient is non-zero
            p.data.normal_(0, 0.05)
    return model.train()


def batch(rows=2, tokens=37):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, CONFIG["vocab_size"], (rows, tokens), generator=g)
    targets = torch.cat([ids[:, 1:], torch.full((rows, 1), -100)], 1)
    return {"input_ids": ids, "position_ids": torch.arange(tokens).expand(rows, -1), "targets": targets}


def step(model, data):
    model.zero_grad(set_to_none=True)
    total, n = model_loss(model, data, 16)
    (total / n).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
    return float(total) / n, grads


def count_calls(model):
    """How often each layer's down projection runs (one call per tile in forward, one per tile in backward)."""
    calls = []
    for mlp in decoder_mlps(model):
        down = mlp.down_proj
        counter = {"n": 0}
        down.register_forward_hook(lambda *_, c=counter: c.__setitem__("n", c["n"] + 1))
        calls.append(counter)
    return calls


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize(
    "targets,tiles",
    [(ATTENTION, None), (ATTENTION, 3), (MLP, 3), (ATTENTION + MLP, 7), (None, 4)],
    ids=["attention-rule", "attention-3", "mlp-3", "both-7", "full-4"],
)
def test_loss_and_every_trained_gradient_equal_the_untiled_run(targets, tiles, checkpointed):
    data = batch()
    want_model, got_model = build(targets), build(targets)
    if checkpointed:
        checkpointing.enable(want_model)
        checkpointing.enable(got_model)
    want_loss, want = step(want_model, data)
    tile_mlps(got_model, tiles)
    calls = count_calls(got_model)
    got_loss, got = step(got_model, data)
    assert got_loss == pytest.approx(want_loss, abs=1e-6)
    assert got.keys() == want.keys() and len(got) > 0
    for name in want:
        assert want[name].abs().max() > 0, name  # a gradient that is zero would prove nothing
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)
    # it did tile: forward runs every tile once, backward recomputes each (and checkpointing adds a forward)
    n = tiles_for(37, CONFIG["hidden_size"], tiles)
    assert n == (tiles or 1)
    assert [c["n"] for c in calls] == [n * (3 if checkpointed else 2)] * CONFIG["num_hidden_layers"]


def test_the_first_layer_mlp_trains_when_its_input_is_frozen():
    """LoRA on the MLP alone, embeddings frozen, no checkpointing: the first MLP's input needs no gradient, and
    TiledMLP's output would leave the graph (its weights are not autograd inputs); the gradients must still come."""
    data = batch()
    want_model, got_model = build(MLP), build(MLP)
    _, want = step(want_model, data)
    tile_mlps(got_model, 2)
    _, got = step(got_model, data)
    first = [k for k in want if ".layers.0.mlp." in k]
    assert first and all(got[k].abs().max() > 0 for k in first)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)


def test_undo_leaves_the_model_bit_identical():
    model = build(ATTENTION).eval()
    ids = batch(1)["input_ids"]
    with torch.no_grad():
        before = model(input_ids=ids).logits
    undo = tile_mlps(model, 5)
    assert tiled(model) and all("forward" in vars(m) for m in decoder_mlps(model))
    with torch.no_grad():
        during = model(input_ids=ids).logits
    undo()
    undo()  # idempotent
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)
    torch.testing.assert_close(during, before, rtol=0, atol=1e-5)
    assert not tiled(model) and all("forward" not in vars(m) for m in decoder_mlps(model))
    tile_mlps(model)  # and it can be tiled again; untile finds the tiles from the model
    untile(model)
    assert not tiled(model)


def test_tiles_rule():
    assert tiles_for(10000, 4096, None) == 3  # DeepSpeed's ceil(tokens / hidden)
    assert tiles_for(100, 4096, None) == 1
    assert tiles_for(5, 64, 8) == 5  # never more tiles than tokens
    assert tiles_for(37, 64, 3) == 3


def test_mixture_of_experts_is_refused():
    from transformers import MixtralConfig, MixtralForCausalLM

    model = MixtralForCausalLM(MixtralConfig(**CONFIG, num_local_experts=2, num_experts_per_tok=1))
    with pytest.raises(UnsupportedModelError, match=r"layer 0's MLP is a mixture of experts \(MixtralSparseMoeBlock\)"):
        tile_mlps(model)
    assert not tiled(model)


def test_a_model_without_per_layer_mlps_is_refused():
    model = build(ATTENTION)
    del model.get_base_model().model.layers[1].mlp
    with pytest.raises(UnsupportedModelError, match=r"decoder layer 1 \(LlamaDecoderLayer\) has no `mlp` module"):
        tile_mlps(model)
    assert not tiled(model)  # nothing was tiled, layer 0 included
    with pytest.raises(UnsupportedModelError, match="has no decoder layer list"):
        tile_mlps(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_dropout_in_the_mlp_is_refused():
    model = build(MLP, lora_dropout=0.1)
    with pytest.raises(UnsupportedModelError, match=r"has dropout \(gate_proj\.lora_dropout\.default.*lora_dropout: 0"):
        tile_mlps(model)
    tile_mlps(build(ATTENTION, lora_dropout=0.1))  # dropout outside the MLP is not the tiles' business


@pytest.mark.parametrize("targets", [MLP, ["q_proj", "down_proj"], None], ids=["mlp", "one-projection", "full"])
def test_trained_mlp_weights_under_several_processes_are_refused(targets):
    model = build(targets)
    with pytest.raises(UnsupportedModelError, match=r"memory.tiled_mlp with 2 processes: MLP weights train \("):
        tile_mlps(model, processes=2)
    assert not tiled(model)
    tile_mlps(model, processes=1)  # one process: exact


def test_frozen_mlps_under_several_processes_are_tiled():
    model = build(ATTENTION)
    tile_mlps(model, processes=4)
    assert tiled(model)


def test_twice_and_bad_tiles_are_refused():
    model = build(ATTENTION)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(RopeExtendError, match="memory.mlp_tiles: got"):
            tile_mlps(model, bad)
    tile_mlps(model)
    with pytest.raises(UnsupportedModelError, match="already has its own forward"):
        tile_mlps(model)


def test_missing_deepspeed_is_one_clear_refusal(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.sequence_parallel.ulysses_sp", None)
    model = build(ATTENTION)
    with pytest.raises(UnsupportedModelError, match=r"needs DeepSpeed's TiledMLP \(deepspeed>=0\.19\.8\).*pip install"):
        tile_mlps(model)
    assert not tiled(model)


# ------------------------------------------------------------------------------------------ the recipe keys
@pytest.mark.parametrize(
    "overrides,message",
    [
        (["memory.tiled_mlp=true", "memory.mlp_tiles=0"], r"memory\.mlp_tiles: got 0; expected an integer >= 1"),
        (["memory.tiled_mlp=true", "memory.mlp_tiles=2.5"], r"memory\.mlp_tiles: got 2\.5 \(float\); expected int"),
        (["memory.mlp_tiles=4"], r"memory\.mlp_tiles: got 4; expected null unless memory\.tiled_mlp is true"),
        (["memory.tiled_mlp=yes please"], r"memory\.tiled_mlp: got 'yes please' \(str\); expected true/false"),
        (["memory.tiles=4"], r"unknown key 'memory\.tiles'; did you mean"),
    ],
)
def test_memory_keys_are_validated(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_args("tiny-cpu", overrides)


def test_memory_keys_default_off_and_parse():
    assert (load_args("tiny-cpu").memory.tiled_mlp, load_args("tiny-cpu").memory.mlp_tiles) == (False, None)
    args = load_args("tiny-cpu", ["memory.tiled_mlp=true", "memory.mlp_tiles=3"])
    assert (args.memory.tiled_mlp, args.memory.mlp_tiles) == (True, 3)


# ------------------------------------------------------------------------------------------ the loop
FAST = [*LOOP_FAST, "max_steps=4", "save_steps=100", "merge_adapter=false"]  # the loop tests' short windows


@pytest.mark.parametrize(
    "extra",
    [[], ["lora.target_modules=[q_proj, v_proj, gate_proj, down_proj]", "memory.mlp_tiles=3"]],
    ids=["attention-lora", "mlp-lora-3-tiles"],
)
def test_tiny_recipe_with_tiled_mlp_matches_the_untiled_loss_curve(tmp_path, extra):
    runs = {}
    for tiled_mlp in (False, True):
        keys = [k for k in extra if not k.startswith("memory.") or tiled_mlp]
        args = load_args(
            "tiny-cpu",
            FAST + keys + [f"memory.tiled_mlp={str(tiled_mlp).lower()}", f"output_dir={tmp_path / str(tiled_mlp)}"],
        )
        result = train(args)
        runs[tiled_mlp] = [row["loss"] for row in result.history]
        assert not tiled(result.model)  # the returned model runs its MLPs plainly
    assert len(runs[True]) == 4 and runs[True][-1] < runs[True][0]
    for a, b in zip(runs[False], runs[True], strict=True):
        assert b == pytest.approx(a, rel=1e-5)


def test_backward_recomputes_every_tile_under_the_forward_autocast():
    """Under bf16 autocast (``bf16: true``) the tiles recomputed in backward must run in bf16 as the forward did (they
    run outside the forward's autocast region), or the gradients are of another computation than the loss."""
    model = build(ATTENTION + MLP)
    tile_mlps(model, 3)
    dtypes = []
    for mlp in decoder_mlps(model):
        mlp.down_proj.register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, n = model_loss(model, batch(), 16)
    (total / n).backward()
    assert len(dtypes) == 2 * 3 * CONFIG["num_hidden_layers"]  # forward and backward, 3 tiles, every layer
    assert set(dtypes) == {torch.bfloat16}


def test_tiles_reach_the_projections_laid_out_as_fresh_tensors():
    """A tile cut from ``[1, T, H]`` keeps ``T * H`` as its first stride, and torch.matmul then copies the whole
    transposed weight per call (2.4x the step time of a Llama-3-8B-shaped layer with 4 tiles): the tiles are packed."""
    model = build(ATTENTION)
    tile_mlps(model, 3)
    strides = []
    for mlp in decoder_mlps(model):
        mlp.gate_proj.register_forward_pre_hook(lambda _m, args: strides.append((args[0].shape, args[0].stride())))
    step(model, batch(rows=1, tokens=36))
    assert len(strides) == 2 * 3 * CONFIG["num_hidden_layers"]
    for shape, stride in strides:
        assert stride == torch.empty(shape).stride(), (shape, stride)
    x = torch.randn(1, 12, 4)
    tile = x[:, 4:8]
    assert tile.stride() == (48, 4, 1) and packed(tile).stride() == (16, 4, 1) and torch.equal(packed(tile), tile)
    assert packed(x) is x
