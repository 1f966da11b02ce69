"""The loop under DeepSpeed's engine (``accelerate/deepspeed-zero3.yaml``): the same run as a plain one, or refused.

The equality runs (marker ``parallel``: several processes, their own CI step) launch the shipped launcher config with
2 CPU processes (DeepSpeed's CPU accelerator, gloo) and compare the loss curve, the LoRA adapter and the merged model
with a plain 1-process run of the same global batch (4 micro-batches of 2 windows: 1 process x 4 accumulation
against 2 processes x 2), from the same saved weights (ZeRO-3 builds a model from a config under
``deepspeed.zero.Init``, which draws other random weights, so the model is saved first). The refusals run in the main
suite against ``engine.configure`` with the launcher's DeepSpeed settings.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml

from rope_extend import resources
from rope_extend.training import engine
from rope_extend.training.args import RecipeError, load_args
from tests.training.test_loop import FAST
from tests.training.test_sequence_parallel import ENV

LAUNCHER = resources.RECIPES / "accelerate" / "deepspeed-zero3.yaml"
# DeepSpeed's TiledMLP with LoRA on the MLP: 3 tiles of each 256-token window
TILED = [
    "memory.tiled_mlp=true",
    "memory.mlp_tiles=3",
    "lora.target_modules=[q_proj,v_proj,gate_proj,up_proj,down_proj]",
]


# ------------------------------------------------------------------------------------------ refusals
GATHER = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}  # the shipped launchers' ZeRO-3


def fake_accelerator(**ds):
    """What ``engine.configure`` reads of an Accelerator under DeepSpeed: the plugin's config as the launcher gave it."""
    from accelerate.utils import DistributedType

    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1, **ds}
    state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config))
    return SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, state=state, gradient_accumulation_steps=1)


def test_the_engine_takes_the_recipes_batch_accumulation_and_clipping():
    args = load_args("tiny-cpu", ["max_grad_norm=0.5"])  # 2 sequences per micro-batch, 2 micro-batches
    acc = fake_accelerator(gradient_clipping="auto", train_batch_size="auto")
    engine.configure(acc, args)
    config = acc.state.deepspeed_plugin.deepspeed_config
    assert config["train_micro_batch_size_per_gpu"] == 2  # "auto" would make accelerate.prepare fail
    assert config["gradient_accumulation_steps"] == 2  # the launcher's 1 (accelerate's default) is the recipe's
    assert config["gradient_clipping"] == 0.5
    assert "train_batch_size" not in config and acc.gradient_accumulation_steps == 2
    same = fake_accelerator(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, gradient_clipping=1.0)
    engine.configure(same, load_args("tiny-cpu"))  # the same numbers in both: accepted


@pytest.mark.parametrize(
    "launcher,override,message",
    [
        (
            {"train_micro_batch_size_per_gpu": 4},
            [],
            (
                r"per_device_train_batch_size: got 2 in the recipe and train_micro_batch_size_per_gpu 4 in the DeepSpeed "
                r"launcher config; expected the same value in both, or train_micro_batch_size_per_gpu: auto"
            ),
        ),
        (
            {"gradient_accumulation_steps": 3},
            [],
            (
                r"gradient_accumulation_steps: got 2 in the recipe and gradient_accumulation_steps 3 .* or "
                r"gradient_accumulation_steps: 1 in the launcher"
            ),
        ),
        (
            {"gradient_clipping": 1.0},
            ["max_grad_norm=0"],
            r"max_grad_norm: got 0.0 in the recipe and gradient_clipping",
        ),
    ],
)
def test_a_launcher_setting_the_recipe_contradicts_is_refused(launcher, override, message):
    with pytest.raises(RecipeError, match=message):
        engine.configure(fake_accelerator(**launcher), load_args("tiny-cpu", override))


def test_zero3_that_cannot_save_the_trained_weights_is_refused_before_training():
    with pytest.raises(RecipeError, match=r"ZeRO-3 without zero3_save_16bit_model: true"):
        engine.configure(fake_accelerator(zero_optimization={"stage": 3}), load_args("tiny-cpu"))
    engine.configure(fake_accelerator(zero_optimization=GATHER), load_args("tiny-cpu"))


def test_the_shipped_launcher_leaves_batch_accumulation_and_clipping_to_the_recipe():
    config = yaml.safe_load(LAUNCHER.read_text())["deepspeed_config"]
    assert config["gradient_accumulation_steps"] == 1 and config["gradient_clipping"] == "auto"
    assert config["zero_stage"] == 3 and config["zero3_save_16bit_model"] is True  # get_state_dict needs it


# ------------------------------------------------------------------------------------------ 2 processes
@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """tiny-cpu's random model and tokenizer, saved (both runs load the same weights)."""
    from rope_extend.training.data import read_documents
    from rope_extend.training.model import build_model

    args = load_args("tiny-cpu", FAST)
    model, tokenizer = build_model(args.model, read_documents(args.data), args.seed)
    path = tmp_path_factory.mktemp("model") / "tiny"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _run(tmp_path, name, launcher, accumulation, model, extra=()):
    common = [*FAST, "max_steps=3", "save_steps=100", "lora.lora_dropout=0.0", "model.config=null"]
    cmd = [*launcher, "-m", "rope_extend", "train", "tiny-cpu", *common, f"model.name_or_path={model}"]
    cmd += [f"gradient_accumulation_steps={accumulation}", *extra, f"output_dir={tmp_path / name}"]
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.parallel
@pytest.mark.slow
@pytest.mark.parametrize("stage,extra", [(3, TILED), (2, [])], ids=["zero3-tiled-mlp", "zero2"])
def test_two_processes_under_zero_equal_one_plain_process(tmp_path, saved_model, stage, extra):
    """The shipped launcher (ZeRO-3; and ZeRO-2) with 2 CPU processes x 2 accumulation against 1 plain process x 4:
    the same global batch, so the same losses, adapter and merged model within float32 rounding. Before the engine
    took the recipe's micro-batch, this run stopped at ``accelerate.prepare``; with the engine stepping at every
    micro-batch (accelerate's default without ``accumulate``), the adapter would take 2 steps per step. ZeRO-3 runs
    with tiled MLPs whose LoRA trains (refused under DDP, whose reducer cannot take tile-by-tile gradients)."""
    config = yaml.safe_load(LAUNCHER.read_text())
    config.update(num_processes=2, mixed_precision="no")  # float32, to compare within rounding
    config["deepspeed_config"]["zero_stage"] = stage
    launcher_file = tmp_path / "launcher.yaml"
    launcher_file.write_text(yaml.safe_dump(config))
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launcher_file)]
    plain = _run(tmp_path, "plain", [sys.executable], 4, saved_model, extra)
    zero = _run(tmp_path, "zero", launch, 2, saved_model, extra)
    assert "1 process(es)" in plain and "2 process(es)" in zero  # accelerate counted both processes (gloo)
    _assert_same_run(tmp_path, "plain", "zero", ["adapter/adapter_model.safetensors", "merged/model.safetensors"])


def _assert_same_run(tmp_path, one: str, other: str, parts: list[str]) -> None:
    """Losses within 1e-6 (float32 sums of a few thousand tokens), the same learning rates, gradient norms within
    1e-5, and every saved tensor within 1e-5 (measured 1.2e-7: the adapter's values are about 1)."""
    curves = {}
    for name in (one, other):
        rows = (tmp_path / name / "loss.csv").read_text().splitlines()[1:]
        curves[name] = [[float(x) for x in row.split(",")[1:4]] for row in rows]  # loss, learning rate, grad norm
    print("curves", json.dumps(curves))
    assert len(curves[one]) == len(curves[other]) >= 3
    for a, b in zip(curves[one], curves[other], strict=True):
        assert a[0] == pytest.approx(b[0], abs=1e-6) and a[1] == b[1] and a[2] == pytest.approx(b[2], abs=1e-5)
    assert curves[one][-1][0] < curves[one][0][0]  # it trained
    for part in parts:
        a, b = _tensors(tmp_path / one / part), _tensors(tmp_path / other / part)
        assert set(a) == set(b) and len(a) > 10
        diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        print(part, "max abs difference", diff)
        assert diff <= 1e-5, (part, diff)


# ------------------------------------------------------------------------------------------ accelerate's sequence parallelism
def sp_accelerator(stage: int, processes: int = 4, sp: int = 2):
    """An Accelerator under DeepSpeed with accelerate's sequence parallelism, as the engine's functions read it."""
    acc = fake_accelerator(zero_optimization={"stage": stage})
    acc.num_processes = processes
    acc.parallelism_config = SimpleNamespace(sp_size=sp, sp_backend="deepspeed")
    return acc


def test_parallel_sequence_under_the_deepspeed_launcher_becomes_accelerates_sp_size(monkeypatch):
    args = load_args("tiny-cpu", ["parallel.sequence=2"])
    assert engine.sequence_parallel_config(args) is None  # not a DeepSpeed launch: rope-extend's own Ulysses
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    pc = engine.sequence_parallel_config(args)
    assert (pc.sp_size, pc.sp_backend, pc.sp_handler.sp_attn_implementation) == (2, "deepspeed", "sdpa")
    assert pc.sp_handler.sp_seq_length_is_variable is True
    assert engine.sequence_parallel_config(load_args("tiny-cpu")) is None
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "4")
    with pytest.raises(RecipeError, match=r"parallel.sequence: got 2 in the recipe and parallelism_config_sp_size 4"):
        engine.sequence_parallel_config(args)
    with pytest.raises(RecipeError, match=r"parallel.sequence: got 1 in the recipe and parallelism_config_sp_size 4"):
        engine.sequence_parallel_config(load_args("tiny-cpu"))  # the loop would not slice: every rank the whole window


def test_the_gradient_average_follows_what_the_engine_divides_by():
    """DeepSpeed 0.19.8 under sequence parallelism: ZeRO 0-2 average over the data-parallel groups, ZeRO-3's
    reduce-scatter over every process (measured: the 2-process runs below fail with the other scale)."""
    assert engine.averaged(sp_accelerator(stage=2), 2) == 2
    assert engine.averaged(sp_accelerator(stage=3), 2) == 4
    plain = fake_accelerator(zero_optimization=GATHER)
    plain.num_processes, plain.parallelism_config = 4, None
    assert engine.averaged(plain, 1) == 4
    mixed = fake_accelerator(zero_optimization={**GATHER, "reduce_scatter": False})
    with pytest.raises(RecipeError, match=r"ZeRO-3 and reduce_scatter false .* expected reduce_scatter true"):
        engine.configure(mixed, load_args("tiny-cpu", ["parallel.sequence=2"]))


def _patched(method: str, **kwargs):
    from transformers import LlamaConfig

    import rope_extend
    from tests.training.test_sequence_parallel import tiny

    model = tiny(LlamaConfig, num_key_value_heads=2, max_position_embeddings=32)
    rope_extend.patch(model, method, **kwargs)
    return model


@pytest.mark.parametrize(
    "method,kwargs,message",
    [
        ("self_extend", {"group_size": 4, "window": 8}, r"rope method 'self_extend' runs rope-extend's attention"),
        ("yarn", {"factor": 4, "logn": True}, r"rope method 'yarn' with log-n runs rope-extend's attention"),
    ],
)
def test_what_accelerates_sequence_parallelism_cannot_wrap_is_refused(method, kwargs, message):
    params = {k: v for k, v in kwargs.items() if k != "factor"}
    factor = kwargs.get("factor", "null")
    override = [f"rope.method={method}", f"rope.factor={factor}", f"rope.params={json.dumps(params)}"]
    args = load_args("tiny-cpu", ["parallel.sequence=2", *override])
    model = _patched(method, **kwargs)
    with pytest.raises(RecipeError, match=message + r".*accelerate/sequence-parallel.yaml"):
        engine.check_model(sp_accelerator(stage=3), model, args)
    engine.check_model(fake_accelerator(), model, args)  # the engine without sequence parallelism: no refusal
    engine.check_model(sp_accelerator(stage=3), _patched("yarn", factor=4), load_args("tiny-cpu"))


def test_what_deepspeeds_own_registration_changes_is_put_back():
    from transformers import LlamaConfig
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from rope_extend.hf import ulysses
    from tests.training.test_sequence_parallel import tiny

    model = tiny(LlamaConfig, num_key_value_heads=1)
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    installed = ulysses.expect(model, ulysses.head_split(model, 2, 1))
    ALL_ATTENTION_FUNCTIONS["sdpa"] = len  # what register_with_transformers does, for the whole process
    attention = model.model.layers[0].self_attn
    attention.num_key_value_groups = 2  # DeepSpeed replicating the one key-value head
    ulysses.remove(installed)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before and attention.num_key_value_groups == 4


@pytest.mark.parallel
@pytest.mark.slow
@pytest.mark.parametrize("stage,method,tiled", [(3, "dynamic", True), (2, "yarn", False)])
def test_accelerates_sequence_parallelism_equals_one_plain_process(tmp_path, saved_model, stage, method, tiled):
    """The shipped accelerate/deepspeed-sequence-parallel.yaml (and ZeRO-2) with 2 CPU processes sharing each
    sequence (parallel.sequence 2, 255 tokens: one pad) against 1 plain process: the same losses and adapter. The
    dynamic method picks its factor from the whole sequence on both ranks (ZeRO-3 with tiled MLPs, as ALST runs);
    with the data-parallel gradient scale
    under ZeRO-3 the gradients were half the plain run's (measured grad norm 0.58 against 1.17)."""
    config = yaml.safe_load((LAUNCHER.parent / "deepspeed-sequence-parallel.yaml").read_text())
    config.update(num_processes=2, mixed_precision="no")
    config["deepspeed_config"]["zero_stage"] = stage
    launcher_file = tmp_path / "launcher.yaml"
    launcher_file.write_text(yaml.safe_dump(config))
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launcher_file)]
    extra = ["data.max_seq_length=255", f"rope.method={method}", "merge_adapter=false"]
    extra += ["memory.tiled_mlp=true", "memory.mlp_tiles=3"] if tiled else []  # the MLP frozen (LoRA on attention)
    plain = _run(tmp_path, "plain", [sys.executable], 2, saved_model, extra)
    sp = _run(tmp_path, "sp", launch, 2, saved_model, [*extra, "parallel.sequence=2"])
    assert "1 process(es)" in plain and "1 process(es) x 2 per sequence" in sp
    _assert_same_run(tmp_path, "plain", "sp", ["adapter/adapter_model.safetensors"])


@pytest.mark.parallel
@pytest.mark.slow
def test_a_run_resumed_under_zero3_equals_the_uninterrupted_one(tmp_path, saved_model):
    """2 processes under the shipped ZeRO-3 launcher: 4 steps in one go against 2 steps, then a resume from the
    checkpoint (accelerate's save_state, so trust_pickled_checkpoint). Before, the resume stopped with a TypeError
    (DeepSpeed's load_checkpoint takes no ``strict``), and the loop's schedule, which accelerate does not hold,
    restarted from its first step (the learning rate logged at step 3: 0.0 instead of 0.003)."""
    config = yaml.safe_load(LAUNCHER.read_text())
    config.update(num_processes=2, mixed_precision="no")
    launcher_file = tmp_path / "launcher.yaml"
    launcher_file.write_text(yaml.safe_dump(config))
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launcher_file)]
    extra = ["max_steps=4", "merge_adapter=false", "lr_scheduler_type=cosine"]
    _run(tmp_path, "whole", launch, 2, saved_model, extra)
    _run(tmp_path, "resumed", launch, 2, saved_model, [*extra, "save_steps=2"])
    out = tmp_path / "resumed"
    for leftover in ("checkpoint-4", "adapter", "loss.csv"):  # as if the run had stopped after its step-2 checkpoint
        path = out / leftover
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    resumed = _run(
        tmp_path,
        "resumed",
        launch,
        2,
        saved_model,
        [*extra, "save_steps=2", "resume_from_checkpoint=true", "trust_pickled_checkpoint=true"],
    )
    assert "resumed from" in resumed and "at step 2" in resumed
    _assert_same_run(tmp_path, "whole", "resumed", ["adapter/adapter_model.safetensors"])


def test_sequence_parallelism_without_the_checked_deepspeed_is_refused(monkeypatch):
    import deepspeed

    args = load_args("tiny-cpu", ["parallel.sequence=2"])
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setattr(deepspeed, "__version__", "0.18.2")  # accelerate's own minimum
    with pytest.raises(RecipeError, match=r"DeepSpeed 0.18.2 is installed, sequence parallelism needs >= 0.19.8"):
        engine.sequence_parallel_config(args)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # not installed
    with pytest.raises(RecipeError, match=r"needs DeepSpeed >= 0.19.8 \(pip install 'rope-extend\[parallel\]'\)"):
        engine.sequence_parallel_config(args)
