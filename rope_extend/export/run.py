"""``export``: resolve the scaling, ask ``routes`` whether the engine serves it, write the file or folder."""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import RopeExtendError, UnsupportedModelError
from ..hf.config import config_scaling, nested_layer_types, plan, rotary_geometry, text_config
from ..io import MARKER, check_writable, normal_permissions, remove_abandoned, write_json, writing
from ..loading import check_weights, load_config, load_model, load_tokenizer, resolve_name
from ..methods._common import rope_frequencies
from ..patch import patched
from ..version import __version__
from . import adaptive, configs, llamacpp
from .forms import DEFAULT
from .gguf_families import FAMILIES, rope_layer
from .routes import APPROXIMATE, ENGINES, REFUSED, Decision, check_target, decide

INFO = "rope-extend-export.json"  # written beside the exported config: what was exported, how, for which engine


@dataclass
class ExportResult:
    """Where the export went, how the engine serves it, and what it could not keep exactly."""

    out: Path
    target: str
    engine: str
    method: str
    how: str
    command: str
    notes: list[str] = field(default_factory=list)
    overrides: dict[str, Any] | None = None
    override_flag: str | None = None  # the engine's flag that takes ``overrides`` as JSON

    @property
    def override_argument(self) -> str | None:
        """``overrides`` as the engine's command-line argument (to serve the original folder unchanged)."""
        if not self.overrides or not self.override_flag:
            return None
        return f"{self.override_flag} '{json.dumps(self.overrides, sort_keys=True)}'"

    def as_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "target": self.target,
            "engine": self.engine,
            "method": self.method,
            "how": self.how,
            "command": self.command,
            "notes": self.notes,
            **(
                {
                    "overrides": self.overrides,
                    "override_flag": self.override_flag,
                    "override_argument": self.override_argument,
                }
                if self.overrides
                else {}
            ),
        }


def _scaling(model, config, method, amounts, params, layer=None):
    """The scaling to export: the one ``patch`` applied, else the one asked for, else the config's own."""
    applied = patched(model) if model is not None else None
    if applied is not None:
        if method is not None:
            raise RopeExtendError(
                f"the model is already patched with {applied.describe()}: export it as it is (no method), or "
                "unpatch it first"
            )
        return applied
    if method is not None and method != "none":
        return plan(config, method, **amounts, **params)
    if any(v is not None for v in amounts.values()) or params:
        raise RopeExtendError("a factor, target length or parameter was given without a method: name the method")
    return config_scaling(config, layer)


def _read_config(source: Path, trust_remote_code: bool):
    if not (source / "config.json").is_file():
        raise RopeExtendError(f"{source} is not a saved model folder (no config.json)")
    return load_config(source, trust_remote_code=trust_remote_code)


def _rope_layer(config, to: str) -> str | None:
    """The layer type whose rope dict is exported: None for one flat dict; for GGUF, the global layers of a family
    whose sliding layers llama.cpp keeps at their own base, unscaled (Gemma 3: ``gguf_families``)."""
    fam = FAMILIES.get(getattr(config, "model_type", None))
    if to == "gguf" and fam is not None and nested_layer_types(config):
        return rope_layer(fam)
    return None


def _geometry(config, layer=None):
    if not getattr(config, "rope_parameters", None):
        raise UnsupportedModelError(
            f"{getattr(config, 'model_type', type(config).__name__)} has no rope_parameters: the model does not use "
            "rotary position embeddings, so there is no scaling to export"
        )
    if nested_layer_types(config) and layer is None:
        raise UnsupportedModelError(
            f"{config.model_type} keeps one rope dict per layer type ({', '.join(nested_layer_types(config))}); "
            "export writes one flat rope dict, so models with per-layer-type RoPE (Gemma 3, Gemma 4) are not "
            "exported yet (Gemma 3 is, --to gguf)"
        )
    return rotary_geometry(config, layer)


def _rewrite_config(folder: Path, updates: dict[str, Any], target: str) -> None:
    path = folder / "config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    if "text_config" in data:
        raise UnsupportedModelError("composite configs (a text_config inside) are not exported yet")
    for key in ("rope_scaling", "rope_parameters", "rope_theta"):
        data.pop(key, None)
    data.update({k: v for k, v in updates.items() if v is not None})
    if target == "transformers4":
        data.pop("rope_extend_shipped_context", None)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _check_out(out: Path) -> None:
    if out.exists() or out.is_symlink():
        raise RopeExtendError(f"--out {out} exists: nothing there is touched; give a new path")
    check_writable(out)
    remove_abandoned(out)  # what an export into the same path that was killed left behind


def export(
    model,
    to: str,
    out,
    *,
    method: str | None = None,
    factor: float | None = None,
    target_length: int | None = None,
    original_max_position_embeddings: int | None = None,
    tokenizer=None,
    approximate: bool = False,
    dtype: str = "f32",
    tokenizer_pre: str | None = None,
    trust_remote_code: bool = False,
    buckets=None,
    **params,
) -> ExportResult:
    """Export ``model`` (a loaded model, patched or not, or a saved folder / a name rope-extend knows) for ``to``.

    With ``method`` (and ``factor`` or ``target_length``, and the method's parameters) an unpatched model or a
    folder is exported with that scaling; without it, the scaling the model was patched or configured with.
    ``gguf`` needs the tokenizer (``tokenizer=``, read from the folder when ``model`` is one) and takes
    ``dtype`` (f32, f16, q8_0) and ``tokenizer_pre`` (llama.cpp's pre-tokenizer name, when rope-extend does not
    know the tokenizer). ``dynamic_yarn`` to ``vllm`` is served per request by rope-extend's vLLM plugin, with
    YaRN at the smallest of ``buckets`` (factors, default powers of two up to the factor) that covers the prompt
    plus ``max_tokens`` (``adaptive``); with ``approximate`` it is made static instead. Returns an
    ``ExportResult`` whose ``command`` serves the export at the target length.
    """
    check_target(to)
    out = Path(out)
    _check_out(out)
    if to == "gguf":
        llamacpp.check_dtype(dtype)  # before anything is read
    source = None
    if isinstance(model, (str, Path)):
        source = Path(resolve_name(str(model)))
        config, loaded = _read_config(source, trust_remote_code), None
        check_weights(source)  # a folder target copies the weights unread: a truncated file would be served
    else:
        config, loaded = model.config, model
    cfg = text_config(config)
    layer = _rope_layer(cfg, to)
    dim, base = _geometry(cfg, layer)
    amounts = {
        "factor": factor,
        "target_length": target_length,
        "original_max_position_embeddings": original_max_position_embeddings,
    }
    scaling = _scaling(loaded, cfg, method, amounts, params, layer)
    name = scaling.method.name if scaling is not None else "none"
    decision: Decision = decide(scaling, to, dim, base)
    if decision.status == REFUSED or (decision.status == APPROXIMATE and not approximate):
        raise RopeExtendError(decision.message(name, to))
    if buckets is not None and not (decision.adaptive and not approximate):
        raise RopeExtendError("buckets goes with dynamic_yarn exported to vllm (without --approximate)")
    if decision.adaptive and approximate:  # the static fallback: YaRN at the target for every request
        decision = Decision(APPROXIMATE, decision.form, decision.form.changes)
    notes = [decision.reason] if decision.status == APPROXIMATE else []
    length = scaling.target_length if scaling is not None else int(cfg.max_position_embeddings)
    if to == "gguf":
        fam = llamacpp.check_family(config, decision.form, length)  # before any weight is read
        if loaded is None:
            loaded = load_model(str(source), trust_remote_code=trust_remote_code)
            tokenizer = tokenizer or load_tokenizer(str(source), trust_remote_code=trust_remote_code)
        return _export_gguf(
            loaded, tokenizer, scaling, name, decision, out, length, dim, base, dtype, tokenizer_pre, notes, fam
        )
    if decision.adaptive:
        return _export_adaptive(loaded, tokenizer, source, cfg, scaling, buckets, base, out, _dtype(cfg, loaded))
    return _export_folder(loaded, tokenizer, source, name, decision, to, out, length, notes, _dtype(cfg, loaded))


def _export_gguf(model, tokenizer, scaling, name, decision, out, length, dim, base, dtype, tokenizer_pre, notes, fam):
    if tokenizer is None:
        raise RopeExtendError("a GGUF file carries the tokenizer: pass tokenizer= with the model")
    form = decision.form
    plain = rope_frequencies(dim, base)
    scaled = scaling.compute(dim, base, length)[0] if scaling is not None and form.kind != DEFAULT else plain
    keys, tensors, how = llamacpp.rope_metadata(form, plain, scaled, fam.divisors)
    extra: list[str] = []
    tool = "llama-server"
    if name == "self_extend":
        rules = scaling.rules()
        extra, tool = llamacpp.self_extend_flags(rules.group_size, rules.window), "llama-completion"
        how = f"plain RoPE; {' '.join(extra)} on the command line"
    # the file's context_length is what llama.cpp serves without flags: for self_extend that is plain RoPE, which
    # holds only to L, so the file says L (and llama.cpp warns past it); the command asks for the target length
    # together with the group-attention flags
    context = scaling.original_max_position_embeddings if name == "self_extend" else length
    with writing(out) as tmp:
        llamacpp.write(tmp, model, tokenizer, keys, tensors, context=context, dtype=dtype, tokenizer_pre=tokenizer_pre)
        normal_permissions(tmp)
    command = llamacpp.serve_command(out, length, extra, tool)
    return ExportResult(out, "gguf", ENGINES["gguf"], name, how, command, notes)


def _dtype(config, model) -> str | None:
    """The dtype the served model should compute in: a loaded model's own, else the folder's config's (what
    transformers loads it in); ``float32``, ``bfloat16`` or ``float16``, None when the config does not say."""
    dtype = next(model.parameters()).dtype if model is not None else getattr(config, "dtype", None)
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    return name if name in ("float32", "bfloat16", "float16") else None


def _write_model(model, tokenizer, source, folder: Path) -> None:
    if source is not None:
        shutil.copytree(source, folder, ignore=shutil.ignore_patterns(MARKER, INFO, ".*"))
    else:
        model.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)


def _adaptive_updates(model, cfg, scaling, buckets, base) -> tuple[dict[str, Any], adaptive.Plan]:
    """The config keys of a folder served by rope-extend's vLLM plugin (``adaptive``, ``vllm_plugin``)."""
    # a model built in memory has no architectures yet (save_pretrained writes its class name)
    arch = adaptive.check_architecture(
        getattr(cfg, "architectures", None) or ([type(model).__name__] if model is not None else None)
    )
    own = config_scaling(cfg)
    if own is not None:
        raise UnsupportedModelError(
            f"the model ships {own.method.name} scaling; the adaptive vLLM export serves short requests with plain "
            "RoPE, so it needs a model without one: pass --approximate for static yarn"
        )
    plan = adaptive.Plan.of(scaling.original_max_position_embeddings, adaptive.check_buckets(buckets, scaling.factor))
    values = {k: v for k, v in dataclasses.asdict(scaling.params).items() if v is not None}
    adaptive.scaling(plan, values)  # refuses finetuned and bad parameters before anything is written
    rope = {
        "rope_type": adaptive.METHOD,
        "factor": float(scaling.factor),
        "original_max_position_embeddings": plan.original,
        **values,
        "rope_theta": float(base),
    }
    updates = {
        "architectures": [adaptive.PREFIX + arch],
        # vLLM serves max_position_embeddings x factor for a rope type it does not know as already scaled
        "max_position_embeddings": plan.original,
        "rope_parameters": rope,
        adaptive.CONFIG_KEY: {**plan.as_config(), "architecture": arch},
    }
    return updates, plan


def _export_adaptive(model, tokenizer, source, cfg, scaling, buckets, base, out, dtype):
    updates, plan = _adaptive_updates(model, cfg, scaling, buckets, base)
    factors = ", ".join(f"x{s:g}" for s in plan.factors[1:])
    how = (
        f"per request, from prompt + max_tokens: the model's own RoPE up to L={plan.original}, else yarn at the "
        f"smallest of {factors} that covers it (rope-extend's vLLM plugin, RopeExtendAdaptive{updates[adaptive.CONFIG_KEY]['architecture']})"
    )
    command = configs.serve_command("vllm", str(out), None, plan.longest, dtype)
    notes = [
        (
            "serve with rope-extend installed in vLLM's environment: its vllm.general_plugins entry point registers "
            "the architecture (without it vLLM refuses the folder)"
        ),
        (
            "give each request max_tokens: its factor is chosen from prompt + max_tokens and kept for its life "
            f"(without max_tokens a request may grow to {plan.longest} tokens, so it gets x{plan.factors[-1]:g})"
        ),
        f"do not serve past {plan.longest} tokens: the table ends there",
        (
            "past L a request gets its bucket's factor from its first token, where transformers' dynamic_yarn uses "
            "l / L at the current length l (and turns cached keys as it grows): the two agree inside L and at "
            "each bucket's edge"
        ),
    ]
    with writing(out) as tmp:
        _write_model(model, tokenizer, source, tmp)
        _rewrite_config(tmp, updates, "vllm")
        info = {"tool": f"rope-extend {__version__}", "engine": ENGINES["vllm"], "method": adaptive.METHOD, "how": how}
        write_json(tmp / INFO, {**info, "command": command, "notes": notes})
        normal_permissions(tmp)
    return ExportResult(out, "vllm", ENGINES["vllm"], adaptive.METHOD, how, command, notes)


def _export_folder(model, tokenizer, source, name, decision, to, out, length, notes, dtype):
    form = decision.form
    updates = configs.config_updates(form, length, to)
    how = json.dumps(updates.get("rope_parameters", updates.get("rope_scaling")) or {"rope_theta": form.base})
    command = configs.serve_command(to, str(out), form, length, dtype)
    longer = configs.longer_note(to, form, length)
    if longer:  # before the info file is written, so that it carries the note too
        notes.append(longer)
    with writing(out) as tmp:
        _write_model(model, tokenizer, source, tmp)
        _rewrite_config(tmp, updates, to)
        info = {"tool": f"rope-extend {__version__}", "engine": ENGINES[to], "method": name, "how": how}
        write_json(tmp / INFO, {**info, "command": command, "notes": notes})
        normal_permissions(tmp)  # a copy of a cached folder would keep the cache's 0600 files
    flag = configs.OVERRIDE_FLAG.get(to)
    return ExportResult(out, to, ENGINES[to], name, how, command, notes, updates if flag else None, flag)
