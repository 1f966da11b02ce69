"""End-to-end runs of the tiny recipe on CPU (a 2-layer Llama built from the recipe's config)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rope_extend import resources
from rope_extend.training import load_args, train

ROOT = Path(__file__).resolve().parents[2]
RECIPE = resources.RECIPES / "tiny-cpu.yaml"
# Short windows keep each step well under a second on 2 cores.
FAST = [
    "data.max_seq_length=256",
    "per_device_train_batch_size=2",
    "gradient_accumulation_steps=2",
    "loss_chunk_size=64",
    "data.max_docs=120",
    "warmup_steps=2",
]


def run_args(tmp_path, *extra):
    return load_args(RECIPE, FAST + [f"output_dir={tmp_path / 'run'}", *extra])


def test_tiny_recipe_trains_loss_falls_and_writes_everything(tmp_path):
    result = train(run_args(tmp_path, "max_steps=16", "save_steps=8", "save_total_limit=1"))
    losses = [r["loss"] for r in result.history]
    assert len(losses) == 16
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses  # from ~ln(512)=6.2 down clearly
    out = tmp_path / "run"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-16"]  # limit 1 kept the newest
    csv = (out / "loss.csv").read_text().splitlines()
    assert csv[0].startswith("step,loss,learning_rate") and len(csv) == 17
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # the run's marker and its writer's lock (rope_extend.locking); no temporaries left
    assert sorted(p.name for p in out.glob(".*")) == [".rope-extend", ".rope-extend.lock"]
    for folder in ("adapter", "merged"):
        assert not list((out / folder).glob("*.bin")) and list((out / folder).glob("*.safetensors"))
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert set(adapter["modules_to_save"]) >= {"embed_tokens", "norm"}
    keys = load_file(out / "adapter" / "adapter_model.safetensors").keys()
    assert any("embed_tokens" in k for k in keys) and any("input_layernorm" in k for k in keys)
    config = json.loads((out / "merged" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["factor"] == 4
    assert config["max_position_embeddings"] == 1024


def test_merged_model_reloads_with_plain_transformers_and_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    result = train(run_args(tmp_path, "max_steps=3"))
    reloaded = AutoModelForCausalLM.from_pretrained(result.final_dir).eval()
    ids = torch.randint(3, 512, (1, 700))  # past the original 256 positions: the scaling matters
    with torch.no_grad():
        want = result.model.eval()(ids).logits
        got = reloaded(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and the check can tell: the same weights with plain RoPE disagree far more
    plain = AutoModelForCausalLM.from_pretrained(
        result.final_dir, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
    )
    with torch.no_grad():
        assert (plain(ids).logits - want).abs().max() > 100 * (got - want).abs().max() + 1e-4


def test_resume_after_kill_ends_with_the_same_weights(tmp_path):
    uninterrupted = train(run_args(tmp_path / "a", "max_steps=6", "save_steps=3", "merge_adapter=false"))

    class Killed(Exception):
        pass

    def kill_at_5(step):
        if step == 5:  # step 4 and 5 are lost: the last checkpoint is at step 3
            raise Killed

    args = run_args(tmp_path / "b", "max_steps=6", "save_steps=3", "merge_adapter=false")
    with pytest.raises(Killed):
        train(args, on_step=kill_at_5)
    assert sorted(p.name for p in (tmp_path / "b" / "run").glob("checkpoint-*")) == ["checkpoint-3"]
    with pytest.raises(Exception, match="earlier train run"):  # no silent restart over the killed run
        train(args)
    # a crafted pickle in the checkpoint (accelerate's scheduler file name) is never loaded
    import pickle

    class Exploit:
        def __reduce__(self):
            return (open, (str(tmp_path / "pwned"), "w"))

    (tmp_path / "b" / "run" / "checkpoint-3" / "custom_checkpoint_0.pkl").write_bytes(pickle.dumps(Exploit()))
    (tmp_path / "b" / "run" / ".checkpoint-9.abc.tmp").mkdir()  # a write killed half-way: cleaned up
    with pytest.raises(Exception, match=r"changed recipe: max_steps \(6 -> 7\)"):
        train(
            run_args(
                tmp_path / "b", "max_steps=7", "save_steps=3", "merge_adapter=false", "resume_from_checkpoint=true"
            )
        )
    resumed = train(
        run_args(tmp_path / "b", "max_steps=6", "save_steps=3", "merge_adapter=false", "resume_from_checkpoint=true")
    )
    assert not (tmp_path / "pwned").exists()
    assert not list((tmp_path / "b" / "run").glob(".checkpoint-*"))
    assert not list((tmp_path / "b" / "run").rglob("*.pkl")) or list((tmp_path / "b" / "run").rglob("*.pkl")) == [
        tmp_path / "b" / "run" / "checkpoint-3" / "custom_checkpoint_0.pkl"
    ]
    assert [r["step"] for r in resumed.history] == list(range(1, 7))
    a = {n: p for n, p in uninterrupted.model.named_parameters() if p.requires_grad}
    b = {n: p for n, p in resumed.model.named_parameters() if p.requires_grad}
    assert a.keys() == b.keys() and len(a) > 4
    for name, value in a.items():
        torch.testing.assert_close(b[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for ra, rb in zip(uninterrupted.history, resumed.history, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
    # the comparison can fail: the step-3 checkpoint (trainable tensors only) is far from the end
    at3 = load_file(tmp_path / "b" / "run" / "checkpoint-3" / "model.safetensors")
    assert set(at3) == set(a)
    assert max((at3[n] - a[n].detach()).abs().max().item() for n in a) > 1e-3


def test_full_fine_tuning_and_pose(tmp_path):
    result = train(
        run_args(
            tmp_path, "max_steps=3", "lora=null", "pose.enabled=true", "learning_rate=1e-3", "data.max_seq_length=128"
        )
    )
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()
    assert all(p.requires_grad for p in result.model.parameters())
    assert result.history[-1]["loss"] < result.history[0]["loss"]


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    """Two CPU processes (1 x 1 accumulation each) vs 1 process x 2 accumulation.

    In accelerate 1.15 ``accelerate launch --cpu --num_processes 2`` starts ONE process (simple_launcher);
    two CPU processes need the torchrun path: ``--multi_gpu`` with ``ACCELERATE_USE_CPU=1`` (gloo).
    """
    common = FAST + ["max_steps=4", "save_steps=100", "merge_adapter=false", "lora.lora_dropout=0.0"]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    runs = {}
    for name, launcher, accumulation in [
        ("one", [sys.executable, "-m", "rope_extend"], 2),
        (
            "two",
            [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--multi_gpu",
                "--num_processes",
                "2",
                "--num_machines",
                "1",
                "--mixed_precision",
                "no",
                "--dynamo_backend",
                "no",
                "-m",
                "rope_extend",
            ],
            1,
        ),
    ]:
        cmd = launcher + [
            "train",
            str(RECIPE),
            *common,
            f"gradient_accumulation_steps={accumulation}",
            f"output_dir={tmp_path / name}",
        ]
        proc = subprocess.run(
            cmd,
            check=False,
            cwd=tmp_path,
            env={**env, "ACCELERATE_USE_CPU": "1"},
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"{2 if name == 'two' else 1} process(es)" in proc.stdout
        runs[name] = [float(line.split(",")[1]) for line in (tmp_path / name / "loss.csv").read_text().splitlines()[1:]]
    assert len(runs["one"]) == len(runs["two"]) == 4
    for a, b in zip(runs["one"], runs["two"], strict=True):
        assert a == pytest.approx(b, rel=2e-4)
    assert runs["one"][-1] < runs["one"][0]  # it trained


def test_logged_loss_is_the_mean_over_the_interval_and_survives_a_resume_inside_it(tmp_path):
    """logging_steps=2: each logged loss is the token-weighted mean of its two steps' losses (every step has
    the same number of target tokens here, so the plain mean); a checkpoint at step 3, inside an interval,
    resumes to the same history."""
    common = ["max_steps=6", "save_steps=3", "merge_adapter=false"]
    each = train(run_args(tmp_path / "each", *common, "logging_steps=1")).history
    pairs = train(run_args(tmp_path / "pairs", *common, "logging_steps=2")).history
    assert [r["step"] for r in pairs] == [2, 4, 6]
    for row in pairs:
        mean = (each[row["step"] - 2]["loss"] + each[row["step"] - 1]["loss"]) / 2
        assert row["loss"] == pytest.approx(mean, rel=1e-5)

    class Killed(Exception):
        pass

    def kill_at_4(step):
        if step == 4:
            raise Killed

    with pytest.raises(Killed):
        train(run_args(tmp_path / "cut", *common, "logging_steps=2"), on_step=kill_at_4)
    resumed = train(run_args(tmp_path / "cut", *common, "logging_steps=2", "resume_from_checkpoint=true")).history
    assert [r["step"] for r in resumed] == [2, 4, 6]
    for a, b in zip(pairs, resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


def test_a_lora_run_raises_no_future_warning(tmp_path):
    """PEFT reads transformers' deprecated ``is_gradient_checkpointing``; a user's run shows no FutureWarning."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        train(run_args(tmp_path, "max_steps=1", "gradient_checkpointing=true", "merge_adapter=false"))


def test_tied_embeddings_trained_with_lora_stay_tied_after_merge_and_reload(tmp_path, monkeypatch):
    """SmolLM2, Gemma and small Qwens tie the output head to the input embedding. Training the embedding
    (modules_to_save) trains the head with it (PEFT's ensure_weight_tying; by default PEFT unties them and the
    merged model is saved with a separate head): the merged model stays tied, and reloads with the logits it
    was trained with."""
    from peft.tuners.tuners_utils import BaseTuner
    from transformers import AutoModelForCausalLM

    ids = torch.randint(3, 512, (1, 300))
    trained = {}
    merge = BaseTuner.merge_and_unload

    def spy(self, *args, **kwargs):  # the model as trained, just before the merge
        with torch.no_grad():
            trained["logits"] = self.model.eval()(ids).logits
        return merge(self, *args, **kwargs)

    monkeypatch.setattr(BaseTuner, "merge_and_unload", spy)
    result = train(
        run_args(
            tmp_path,
            "max_steps=3",
            "model.config.tie_word_embeddings=true",
            "lora.modules_to_save=[embed_tokens, norm]",
            "learning_rate=0.05",
        )
    )
    config = json.loads((result.final_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(result.final_dir / "model.safetensors")
    reloaded = AutoModelForCausalLM.from_pretrained(result.final_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, trained["logits"], rtol=1e-5, atol=1e-5)


def test_tied_embedding_run_resumes_with_its_own_recipe(tmp_path):
    """PEFT appends the tied head's name to the modules_to_save list it is given; the runner hands it a copy, so
    run_config.yaml keeps the recipe as written and a resume with the same recipe is not refused as changed."""

    class Killed(Exception):
        pass

    def kill_at_3(step):
        if step == 3:
            raise Killed

    tied = ["max_steps=4", "save_steps=2", "merge_adapter=false", "model.config.tie_word_embeddings=true"]
    tied.append("lora.modules_to_save=[embed_tokens, norm]")
    with pytest.raises(Killed):
        train(run_args(tmp_path, *tied), on_step=kill_at_3)
    saved = yaml.safe_load((tmp_path / "run" / "run_config.yaml").read_text())
    assert saved["lora"]["modules_to_save"] == ["embed_tokens", "norm"]
    resumed = train(run_args(tmp_path, *tied, "resume_from_checkpoint=true"))
    assert [r["step"] for r in resumed.history] == [1, 2, 3, 4]


def test_an_error_mid_run_removes_what_sequence_parallelism_installed(tmp_path, monkeypatch):
    """Ulysses changes transformers' attention registry for the whole process: a step that raises (out of
    memory, a NaN guard, Ctrl-C) must not leave it installed for the next model the process builds. Installed
    last in setup, removed by ``train``'s clean-up as well as by ``finish``."""
    from rope_extend.training import loop, parallel

    events = []
    monkeypatch.setattr(parallel, "install", lambda model, args, where: events.append("install") or "installed")
    monkeypatch.setattr(parallel, "remove", lambda installed: events.append(("remove", installed)))

    def failing_step(run):
        assert run.ulysses == "installed"
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "_step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        train(run_args(tmp_path, "max_steps=2"))
    assert events == ["install", ("remove", "installed")]
