"""Ulysses sequence parallelism (``parallel.sequence``): exact for every method against 1 process, or refused.

The equality runs (marker ``parallel``: their own CI step, deselected from the plain ``pytest -q``) launch 2 gloo
processes: ``sequence_parallel_worker`` (one step of every registry method x batch kind, loss and every LoRA
gradient within 1e-5 of 1 process in float32) and the tiny recipe end to end (its loss curve equal to 1 process's).
The refusals and the padding run in the main suite: they need neither DeepSpeed nor a second process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rope_extend
from rope_extend.hf import ulysses
from rope_extend.methods import registry
from rope_extend.training import parallel
from rope_extend.training.args import RecipeError, load_args
from tests.training.test_loop import FAST

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
}
TOLERANCE = 1e-5


# ------------------------------------------------------------------------------------------ refusals and padding
def tiny(config_cls, **fields):
    from transformers import AutoModelForCausalLM

    base = dict(vocab_size=64, hidden_size=72, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    config = config_cls(**{**base, **fields})
    config._attn_implementation = fields.get("attn_implementation", "sdpa")
    return AutoModelForCausalLM.from_config(config)


def test_recipe_refusals_name_the_key_and_what_is_allowed():
    with pytest.raises(RecipeError, match=r"data.document_boundaries: got 'mask'; expected eos with parallel.sequence"):
        load_args("tiny-cpu", ["parallel.sequence=2", "data.document_boundaries=mask"])
    with pytest.raises(RecipeError, match=r"model.attn_implementation: got 'eager'; expected one of sdpa, flash_at"):
        load_args("tiny-cpu", ["parallel.sequence=2", "model.attn_implementation=eager"])
    with pytest.raises(RecipeError, match=r"parallel.sequence: got 0; expected a positive number of processes"):
        load_args("tiny-cpu", ["parallel.sequence=0"])
    with pytest.raises(RecipeError, match=r"data.max_seq_length: got 2; expected at least parallel.sequence \(4\)"):
        load_args("tiny-cpu", ["parallel.sequence=4", "data.max_seq_length=2"])
    # mask with flash attention is not refused here (FlashAttention reads the documents from the positions)
    args = load_args(
        "tiny-cpu",
        ["parallel.sequence=2", "data.document_boundaries=mask", "model.attn_implementation=flash_attention_2"],
    )
    assert args.parallel.sequence == 2


def test_layout_refuses_a_degree_that_does_not_divide_the_processes():
    args = load_args("tiny-cpu", ["parallel.sequence=2"])
    with pytest.raises(RecipeError, match=r"parallel.sequence: got 2 with 1 process\(es\); expected a divisor"):
        parallel.layout(args, 1, 0)
    with pytest.raises(RecipeError, match=r"parallel.sequence: got 2 with accelerate's context parallelism"):
        parallel.layout(args, 4, 0, context=2)
    where = parallel.layout(args, 4, 3)  # 2 data-parallel groups of 2 consecutive processes
    assert (where.rank, where.shard, where.data_parallel, where.kind) == (1, 1, 2, "sequence")
    plain = parallel.layout(load_args("tiny-cpu"), 2, 1)
    assert (plain.rank, plain.degree, plain.kind) == (1, 1, None)


def test_one_process_asked_to_share_sequences_exits_2_with_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rope_extend", "train", "tiny-cpu", "parallel.sequence=2", f"output_dir={out}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "parallel.sequence: got 2 with 1 process(es); expected a divisor of the number of processes" in lines[0]
    assert not out.exists() and sorted(tmp_path.iterdir()) == []


def test_heads_the_degree_does_not_divide_are_refused_with_the_allowed_degrees():
    from transformers import LlamaConfig

    model = tiny(LlamaConfig, num_attention_heads=9, num_key_value_heads=3)  # SmolLM2-135M's geometry
    with pytest.raises(
        rope_extend.UnsupportedModelError, match=r"9 attention heads and 3 key-value heads.*allowed degrees 3, 9$"
    ):
        ulysses.head_split(model, 2, 1)
    assert ulysses.head_split(model, 3, 1).heads == 9
    assert ulysses.allowed_degrees(32, 8) == [2, 4, 8, 16, 32]  # Llama-3-8B
    assert ulysses.allowed_degrees(28, 4) == [2, 4, 28]  # Qwen2.5-7B


def test_local_attention_on_sdpa_is_refused():
    from transformers import MistralConfig, Qwen2Config

    with pytest.raises(
        rope_extend.UnsupportedModelError, match=r"local attention \(sliding_window 16\).*flash_attention_2"
    ):
        ulysses.head_split(tiny(MistralConfig, num_key_value_heads=2, sliding_window=16), 2, 1)
    qwen = tiny(Qwen2Config, num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert qwen.config.layer_types == ["sliding_attention"]
    with pytest.raises(rope_extend.UnsupportedModelError, match=r"layer types sliding_attention"):
        ulysses.head_split(qwen, 2, 1)


def test_attention_sinks_and_unserved_attention_are_refused():
    from transformers import GptOssConfig, LlamaConfig

    fields = dict(num_key_value_heads=2, head_dim=18, num_local_experts=2, layer_types=["full_attention"])
    sinks = tiny(GptOssConfig, attn_implementation="eager", **fields)  # GPT-OSS runs eager or flash
    sinks.config._attn_implementation = "flash_attention_2"  # as on a GPU
    with pytest.raises(rope_extend.UnsupportedModelError, match=r"attention has sinks"):
        ulysses.head_split(sinks, 2, 1)
    with pytest.raises(rope_extend.UnsupportedModelError, match=r"'eager' is not served.*use one of sdpa"):
        ulysses.head_split(tiny(LlamaConfig, attn_implementation="eager"), 2, 1)


def test_a_sequence_is_padded_exactly_and_sliced_after_the_targets_shift():
    where = parallel.Layout(processes=2, degree=2, index=1, kind="sequence")
    ids = torch.arange(10, 15)[None]  # 5 tokens: padded to 6
    batch = {
        "input_ids": ids,
        "position_ids": torch.tensor([[3, 4, 5, 6, 7]]),
        "targets": torch.tensor([[11, 12, 13, 14, -100]]),
        "attention_mask": torch.ones_like(ids),
    }
    local, span = parallel.shard(batch, where)
    assert span == (3, 7)  # the whole window's positions, the pad excluded
    assert local["input_ids"].tolist() == [[13, 14, 0]]
    assert local["position_ids"].tolist() == [[6, 7, 8]]  # positions run on into the pad
    assert local["targets"].tolist() == [[14, -100, -100]]  # the last real token's target stays where it was
    assert local["attention_mask"].tolist() == [[1, 1, 0]]
    first, _ = parallel.shard(batch, parallel.Layout(2, 2, 0, "sequence"))
    assert first["targets"].tolist() == [[11, 12, 13]]  # no target lost at the shard's edge


def test_whole_sequence_span_is_what_the_dynamic_methods_read():
    from rope_extend.hf import rotary

    entry = type("Entry", (), {"seen": 40})()
    assert rotary.next_seen(entry, 32, 63) == 64 and rotary.next_seen(entry, 0, 31) == 32
    with rotary.whole_sequence(0, 63):  # a shard 32..63 of a sequence starting at 0, or 0..31 of one 64 long
        assert rotary.next_seen(entry, 32, 63) == 64 and rotary.next_seen(entry, 0, 31) == 64
    assert rotary.next_seen(entry, 0, 31) == 32


def test_attention_function_change_is_undone_and_never_stacked():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from rope_extend.hf import transformers_changes

    before = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    undo = transformers_changes.attention_function("sdpa", len)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is len
    with pytest.raises(RuntimeError, match=r"already replaced"):
        transformers_changes.attention_function("sdpa", abs)
    undo()
    assert ALL_ATTENTION_FUNCTIONS._local_mapping == before and ALL_ATTENTION_FUNCTIONS["sdpa"] is not len


# ------------------------------------------------------------------------------------------ 2 processes
def _equality_rows(tmp_path_factory) -> list[dict]:
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("sp") / "rows.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m"]
    proc = subprocess.run(
        [*cmd, "tests.training.sequence_parallel_worker", str(out)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["world"] == 2
    return data["rows"]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return _equality_rows(tmp_path_factory)


@pytest.mark.parallel
@pytest.mark.slow
@pytest.mark.parametrize("method", ["none", *rope_extend.method_names()])
def test_two_processes_equal_one_for_every_method(rows, method):
    mine = {row["variant"]: row for row in rows if row["method"] == method}
    frequency = method != "none" and not registry.get(method).attention
    expected = {"plain", "packed", "unpacked", "odd"} | ({"pose"} if frequency else set())
    assert expected <= set(mine), sorted(mine)
    for variant, row in mine.items():
        assert row["loss_diff"] <= TOLERANCE, (variant, row)
        assert row["grad_diff"] <= TOLERANCE, (variant, row)
        assert row["grad_max"] > 100 * TOLERANCE  # the gradients compared are not all (near) zero


@pytest.mark.parallel
@pytest.mark.slow
def test_log_n_cases_are_run(rows):
    logn = {(row["method"], row["variant"]) for row in rows if row["variant"].endswith("+logn")}
    kinds = {registry.get(method).attention for method, _ in logn}
    assert kinds == {True, False}, logn  # one attention and one frequency method
    assert all(row["grad_diff"] <= TOLERANCE for row in rows if row["variant"].endswith("+logn"))


@pytest.mark.parallel
@pytest.mark.slow
def test_replicated_key_value_heads_are_exact_and_restored(rows):
    """1 key-value head over 2 processes: DeepSpeed replicates it and lowers num_key_value_groups while it runs;
    the worker asserts every module's value is back after removal."""
    replicated = [row for row in rows if row["variant"] == "kv1"]
    assert {registry.get(row["method"]).attention for row in replicated} == {True, False}
    for row in replicated:
        assert row["kv_groups"] == [4, 2], row  # changed while installed (so the restore is tested)
        assert row["loss_diff"] <= TOLERANCE and row["grad_diff"] <= TOLERANCE, row


@pytest.mark.parallel
@pytest.mark.slow
def test_tiny_recipe_with_two_processes_per_sequence_matches_one_process(tmp_path):
    """tiny-cpu (4 heads, 2 KV heads) with parallel.sequence 2 over 2 CPU processes vs 1 process: the same
    global batch, so the same loss curve (within float32 noise, as the 2-process data-parallel test)."""
    pytest.importorskip("deepspeed")
    # the loop tests' short windows, one token shorter (a later key wins): 255 is not divisible by 2, one pad per window
    common = [*FAST, "data.max_seq_length=255", "max_steps=4", "save_steps=100", "merge_adapter=false"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    runs = {}
    for name, launcher, extra in [
        ("one", [sys.executable], []),
        ("two", launch, ["parallel.sequence=2"]),
    ]:
        cmd = [*launcher, "-m", "rope_extend", "train", "tiny-cpu", *common, *extra, f"output_dir={tmp_path / name}"]
        env = {**ENV, "ACCELERATE_USE_CPU": "1"}
        proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "1 process(es)" in proc.stdout  # one data-parallel group in both
        assert ("x 2 per sequence" in proc.stdout) == (name == "two")
        lines = (tmp_path / name / "loss.csv").read_text().splitlines()[1:]
        runs[name] = [float(line.split(",")[1]) for line in lines]
    print("loss curves", json.dumps(runs))
    assert len(runs["one"]) == len(runs["two"]) == 4
    for a, b in zip(runs["one"], runs["two"], strict=True):
        assert a == pytest.approx(b, rel=2e-4)
    assert runs["one"][-1] < runs["one"][0]  # it trained
