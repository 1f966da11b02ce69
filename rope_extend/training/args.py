"""Training arguments: dataclasses that a YAML recipe maps onto 1:1.

A recipe is a YAML mapping whose top-level keys are the fields of ``TrainArgs``; the sections ``model``,
``rope``, ``data``, ``pose`` and ``lora`` are mappings onto their own dataclasses. Key names follow
transformers' ``TrainingArguments`` (``max_steps``, ``learning_rate``, ``output_dir``, ...) and PEFT's
``LoraConfig`` (``r``, ``lora_alpha``, ``target_modules``, ``modules_to_save``). Command-line overrides
``key=value`` (values parsed as YAML scalars; dotted keys for sections: ``rope.factor=8``) win over the
file. An unknown or mistyped key, or a value of the wrong type, raises ``RecipeError`` naming the key and
what was expected (with the closest valid keys).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import RopeExtendError


class RecipeError(RopeExtendError):
    """A recipe that does not parse or validate."""


@dataclass
class ModelArgs:
    """Where the model comes from: a saved folder or hub name, or a config to build random weights from."""

    name_or_path: str | None = None
    # Build a random-weight model from this config instead (``model_type`` plus config fields); for the
    # tiny CPU recipe and tests. Exactly one of name_or_path / config.
    config: dict[str, Any] | None = None
    # Tokenizer folder or hub name; default: name_or_path. With ``config`` and no tokenizer, a byte-level
    # BPE of the config's vocab_size is trained on the training text (offline, seconds).
    tokenizer: str | None = None
    dtype: str = "float32"  # weights as loaded: float32 | bfloat16 | float16
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False


@dataclass
class RopeArgs:
    """The scaling, as ``rope_extend.patch(model, method, factor, target_length, ...)`` takes it.
    ``method: none`` trains with the model's rope as it is (pretraining), with no factor."""

    method: str = "yarn"
    factor: float | None = None
    target_length: int | None = None
    original_max_position_embeddings: int | None = None
    params: dict[str, Any] = field(default_factory=dict)  # method parameters, e.g. {beta_fast: 32}


@dataclass
class DataArgs:
    """Training text: local files (txt/jsonl/json/parquet) or a dataset name, packed into fixed windows."""

    path: str | list[str] | None = None  # file, glob, folder or list of files; or a hub dataset name
    name: str | None = None  # dataset configuration name (hub datasets)
    split: str = "train"
    text_field: str = "text"
    max_seq_length: int = 1024  # tokens per packed sequence (the training window)
    # How packed documents are kept apart (EOS always separates them):
    #  "eos":  positions run on across documents, attention crosses them (YaRN/LongLoRA on PG19). Every
    #          attention kernel stays on its fast path and the model sees long distances even when the
    #          documents are shorter than the window.
    #  "mask": positions restart at each document and transformers confines attention to each document
    #          (varlen on flash_attention_2; an L x L block mask on sdpa, so use it for short windows).
    document_boundaries: str = "eos"
    # false: no packing; each document is its own sequence, cut to max_seq_length and padded (padding is
    # masked out of attention and loss). For short self-contained examples (TRL's SFTConfig.packing).
    packing: bool = True
    max_documents: int | None = None  # read at most this many documents (quick runs)


@dataclass
class PoseArgs:
    """PoSE (Zhu et al. 2024): train in a window of ``data.max_seq_length`` tokens with position ids
    that jump, so the model sees relative distances up to ``target_length`` (default: the rope target)."""

    enabled: bool = False
    target_length: int | None = None
    num_chunks: int = 2


@dataclass
class LoraArgs:
    """PEFT ``LoraConfig`` fields. ``modules_to_save`` trains and saves whole modules with the adapter:
    LongLoRA's "embed, norm" is ``[embed_tokens, norm]`` (``norm`` matches every ``*norm`` module)."""

    r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    target_modules: list[str] | str = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    modules_to_save: list[str] | None = field(default_factory=lambda: ["embed_tokens", "norm"])
    bias: str = "none"


@dataclass
class TrainArgs:
    model: ModelArgs = field(default_factory=ModelArgs)
    rope: RopeArgs = field(default_factory=RopeArgs)
    data: DataArgs = field(default_factory=DataArgs)
    pose: PoseArgs = field(default_factory=PoseArgs)
    lora: LoraArgs | None = field(default_factory=LoraArgs)  # null: full fine-tuning
    output_dir: str = "runs/rope-extend"
    overwrite_output_dir: bool = False
    resume_from_checkpoint: bool | str = False  # true: the latest checkpoint in output_dir; or a folder
    seed: int = 42
    max_steps: int = 400
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    learning_rate: float = 2e-5
    lr_scheduler_type: str = "constant_with_warmup"  # transformers.get_scheduler names: linear, cosine, ...
    warmup_steps: int = 20
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # 0: no clipping
    bf16: bool = False  # autocast in bfloat16 (accelerate mixed_precision="bf16")
    fp16: bool = False
    gradient_checkpointing: bool = True
    loss_chunk_size: int = 1024  # tokens per LM-head chunk; logits never exist for more at once
    logging_steps: int = 1
    save_steps: int = 100
    save_total_limit: int | None = 2
    report_to: list[str] | str = "none"  # accelerate trackers: tensorboard, wandb, ... or none
    merge_adapter: bool = True  # LoRA: also write the merged model

    def validate(self) -> "TrainArgs":
        def bad(key, value, allowed):
            raise RecipeError(f"{key}: got {value!r}; expected {allowed}")

        m = self.model
        if (m.name_or_path is None) == (m.config is None):
            bad("model", {"name_or_path": m.name_or_path, "config": m.config},
                "exactly one of model.name_or_path or model.config")
        if m.config is not None and "model_type" not in m.config:
            bad("model.config", m.config, "a mapping with model_type (e.g. llama) and config fields")
        if m.dtype not in ("float32", "bfloat16", "float16"):
            bad("model.dtype", m.dtype, "float32, bfloat16 or float16")
        r = self.rope
        if r.method == "none":
            if r.factor is not None or r.target_length is not None or r.params:
                bad("rope", {"factor": r.factor, "target_length": r.target_length, "params": r.params},
                    "no factor, target_length or params with rope.method none (the rope is left as it is)")
        elif (r.factor is None) == (r.target_length is None):
            bad("rope", {"factor": r.factor, "target_length": r.target_length},
                "exactly one of rope.factor or rope.target_length")
        if r.factor is not None and r.factor < 1:
            bad("rope.factor", r.factor, "a number >= 1 (target length / original length)")
        if r.target_length is not None and r.target_length < 1:
            bad("rope.target_length", r.target_length, "a positive number of tokens")
        d = self.data
        if d.path is None:
            bad("data.path", None, "a text/JSONL/Parquet file, folder, glob, list of files, or dataset name")
        if d.max_seq_length < 2:
            bad("data.max_seq_length", d.max_seq_length, "at least 2 tokens")
        if d.document_boundaries not in ("eos", "mask"):
            bad("data.document_boundaries", d.document_boundaries, "eos or mask")
        if self.pose.enabled and not d.packing:
            bad("data.packing", d.packing, "true with PoSE (PoSE stretches the positions of full windows)")
        if self.pose.enabled and r.method == "none":
            bad("rope.method", r.method, "a scaling method with PoSE (PoSE trains for a longer target)")
        if self.pose.enabled:
            if d.document_boundaries != "eos":
                bad("data.document_boundaries", d.document_boundaries,
                    "eos with PoSE (PoSE sets the position ids; restarting them per document would undo it)")
            if self.pose.num_chunks < 1 or self.pose.num_chunks > d.max_seq_length:
                bad("pose.num_chunks", self.pose.num_chunks, f"1 .. data.max_seq_length ({d.max_seq_length})")
            if self.pose.target_length is not None and self.pose.target_length < d.max_seq_length:
                bad("pose.target_length", self.pose.target_length, f">= data.max_seq_length ({d.max_seq_length})")
        if self.lora is not None:
            if self.lora.r < 1:
                bad("lora.r", self.lora.r, "a positive rank")
            if self.lora.bias not in ("none", "all", "lora_only"):
                bad("lora.bias", self.lora.bias, "none, all or lora_only")
        for key in ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps",
                    "save_steps", "loss_chunk_size"):
            if getattr(self, key) < 1:
                bad(key, getattr(self, key), "a positive integer")
        if self.warmup_steps < 0 or self.learning_rate <= 0 or self.max_grad_norm < 0:
            bad("warmup_steps/learning_rate/max_grad_norm",
                (self.warmup_steps, self.learning_rate, self.max_grad_norm), "warmup >= 0, lr > 0, norm >= 0")
        if self.bf16 and self.fp16:
            bad("bf16/fp16", (self.bf16, self.fp16), "at most one of them true")
        if self.resume_from_checkpoint and self.overwrite_output_dir:
            bad("resume_from_checkpoint/overwrite_output_dir", (self.resume_from_checkpoint, True),
                "not both: overwriting discards the run you asked to resume")
        from transformers import SchedulerType

        allowed = [s.value for s in SchedulerType]
        if self.lr_scheduler_type not in allowed:
            bad("lr_scheduler_type", self.lr_scheduler_type, ", ".join(allowed))
        return self


# ------------------------------------------------------------------------------------------ loading
def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    if isinstance(hint, type):
        return {"str": "a string", "bool": "true/false"}.get(hint.__name__, hint.__name__)
    return str(hint).replace("typing.", "").replace("NoneType", "null")


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise RecipeError(f"{prefix.rstrip('.') or 'recipe'}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(prefix + c for c in close)}?" if close else ""
            raise RecipeError(f"unknown key {prefix}{key}{hint} (valid keys: {', '.join(names)})")
        hint = hints[key]
        nested = [h for h in (typing.get_args(hint) or (hint,)) if dataclasses.is_dataclass(h)]
        if nested and isinstance(value, dict):
            kwargs[key] = _build(nested[0], value, f"{prefix}{key}.")
            continue
        if isinstance(value, float) and value.is_integer() and _type_ok(int(value), hint) and not _type_ok(value, hint):
            value = int(value)
        if hint in (float, float | None):
            if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
                try:
                    value = float(value)
                except ValueError:
                    pass
            elif isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
        if not _type_ok(value, hint):
            raise RecipeError(f"{prefix}{key}: got {value!r} ({type(value).__name__}); expected {_describe(hint)}")
        kwargs[key] = value
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = tree
    for part in parents:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise RecipeError(f"override {dotted}: {part} is not a section")
        node = child
    node[last] = value


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["max_steps=10", "rope.factor=8"]`` -> nested dict (values parsed as YAML)."""
    tree: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise RecipeError(f"override {item!r}: expected key=value (dotted keys for sections: rope.factor=8)")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise RecipeError(f"override {key}: cannot parse {value!r} as YAML: {exc}") from None
        _set_dotted(tree, key.strip(), parsed)
    return tree


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def read_recipe(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {path} is not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path}: expected a mapping of keys at the top, got {type(data).__name__}")
    return data


def load_args(recipe: str | Path | dict | None = None, overrides: list[str] | dict | None = None) -> TrainArgs:
    """Recipe file (or dict) + overrides -> validated ``TrainArgs``. Relative data paths in a recipe file
    stay relative to the working directory (recipes are run from the repository root)."""
    data = read_recipe(recipe) if isinstance(recipe, (str, Path)) else dict(recipe or {})
    over = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
    return _build(TrainArgs, _merge(data, over), "").validate()


def to_dict(args: TrainArgs) -> dict[str, Any]:
    return dataclasses.asdict(args)
