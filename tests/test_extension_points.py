"""Each extension point takes one definition and nothing else: a toy scaling method, a toy evaluation task, a
toy export target and a toy family rule, each defined here in a few lines, registered, used end to end through the
public entry point (``rope_extend.patch``, ``rope-extend eval``, ``rope_extend.export.export``), and
unregistered."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import modeling_rope_utils as mru

import rope_extend
from rope_extend import RopeExtendError, UnsupportedModelError
from rope_extend.cli import main
from rope_extend.evaluation import runner
from rope_extend.evaluation.report import label_of
from rope_extend.evaluation.tasks import TASKS, Context, Task, TextOptions, check_lengths
from rope_extend.export import TARGETS, export
from rope_extend.export.targets.base import ExportJob, ExportResult, ExportTarget
from rope_extend.hf.families import RULES, Rule
from rope_extend.io import writing
from rope_extend.methods import registry
from rope_extend.methods._common import Geometry, Method, rope_frequencies
from rope_extend.schema import option
from tests.evaluation.conftest import make_text
from tests.tiny import tiny_model, tiny_tokenizer


# ------------------------------------------------------------------------------------------ a method
@dataclass(frozen=True)
class NoParams:
    pass


def position_interpolation(params: NoParams, geo: Geometry, factor: float, seq_len):
    """Chen et al. 2023 written out: every frequency divided by ``s`` (the built-in ``linear``)."""
    return rope_frequencies(geo.dim, geo.base) / factor, 1.0


TOY_METHOD = Method("toy_pi", NoParams, position_interpolation, rope_type="toy_pi", source="a test")


@pytest.fixture
def toy_method():
    registry.register(TOY_METHOD)
    yield TOY_METHOD
    registry.METHODS.unregister(TOY_METHOD.name)  # and its rope types leave transformers (hf.transformers_changes)
    assert "toy_pi" not in mru.ROPE_INIT_FUNCTIONS and "proportional_toy_pi" not in mru.ROPE_INIT_FUNCTIONS


def test_a_toy_method_patches_a_model_as_the_built_in_one_it_copies(toy_method):
    ids = torch.randint(3, 500, (1, 300))  # past the tiny model's original 256
    model = tiny_model()
    with torch.no_grad():
        plain = model(ids).logits
        rope_extend.patch(model, "toy_pi", factor=2)
        toy = model(ids).logits
        assert rope_extend.patched(model).method.name == "toy_pi"
        rope_extend.unpatch(model)
        rope_extend.patch(model, "linear", factor=2)
        linear = model(ids).logits
    torch.testing.assert_close(toy, linear, atol=1e-6, rtol=0)
    assert (toy - plain).abs().max() > 1e-4  # the patch changed the model (its logits are about 0.1)


def test_an_unregistered_method_is_unknown(toy_method):
    registry.METHODS.unregister("toy_pi")
    with pytest.raises(RopeExtendError, match="unknown method 'toy_pi'.*allowed: linear"):
        rope_extend.patch(tiny_model(), "toy_pi", factor=2)
    registry.register(TOY_METHOD)  # for the fixture's teardown


# ------------------------------------------------------------------------------------------ a task
@dataclass(kw_only=True)
class LossOptions(TextOptions):
    lengths: list[Any] = option(help="context lengths in tokens")

    def __post_init__(self):
        check_lengths(self)


def next_token_loss(model, tokenizer, options: LossOptions, context: Context) -> list[dict]:
    """The mean next-token loss over the first ``length`` tokens of the texts."""
    ids = tokenizer(" ".join(context.texts), return_tensors="pt").input_ids[0]

    def measure(job):
        window = ids[None, : job["length"]]
        with torch.no_grad():
            return {"loss": model(window, labels=window).loss.item()}

    jobs = [{"length": n} for n in options.lengths]
    return runner.run(
        model, task="toy_loss", setting={}, jobs=jobs, measure=measure, longest=max(options.lengths), **context.common()
    )


TOY_TASK = Task(
    name="toy_loss",
    help="mean next-token loss",
    title="Next-token loss",
    options=LossOptions,
    run=next_token_loss,
    summarize=lambda records: {
        "toy_loss": [{"label": label_of(r), "length": r["length"], "loss": r["loss"]} for r in records]
    },
    render=lambda summary: [f"toy loss {r['length']}: {r['loss']:.4f}" for r in summary.get("toy_loss", [])],
)


@pytest.fixture
def toy_task():
    TASKS.register(TOY_TASK)
    yield TOY_TASK
    TASKS.unregister(TOY_TASK.name)


def test_a_toy_task_runs_from_the_command_line(toy_task, tmp_path, capsys):
    folder, text = tmp_path / "model", tmp_path / "doc.txt"
    model, tokenizer = tiny_model(), tiny_tokenizer()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    text.write_text(make_text(60, seed=1))
    args = ["eval", "toy_loss", "--model", str(folder), "--lengths", "32,64", "--data", str(text)]
    code = main([*args, "--out", str(tmp_path / "o"), "--no-progress", "--json"])
    assert code == 0, capsys.readouterr().err
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]["toy_loss"]
    ids = tokenizer(text.read_text().strip(), return_tensors="pt").input_ids
    with torch.no_grad():
        want = {n: F.cross_entropy(model(ids[:, :n]).logits[0, :-1], ids[0, 1:n]).item() for n in (32, 64)}
    assert {r["length"]: r["loss"] for r in rows} == pytest.approx(want, rel=1e-5)
    assert "toy loss 64" in (tmp_path / "o" / "report.md").read_text()
    TASKS.unregister("toy_loss")
    with pytest.raises(RopeExtendError, match="unknown evaluation task 'toy_loss'"):
        TASKS.get("toy_loss")
    TASKS.register(TOY_TASK)  # for the fixture's teardown


# ------------------------------------------------------------------------------------------ an export target
class FrequencyFile(ExportTarget):
    """Writes the scaled inverse frequencies and attention scale as JSON: an engine that reads a table."""

    name, engine, writes = "toy_json", "toy engine 1", "a JSON file of the rope table"

    def write(self, job: ExportJob) -> ExportResult:
        freqs, scale = job.scaling.compute(job.dim, job.base, job.length)
        with writing(job.out) as tmp:
            tmp.write_text(json.dumps({"inv_freq": freqs.tolist(), "attention_scale": scale}))
        return ExportResult(
            out=job.out, target=self.name, engine=self.engine, method=job.method, how="a table", command=""
        )


@pytest.fixture
def toy_target():
    TARGETS.register(FrequencyFile())
    yield
    TARGETS.unregister("toy_json")


def test_a_toy_export_target_writes_what_the_patched_model_computes(toy_target, tmp_path):
    model = rope_extend.patch(tiny_model(), "yarn", factor=4)
    result = export(model, "toy_json", tmp_path / "rope.json")
    written = json.loads((tmp_path / "rope.json").read_text())
    config = model.config
    dim = config.hidden_size // config.num_attention_heads
    want, scale = rope_extend.inv_freq("yarn", dim, config.rope_parameters["rope_theta"], 4, 256)
    torch.testing.assert_close(torch.tensor(written["inv_freq"]), want, rtol=1e-6, atol=0)
    assert written["attention_scale"] == pytest.approx(scale) and scale > 1  # YaRN's temperature
    assert (result.target, result.engine, result.method) == ("toy_json", "toy engine 1", "yarn")
    # the rules every engine shares hold for it: an attention method is refused, naming the toy engine
    with pytest.raises(RopeExtendError, match="toy engine 1 cannot serve rerope"):
        export(rope_extend.patch(tiny_model(), "rerope", window=64), "toy_json", tmp_path / "no.json")
    assert not (tmp_path / "no.json").exists()
    TARGETS.unregister("toy_json")
    with pytest.raises(RopeExtendError, match="unknown export target 'toy_json'.*allowed: gguf"):
        export(model, "toy_json", tmp_path / "again.json")
    TARGETS.register(FrequencyFile())  # for the fixture's teardown


# ------------------------------------------------------------------------------------------ a family rule
def toy_temperature(holder) -> str | None:
    """A made-up quirk of a made-up family: a Llama whose config carries ``toy_temperature`` scales its queries
    by it, so log-n on top would compound."""
    value = getattr(holder, "toy_temperature", None)
    return None if value is None else f"the toy family scales its queries by {value} itself, and log-n would compound"


TOY_RULE = Rule("toy_temperature", "own_temperature", toy_temperature, model_types=("llama",))


@pytest.fixture
def toy_rule():
    RULES.register(TOY_RULE)
    yield TOY_RULE
    RULES.unregister(TOY_RULE.name)


def test_a_toy_family_rule_is_asked_by_patch_and_goes_with_unregister(toy_rule):
    ids = torch.randint(3, 500, (1, 300))
    model = tiny_model()
    model.config.toy_temperature = 1.5
    with torch.no_grad():
        plain = model(ids).logits
        with pytest.raises(UnsupportedModelError, match=r"^llama: cannot apply 'yarn': the toy family scales its"):
            rope_extend.patch(model, "yarn", factor=2, logn=True)
        assert rope_extend.patched(model) is None
        torch.testing.assert_close(model(ids).logits, plain, rtol=0, atol=0)  # refused before anything changed
        rope_extend.patch(model, "yarn", factor=2)  # without log-n the quirk is not in the way
        rope_extend.unpatch(model)
        other = tiny_model("qwen2")
        other.config.toy_temperature = 1.5
        rope_extend.patch(other, "yarn", factor=2, logn=True)  # keyed by model_type: not a Qwen2
        RULES.unregister("toy_temperature")
        rope_extend.patch(model, "yarn", factor=2, logn=True)  # the rule is gone, and so is the refusal
        assert rope_extend.patched(model).logn
    RULES.register(TOY_RULE)  # for the fixture's teardown
