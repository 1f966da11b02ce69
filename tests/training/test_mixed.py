"""Mixed context window training (LongRoPE2): short micro-batches with the original rope, long ones with the
scaled rope, in the same steps, on one copy of the weights; and the LongRoPE2 recipe end to end."""

import json

import pytest
import torch

import rope_extend
from rope_extend import resources
from rope_extend.hf.head import unwrap
from rope_extend.hf.installed import original_rope
from rope_extend.training import load_args, train
from rope_extend.training.args import RecipeError
from rope_extend.training.loop import setup
from rope_extend.training.loss import model_loss
from rope_extend.training.mixed import MixedBatches, rope_for

TINY = resources.RECIPES / "tiny-cpu.yaml"  # L = 256, head dimension 16: 8 factors
LONGROPE = "rope.params={short_factor: [1, 1, 1, 1, 1, 1, 1, 1], long_factor: [1, 1.5, 2, 2.5, 3, 3.5, 4, 4]"
SERVED = [  # longrope x4 whose rope within L is the original one (short factors 1, attention scale 1)
    "rope.method=longrope",
    LONGROPE + ", attention_factor: 1.0}",
]
MIXED = [*SERVED, "mixed.enabled=true", "data.max_seq_length=512", "per_device_train_batch_size=1",
         "gradient_accumulation_steps=2", "data.max_docs=120", "loss_chunk_size=64"]  # fmt: skip


def test_short_micro_batches_train_with_the_original_rope_and_long_ones_with_the_scaled_one(tmp_path):
    run = setup(load_args(TINY, [*MIXED, f"output_dir={tmp_path / 'run'}"]))
    batches, model = run.batches, run.model
    assert isinstance(batches, MixedBatches) and batches.length == 256
    kinds = [[batches.is_short(step, m) for m in range(2)] for step in range(4)]
    assert kinds == [[False, True]] * 4  # one of each in every step
    short, long = batches.get(0, 1, 0), batches.get(0, 0, 0)
    assert short["input_ids"].shape == (1, 256) and int(short["position_ids"].max()) == 255
    assert long["input_ids"].shape == (1, 512) and int(long["position_ids"].max()) == 511

    def loss(batch, mixed=True):
        with torch.no_grad(), rope_for(batches, batch) if mixed else torch.no_grad():
            return float(model_loss(model, batch, 64, run.head)[0])

    mixed_short, mixed_long = loss(short), loss(long)
    patched_short, patched_long = loss(short, mixed=False), loss(long, mixed=False)
    base = unwrap(model)
    rope_extend.unpatch(base)
    plain_short, plain_long = loss(short, mixed=False), loss(long, mixed=False)
    assert mixed_short == plain_short and mixed_long == patched_long  # exact: the same numbers, bit for bit
    assert plain_long != patched_long  # the scaled rope does matter past L
    assert patched_short == plain_short  # and within L the saved model is served with what it trained with


@pytest.mark.parametrize(("rope", "said"), [
    (["rope.method=yarn", "rope.params={}"], "rope.method yarn x4 computes another rope than the original one"),
    (["rope.method=longrope", LONGROPE + "}"], "rope.method longrope x4 computes another rope"),  # LongRoPE's scale
])  # fmt: skip
def test_a_scaling_served_otherwise_within_L_is_refused_before_anything_is_written(tmp_path, rope, said):
    with pytest.raises(RecipeError, match=said + r".*attention_factor: 1\.0"):
        setup(load_args(TINY, [*MIXED, *rope, f"output_dir={tmp_path / 'run'}"]))
    assert not (tmp_path / "run").exists()


def test_original_rope_refuses_what_it_cannot_switch_exactly():
    from tests.tiny import tiny_model

    model = tiny_model("llama", max_position_embeddings=64)
    with pytest.raises(rope_extend.NotPatchedError, match="no original rope"), original_rope(model):
        pass
    rope_extend.patch(model, "self_extend", group_size=4, window=16)
    try:
        with pytest.raises(rope_extend.RopeExtendError, match="changes the attention"), original_rope(model):
            pass
    finally:
        rope_extend.unpatch(model)


@pytest.mark.parametrize(("override", "message"), [
    (["rope.method=none", "rope.factor=null"], r"rope\.method: got 'none'; expected a frequency method"),
    (["rope.method=self_extend", "rope.factor=null"], r"rope\.method: got 'self_extend'; expected a frequency"),
    (["mixed.short_share=1.0"], r"mixed\.short_share: got 1\.0; expected a share in \(0, 1\)"),
    (["parallel.sequence=2", "model.attn_implementation=eager"], r"parallel\.sequence: got 2; expected 1 with mixed"),
])  # fmt: skip
def test_recipe_refusals(override, message):
    with pytest.raises(RecipeError, match=message):
        load_args(TINY, ["mixed.enabled=true", *override])


def test_windows_all_within_L_are_refused_at_setup(tmp_path):
    with pytest.raises(RecipeError, match=r"every window \(data\.max_seq_length 256\) lies within the original"):
        setup(load_args(TINY, [*MIXED, "data.max_seq_length=256", f"output_dir={tmp_path / 'run'}"]))
    assert not (tmp_path / "run").exists()


def test_the_longrope2_recipe_searches_then_fine_tunes_on_the_bundled_model(tmp_path, monkeypatch):
    from rope_extend import bundled
    from rope_extend.cli import main
    from rope_extend.training import mixed

    texts = bundled.eval_texts()[:4]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    search = tmp_path / "search"
    args = ["search", "--model", "bundled", "--factor", "4", "--evals", "3", "--population", "4", "--out",
            str(search), "--fitness", "needle", "--space", "longrope2", "--no-progress"]  # fmt: skip
    assert main(args) == 0
    found = json.loads((search / "longrope.json").read_text())
    recipe = resources.RECIPES / "smollm2-135m-32k-longrope2.yaml"
    missing = load_args(recipe, ["model.name_or_path=bundled", f"rope.params_from={tmp_path / 'nothing.json'}",
                                 f"data.path={data}", f"output_dir={tmp_path / 'none'}"])  # fmt: skip
    with pytest.raises(RecipeError, match="rope.params_from"):
        setup(missing)  # read when the run starts, refused before anything is written
    assert not (tmp_path / "none").exists()
    overrides = ["model.name_or_path=bundled", f"rope.params_from={search / 'longrope.json'}", f"data.path={data}",
                 "data.max_seq_length=256", "max_steps=2", "save_steps=2", "logging_steps=1",
                 f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    switched = []

    def counting(model):
        switched.append(type(model).__name__)
        return original_rope(model)

    monkeypatch.setattr(mixed, "original_rope", counting)
    result = train(load_args(recipe, overrides))
    # once for the check that the saved model serves the original rope within L, then each step's short micro-batch
    assert switched == ["LlamaForCausalLM"] * 3
    assert [row["step"] for row in result.history] == [1, 2] and all(row["loss"] > 0 for row in result.history)
    saved = json.loads((result.final_dir / "config.json").read_text())["rope_parameters"]
    assert saved["rope_type"] == "longrope" and saved["long_factor"] == found["long_factor"]
    assert saved["factor"] == 4 and saved["original_max_position_embeddings"] == 256
    assert saved["attention_factor"] == 1.0  # the recipe's: within L the served rope is the original one
    # the recipe as written (params_from, not the factors) is what a resume compares
    assert "params_from" in (tmp_path / "run" / "run_config.yaml").read_text()
