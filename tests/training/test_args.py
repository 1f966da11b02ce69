import pytest

from rope_extend import resources
from rope_extend.training.args import RecipeError, TrainArgs, load_args, parse_overrides
from rope_extend.training.checkpoint import resolve_output_dir

RECIPES = sorted(resources.RECIPES.glob("*.yaml"))
LAUNCHERS = sorted((resources.RECIPES / "accelerate").glob("*.yaml"))


def test_there_are_recipes_and_launchers():
    names = {p.stem for p in RECIPES}
    assert {"tiny-cpu", "llama2-7b-yarn-s16", "llama3-8b-yarn-64k-lora", "llama2-7b-pose-linear-16k"} <= names
    assert {p.stem for p in LAUNCHERS} == {
        "ddp",
        "fsdp2",
        "deepspeed-zero3",
        "context-parallel",
        "sequence-parallel",
        "deepspeed-sequence-parallel",
    }


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_loads_validates_and_names_its_command(path):
    args = load_args(path)
    assert isinstance(args, TrainArgs)
    header = path.read_text().splitlines()[:12]
    assert any("rope_extend train" in line or "rope-extend train" in line for line in header)
    assert any("Hardware" in line for line in header)
    if args.model.config is None and not path.stem.startswith("bundled-"):  # the bundled model's are small
        assert args.model.name_or_path and args.data.max_seq_length >= 2048
    if args.pose.enabled:
        assert args.rope.target_length or args.rope.factor


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.stem)
def test_every_accelerate_launcher_config_loads(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert config.num_processes >= 2
    if path.stem == "context-parallel":
        assert config.parallelism_config["parallelism_config_cp_size"] > 1
        assert config.fsdp_config["fsdp_version"] == 2
    if path.stem == "sequence-parallel":  # plain DDP: rope-extend installs Ulysses itself (parallel.sequence)
        assert config.distributed_type == "MULTI_GPU" and "parallel.sequence" in path.read_text()
    if path.stem == "deepspeed-sequence-parallel":  # accelerate installs Ulysses; sp_size is the recipe's
        assert config.distributed_type == "DEEPSPEED" and not config.parallelism_config
        assert "parallel.sequence" in path.read_text()


def test_overrides_win_and_dotted_keys_reach_sections():
    args = load_args("tiny-cpu", ["max_steps=7", "rope.factor=2", "lora.r=4", "lora=null"])
    assert (args.max_steps, args.rope.factor, args.lora) == (7, 2.0, None)
    args = load_args("tiny-cpu", ["lora.r=4", "learning_rate=1e-4"])
    assert args.lora.r == 4 and args.lora.lora_alpha == 16 and args.learning_rate == 1e-4
    assert parse_overrides(["a.b.c=[1, 2]"]) == {"a": {"b": {"c": [1, 2]}}}


@pytest.mark.parametrize(
    "override,message",
    [
        ("learnig_rate=1", r"unknown key 'learnig_rate'; did you mean 'learning_rate'"),
        ("rope.factr=2", r"unknown key 'rope\.factr'; did you mean 'rope\.factor'"),
        ("lora.lora_alfa=8", r"lora\.lora_alpha"),
        ("max_steps=ten", r"max_steps: got 'ten' \(str\); expected int"),
        ("rope.factor=0.5", r"rope\.factor must be >= 1\.0, got 0\.5"),
        ("rope.target_length=4096", r"exactly one of rope\.factor \(.*\) and rope\.target_length"),
        ("lr_scheduler_type=cosin", r"lr_scheduler_type: got 'cosin'"),
        ("data.document_boundaries=none", r"data\.document_boundaries"),
        ("max_steps", r"expected key=value"),
    ],
)
def test_bad_keys_and_values_name_the_key(override, message):
    with pytest.raises(RecipeError, match=message):
        load_args("tiny-cpu", [override])


def test_every_bad_override_is_reported_at_once():
    """Issue 55, item 7: a recipe's overrides report every bad key and value, not only the first, on one line."""
    with pytest.raises(RecipeError) as info:
        load_args("tiny-cpu", ["learnig_rate=1", "max_steps=ten", "rope.factr=2", "lora.lora_alfa=8"])
    message = str(info.value)
    assert "\n" not in message and "4 problems: (1) " in message
    for part in ("unknown key 'learnig_rate'", "max_steps: got 'ten'", "unknown key 'rope.factr'", "'lora.lora_alfa'"):
        assert part in message, part


@pytest.mark.parametrize("override", ["pose.enabled=true", "data.document_boundaries=mask"])
def test_attention_methods_refuse_position_jumps_before_anything_loads(override):
    """Self-Extend and the other attention methods place tokens by consecutive positions: PoSE's jumps and
    positions restarting per document are refused at validation (their attention refuses them too)."""
    with pytest.raises(RecipeError, match="attention methods need consecutive positions"):
        load_args("tiny-cpu", ["rope.method=self_extend", "rope.factor=null", override])
    assert load_args("tiny-cpu", ["rope.method=self_extend", "rope.factor=null"]).rope.method == "self_extend"
    assert load_args("tiny-cpu", [override]).rope.method == "yarn"  # a frequency method takes both


def test_recipe_that_does_not_parse(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_args(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="expected a mapping"):
        load_args(bad)


def test_output_dir_with_another_run_is_refused_unless_overwrite_or_resume(tmp_path):
    import json

    from rope_extend.training.checkpoint import FORMAT

    base = {
        "model": {"config": {"model_type": "llama"}},
        "rope": {"factor": 2},
        "data": {"path": "x.txt"},
        "output_dir": str(tmp_path / "run"),
    }
    assert resolve_output_dir(load_args(base)) is None  # does not exist yet
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    for flags in ([], ["overwrite_output_dir=true"], ["resume_from_checkpoint=true"]):
        with pytest.raises(RecipeError, match="holds files rope-extend did not write \\(notes.txt\\)"):
            resolve_output_dir(load_args(base, flags))  # not rope-extend's folder: refused whatever the flags
    (tmp_path / "run" / "notes.txt").unlink()
    (tmp_path / "run" / ".rope-extend").write_text(json.dumps({"kind": "train"}))
    for step in (5, 12):
        (tmp_path / "run" / f"checkpoint-{step}").mkdir()
        (tmp_path / "run" / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"format": FORMAT}))
    with pytest.raises(RecipeError, match="earlier train run.*resume_from_checkpoint=true.*overwrite_output_dir=true"):
        resolve_output_dir(load_args(base))
    assert resolve_output_dir(load_args(base, ["overwrite_output_dir=true"])) is None
    (tmp_path / "run" / ".checkpoint-20.tmp").mkdir()  # an unfinished write is never picked
    assert resolve_output_dir(load_args(base, ["resume_from_checkpoint=true"])).name == "checkpoint-12"
    with pytest.raises(RecipeError, match="not both"):
        load_args(base, ["resume_from_checkpoint=true", "overwrite_output_dir=true"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RecipeError, match="no checkpoint-\\* folder"):
        resolve_output_dir(load_args({**base, "output_dir": str(empty)}, ["resume_from_checkpoint=true"]))


def test_rope_method_none_takes_no_factor():
    from rope_extend.training.args import RecipeError, TrainArgs

    args = TrainArgs()
    args.rope.method, args.rope.factor, args.data.path = "none", None, "x.txt"
    args.model.name_or_path = "some/model"
    args.validate()
    args.rope.factor = 2.0
    with pytest.raises(RecipeError, match=r"rope\.factor given without a scaling method \(rope\.method is none\)"):
        args.validate()


def test_pickled_checkpoints_need_trust(tmp_path):
    import json

    base = {
        "model": {"config": {"model_type": "llama"}},
        "rope": {"factor": 2},
        "data": {"path": "x.txt"},
        "output_dir": str(tmp_path / "run"),
        "resume_from_checkpoint": True,
    }
    (tmp_path / "run" / "checkpoint-4").mkdir(parents=True)
    (tmp_path / "run" / ".rope-extend").write_text(json.dumps({"kind": "train"}))
    (tmp_path / "run" / "checkpoint-4" / "trainer_state.json").write_text(json.dumps({"step": 4}))  # no format
    with pytest.raises(RecipeError, match="pickle.*trust_pickled_checkpoint=true"):
        resolve_output_dir(load_args(base))
    assert resolve_output_dir(load_args(base, ["trust_pickled_checkpoint=true"])).name == "checkpoint-4"
