"""Training arguments: dataclasses that a YAML recipe maps onto 1:1, through the one loader (``schema``).

A recipe is a YAML mapping whose top-level keys are the fields of ``TrainArgs``; the sections ``model``,
``rope``, ``data``, ``pose``, ``mixed``, ``lora``, ``memory`` and ``parallel`` are mappings onto their own dataclasses. Key names follow
transformers' ``TrainingArguments`` (``max_steps``, ``learning_rate``, ``output_dir``, ...) and PEFT's
``LoraConfig`` (``r``, ``lora_alpha``, ``target_modules``, ``modules_to_save``). Command-line overrides
``key=value`` (values read as YAML; dotted keys for sections: ``rope.factor=8``) win over the file. An
unknown key, a value of the wrong type or outside its allowed values, or a combination the run cannot do
raises ``RecipeError`` naming the key and what is allowed. A relative path in a recipe file (data, model,
tokenizer) is relative to the recipe when it exists there, so shipped recipes run from any directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .. import resources, schema
from ..documents import SampleBy
from ..errors import RopeExtendError
from ..scaling import ScalingRequest
from ..schema import option
from ..yaml_loader import read_yaml


class RecipeError(RopeExtendError):
    """A recipe that does not parse or validate."""


@dataclass
class ModelArgs:
    """Where the model comes from: a saved folder, a shipped name or hub name, or a config for random weights."""

    name_or_path: str | None = option(
        None,
        help="saved model folder, a name rope-extend ships (bundled), or a hub "
        "name; exactly one of name_or_path and config",
    )
    config: dict[str, Any] | None = option(
        None,
        help="build a random-weight model from this config (model_type "
        "plus config fields) instead; for tiny runs and tests",
    )
    tokenizer: str | None = option(
        None,
        help="tokenizer folder or name (default: name_or_path; with config, a "
        "byte-level BPE of vocab_size trained on the data)",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = option("float32", help="weights as loaded")
    attn_implementation: str = option(
        "sdpa", help="transformers attention implementation (sdpa, flash_attention_2, ...)"
    )
    trust_remote_code: bool = option(False, help="run the model repository's own code (off by default)")


@dataclass
class RopeArgs(ScalingRequest):
    """The scaling to train for (a ``ScalingRequest``; checked in ``TrainArgs.validate`` with keys named
    ``rope.*``)."""

    method: str = option("yarn", help="scaling method (rope-extend methods); none trains the rope as it is")
    params_from: str | None = option(
        None,
        help="a JSON file of the method's parameters, e.g. the longrope.json `rope-extend search` writes; read "
        "when the run starts (so a recipe can name a search that has not run yet); keys in params win",
    )

    def check(self, spell=lambda key: key) -> RopeArgs:
        """``ScalingRequest.check``; with ``params_from``, the method's name only, the rest once the file is read
        (``resolved``)."""
        if self.params_from is None:
            super().check(spell)
        elif not self.scales:
            raise RopeExtendError(f"{spell('params_from')} given without a scaling method ({spell('method')} is none)")
        else:
            from ..methods import registry

            registry.get(self.method)  # an unknown name raises, listing the known ones
        return self

    def resolved(self) -> ScalingRequest:
        """The scaling to patch: this one, with ``params_from`` read (through the suites' reader of the same
        key, ``evaluation.suite.MethodSpec``) and checked; ``self`` is left as the recipe wrote it."""
        if self.params_from is None:
            return self
        from ..evaluation.suite import MethodSpec

        amounts = {k: getattr(self, k) for k in ("factor", "target_length", "original_max_position_embeddings")}
        spec = MethodSpec(method=self.method, **amounts, params=dict(self.params), params_from=self.params_from)
        try:
            spec.read_params_from(None)
        except RopeExtendError as exc:
            raise RecipeError(f"rope.params_from: {exc}") from None
        return ScalingRequest(method=spec.method, **{k: getattr(spec, k) for k in amounts}, params=spec.params)

    def apply(self, model) -> None:
        spec = self.resolved()
        if spec is self:
            super().apply(model)
        else:
            spec.apply(model)


@dataclass
class DataArgs:
    """Training text, read by the one document reader and packed into fixed windows."""

    path: str | list[str] | None = option(
        None, help="a file, folder, glob or list of files (.txt, .jsonl, .parquet), or a hub dataset name"
    )
    name: str | None = option(None, help="dataset configuration name (hub datasets)")
    split: str = option("train", help="dataset split (hub datasets)")
    text_field: str = option("text", help="column holding the text (JSONL, Parquet, datasets)")
    sample_by: SampleBy = option("document", help="a text file is one document, or split by paragraph or line")
    max_docs: int | None = option(None, help="read at most this many documents (quick runs)")
    max_seq_length: int = option(1024, help="tokens per training sequence (the training window)")
    document_boundaries: Literal["eos", "mask"] = option(
        "eos",
        help="packed documents (EOS always between them): eos keeps positions running and attention "
        "crossing them (YaRN, LongLoRA on PG19); mask restarts positions per document and confines "
        "attention to it (varlen on flash_attention_2, an L x L block mask on sdpa)",
    )
    passkey_share: float = option(
        0.0,
        help="share of training windows that are passkey examples: the evaluation's prompt built to fill a "
        "window exactly, its haystack taken from the training text, the key at a uniform random depth and the "
        "answer after the question (0: none)",
    )
    packing: bool = option(
        True,
        help="false: one document per sequence, cut to max_seq_length and padded "
        "(padding masked out of attention and loss)",
    )


@dataclass
class PoseArgs:
    """PoSE (Zhu et al. 2024): train in a window of ``data.max_seq_length`` tokens with position ids that
    jump, so the model sees relative distances up to ``target_length`` (default: the rope target)."""

    enabled: bool = option(False, help="stretch the window's positions to the target length")
    target_length: int | None = option(None, help="distances to cover (default: the rope target length)")
    num_chunks: int = option(2, help="chunks per window, each with its own skip")


@dataclass
class MixedArgs:
    """Mixed context window training (LongRoPE2; ``training.mixed``): in the same steps, short micro-batches
    (positions within the model's original length L) train with the original rope, the others with ``rope``."""

    enabled: bool = option(False, help="short micro-batches keep the original rope, long ones use rope's scaling")
    short_share: float = option(0.5, help="share of the micro-batches that are short (cut to L tokens, no PoSE)")


@dataclass
class MemoryArgs:
    """Memory savers beyond activation checkpointing and the chunked loss (``loss_chunk_size``)."""

    tiled_mlp: bool = option(
        False,
        help="run every decoder MLP over sequence tiles (DeepSpeed's TiledMLP): its widened activations exist for "
        "one tile at a time; exact; needs deepspeed; refused for mixtures of experts, and with a trained MLP weight "
        "under more than one DDP process (DeepSpeed's engine takes it)",
    )
    mlp_tiles: int | None = option(None, help="tiles per MLP call; null: ceil(tokens / hidden_size), DeepSpeed's rule")


@dataclass
class LoraArgs:
    """PEFT ``LoraConfig`` fields."""

    r: int = option(8, help="LoRA rank")
    lora_alpha: int = option(16, help="LoRA scaling numerator (scale = lora_alpha / r)")
    lora_dropout: float = option(0.0, help="dropout on the LoRA input")
    target_modules: list[str] | str = option(
        help="modules that get adapters", factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    modules_to_save: list[str] | None = option(
        help="modules trained and saved whole with the adapter: LongLoRA's trainable embeddings and norms are "
        "[embed_tokens, norm] (norm matches every *norm module)",
        factory=lambda: ["embed_tokens", "norm"],
    )
    bias: Literal["none", "all", "lora_only"] = option("none", help="which biases train")


@dataclass
class ParallelArgs:
    """Processes that share one sequence (Ulysses sequence parallelism, DeepSpeed's ``UlyssesSPAttentionHF``)."""

    sequence: int = option(
        1,
        help="Ulysses degree N: N processes share each sequence, each holding max_seq_length / N tokens (inside "
        "attention every position for 1/N of the heads); num_processes must be a multiple of N; 1: off",
    )


SEQUENCE_PARALLEL_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")


@dataclass
class TrainArgs:
    model: ModelArgs = option(help="the model", factory=ModelArgs)
    rope: RopeArgs = option(help="the rope scaling to train for", factory=RopeArgs)
    data: DataArgs = option(help="the training text", factory=DataArgs)
    pose: PoseArgs = option(help="PoSE positional skip-wise training", factory=PoseArgs)
    mixed: MixedArgs = option(help="mixed context window training (LongRoPE2)", factory=MixedArgs)
    memory: MemoryArgs = option(help="memory savers for long sequences", factory=MemoryArgs)
    lora: LoraArgs | None = option(help="LoRA adapters; null: full fine-tuning", factory=LoraArgs)
    parallel: ParallelArgs = option(help="processes that share one sequence", factory=ParallelArgs)
    output_dir: str = option("runs/rope-extend", help="the run folder (checkpoints, loss curve, final model)")
    overwrite_output_dir: bool = option(False, help="replace an earlier run in output_dir")
    resume_from_checkpoint: bool | str = option(
        False, help="true: the latest checkpoint in output_dir; or a checkpoint folder"
    )
    resume_allow_changes: bool = option(
        False,
        help="resume even though the recipe differs from the one the run "
        "started with (the differing keys are refused otherwise)",
    )
    trust_pickled_checkpoint: bool = option(
        False,
        help="resume from a checkpoint written with pickle files "
        "(DeepSpeed, earlier versions): loading them can run code",
    )
    seed: int = option(42, help="seed of the data order, PoSE, dropout and random weights")
    max_steps: int = option(400, help="optimizer steps")
    per_device_train_batch_size: int = option(1, help="sequences per process per micro-batch")
    gradient_accumulation_steps: int = option(1, help="micro-batches per optimizer step")
    learning_rate: float = option(2e-5, help="peak learning rate")
    lr_scheduler_type: str = option("constant_with_warmup", help="transformers' get_scheduler name")
    warmup_steps: int = option(20, help="linear warm-up steps")
    weight_decay: float = option(0.0, help="AdamW weight decay (matrices only)")
    adam_beta1: float = option(0.9, help="AdamW beta1")
    adam_beta2: float = option(0.95, help="AdamW beta2")
    adam_epsilon: float = option(1e-8, help="AdamW epsilon")
    max_grad_norm: float = option(1.0, help="gradient clipping norm; 0: no clipping")
    bf16: bool = option(False, help="autocast in bfloat16 (accelerate mixed_precision=bf16)")
    fp16: bool = option(False, help="autocast in float16")
    gradient_checkpointing: bool = option(True, help="recompute activations in backward (less memory)")
    loss_chunk_size: int = option(1024, help="tokens per LM-head chunk; logits never exist for more at once")
    logging_steps: int = option(1, help="log every this many steps")
    save_steps: int = option(100, help="checkpoint every this many steps")
    save_total_limit: int | None = option(2, help="keep this many newest checkpoints (null: all)")
    report_to: list[str] | str = option("none", help="accelerate trackers: tensorboard, wandb, ... or none")
    merge_adapter: bool = option(True, help="LoRA: also write the merged model")

    def validate(self) -> TrainArgs:
        """Checks across fields, and the rope method with its parameters (through the method's own dataclass)."""
        from transformers import SchedulerType  # here, not at import: the command line's --help stays fast

        schedulers = [s.value for s in SchedulerType]
        if self.lr_scheduler_type not in schedulers:
            _bad(
                "lr_scheduler_type", self.lr_scheduler_type, f"one of transformers' schedulers: {', '.join(schedulers)}"
            )
        m = self.model
        if (m.name_or_path is None) == (m.config is None):
            _bad(
                "model",
                {"name_or_path": m.name_or_path, "config": m.config},
                "exactly one of model.name_or_path or model.config",
            )
        if m.config is not None and "model_type" not in m.config:
            _bad("model.config", m.config, "a mapping with model_type (e.g. llama) and config fields")
        try:
            self.rope.check(spell=lambda key: f"rope.{key}")
        except RopeExtendError as exc:
            raise RecipeError(str(exc)) from None
        self._check_data()
        if self.pose.enabled:
            self._check_pose()
        self._check_positions()
        self._check_mixed()
        self._check_parallel()
        self._check_memory()
        if self.lora is not None and self.lora.r < 1:
            _bad("lora.r", self.lora.r, "a positive rank")
        self._check_schedule()
        return self

    def _check_data(self) -> None:
        d = self.data
        if d.path is None:
            _bad("data.path", None, "a text/JSONL/Parquet file, folder, glob, list of files, or dataset name")
        if d.max_seq_length < 2:
            _bad("data.max_seq_length", d.max_seq_length, "at least 2 tokens")
        if d.max_docs is not None and d.max_docs < 1:
            _bad("data.max_docs", d.max_docs, "a positive number of documents, or null")
        if not 0.0 <= d.passkey_share < 1.0:
            _bad("data.passkey_share", d.passkey_share, "a share in [0, 1) of the training windows")

    def _check_pose(self) -> None:
        d, pose = self.data, self.pose
        if not d.packing:
            _bad("data.packing", d.packing, "true with PoSE (PoSE stretches the positions of full windows)")
        if self.rope.method == "none":
            _bad("rope.method", self.rope.method, "a scaling method with PoSE (PoSE trains for a longer target)")
        if d.document_boundaries != "eos":
            _bad(
                "data.document_boundaries",
                d.document_boundaries,
                "eos with PoSE (PoSE sets the position ids; restarting them per document would undo it)",
            )
        if pose.num_chunks < 1 or pose.num_chunks > d.max_seq_length:
            _bad("pose.num_chunks", pose.num_chunks, f"1 .. data.max_seq_length ({d.max_seq_length})")
        if pose.target_length is not None and pose.target_length < d.max_seq_length:
            _bad("pose.target_length", pose.target_length, f">= data.max_seq_length ({d.max_seq_length})")

    def _check_positions(self) -> None:
        """The attention methods place tokens by consecutive positions; PoSE's jumps and positions restarting at
        documents are refused by their attention at the first step; here before anything is loaded."""
        from ..methods import registry

        if self.rope.method == "none" or not registry.get(self.rope.method).attention:
            return
        allowed = "a frequency method (yarn, linear, ...) with it; the attention methods need consecutive positions"
        if self.pose.enabled:
            _bad("pose.enabled", True, f"false with rope.method {self.rope.method}, or {allowed}")
        if self.data.document_boundaries == "mask":
            _bad("data.document_boundaries", "mask", f"eos with rope.method {self.rope.method}, or {allowed}")

    def _check_mixed(self) -> None:
        """What ``training.mixed`` can do exactly: a frequency method's rope switched per micro-batch."""
        from ..methods import registry

        if not self.mixed.enabled:
            return
        if not 0.0 < self.mixed.short_share < 1.0:
            _bad("mixed.short_share", self.mixed.short_share, "a share in (0, 1) of the micro-batches")
        if self.rope.method == "none" or registry.get(self.rope.method).attention:
            _bad("rope.method", self.rope.method, "a frequency method (longrope, yarn, ...) with mixed.enabled")
        if self.parallel.sequence != 1:
            _bad("parallel.sequence", self.parallel.sequence, "1 with mixed.enabled (the rope is switched per process)")

    def _check_parallel(self) -> None:
        """Sequence parallelism that the recipe alone shows cannot be exact (the model's heads and layers are
        checked at setup, ``hf.ulysses.head_split``)."""
        n = self.parallel.sequence
        if n < 1:
            _bad("parallel.sequence", n, "a positive number of processes per sequence (1: off)")
        if self.data.max_seq_length < n:
            _bad("data.max_seq_length", self.data.max_seq_length, f"at least parallel.sequence ({n}) tokens")
        if n == 1:
            return
        attn = self.model.attn_implementation
        if attn not in SEQUENCE_PARALLEL_ATTENTION:
            _bad(
                "model.attn_implementation",
                attn,
                f"one of {', '.join(SEQUENCE_PARALLEL_ATTENTION)} with parallel.sequence {n} (DeepSpeed's Ulysses)",
            )
        if self.data.document_boundaries == "mask" and attn == "sdpa":
            _bad(
                "data.document_boundaries",
                "mask",
                f"eos with parallel.sequence {n} on sdpa (Ulysses drops the document mask), or "
                "model.attn_implementation flash_attention_2 (GPU), which reads the documents from the positions",
            )

    def _check_memory(self) -> None:
        tiles = self.memory.mlp_tiles
        if tiles is not None and tiles < 1:
            _bad("memory.mlp_tiles", tiles, "an integer >= 1, or null (ceil(tokens / hidden_size))")
        if tiles is not None and not self.memory.tiled_mlp:
            _bad("memory.mlp_tiles", tiles, "null unless memory.tiled_mlp is true (it sets the tiles of the tiled MLP)")

    def _check_schedule(self) -> None:
        """The step counts, the optimizer's numbers, precision, and resume against overwrite."""
        for key in (
            "max_steps",
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "logging_steps",
            "save_steps",
            "loss_chunk_size",
        ):
            if getattr(self, key) < 1:
                _bad(key, getattr(self, key), "a positive integer")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            _bad("save_total_limit", self.save_total_limit, "a positive number of checkpoints, or null for all")
        if self.warmup_steps < 0:
            _bad("warmup_steps", self.warmup_steps, "a number of steps >= 0")
        if self.learning_rate <= 0:
            _bad("learning_rate", self.learning_rate, "a number > 0")
        if self.max_grad_norm < 0:
            _bad("max_grad_norm", self.max_grad_norm, "a number >= 0 (0: no clipping)")
        if self.bf16 and self.fp16:
            _bad("bf16/fp16", (self.bf16, self.fp16), "at most one of them true")
        if self.resume_from_checkpoint and self.overwrite_output_dir:
            _bad(
                "resume_from_checkpoint/overwrite_output_dir",
                (self.resume_from_checkpoint, True),
                "not both: overwriting discards the run you asked to resume",
            )


def _bad(key: str, value: Any, allowed: str) -> None:
    raise RecipeError(f"{key}: got {value!r}; expected {allowed}")


# ------------------------------------------------------------------------------------------ loading
def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["max_steps=10", "rope.factor=8"]`` -> nested dict (values read as YAML)."""
    return schema.parse_overrides(items, RecipeError)


def _beside_recipe(data: dict, recipe: Path) -> dict:
    """Relative data, model and tokenizer paths of a recipe file, resolved against the recipe's folder."""
    data = schema.merge(data, {})
    for section, key in (("data", "path"), ("model", "name_or_path"), ("model", "tokenizer")):
        node = data.get(section)
        if isinstance(node, dict) and isinstance(node.get(key), str):
            node[key] = resources.beside(recipe, node[key])
        elif isinstance(node, dict) and isinstance(node.get(key), list):
            node[key] = [resources.beside(recipe, v) if isinstance(v, str) else v for v in node[key]]
    return data


def load_args(recipe: str | Path | dict | None = None, overrides: list[str] | dict | None = None) -> TrainArgs:
    """A recipe (a file, the name of a shipped recipe such as ``tiny-cpu``, or a dict) plus overrides ->
    validated ``TrainArgs``."""
    if isinstance(recipe, (str, Path)):
        path = resources.find_recipe(recipe, RecipeError)
        data = _beside_recipe(read_yaml(path, what="recipe", error=RecipeError), path)
        where = f"recipe {path.name}"
    else:
        data, where = dict(recipe or {}), "recipe"
    over = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
    return schema.build(TrainArgs, schema.merge(data, over), where=where, error=RecipeError).validate()


def to_dict(args: TrainArgs) -> dict[str, Any]:
    return schema.to_dict(args)
