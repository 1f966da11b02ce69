"""``export``: resolve the scaling, ask ``routes`` whether the engine serves it, write the file or folder."""

from __future__ import annotations

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
from . import configs, llamacpp
from .forms import DEFAULT
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


def _scaling(model, config, method, amounts, params):
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
    return config_scaling(config)


def _read_config(source: Path, trust_remote_code: bool):
    if not (source / "config.json").is_file():
        raise RopeExtendError(f"{source} is not a saved model folder (no config.json)")
    return load_config(source, trust_remote_code=trust_remote_code)


def _geometry(config):
    if not getattr(config, "rope_parameters", None):
        raise UnsupportedModelError(
            f"{getattr(config, 'model_type', type(config).__name__)} has no rope_parameters: the model does not use "
            "rotary position embeddings, so there is no scaling to export"
        )
    if nested_layer_types(config):
        raise UnsupportedModelError(
            f"{config.model_type} keeps one rope dict per layer type ({', '.join(nested_layer_types(config))}); "
            "export writes one flat rope dict, so models with per-layer-type RoPE (Gemma 3, Gemma 4) are not "
            "exported yet"
        )
    return rotary_geometry(config)


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
    **params,
) -> ExportResult:
    """Export ``model`` (a loaded model, patched or not, or a saved folder / a name rope-extend knows) for ``to``.

    With ``method`` (and ``factor`` or ``target_length``, and the method's parameters) an unpatched model or a
    folder is exported with that scaling; without it, the scaling the model was patched or configured with.
    ``gguf`` needs the tokenizer (``tokenizer=``, read from the folder when ``model`` is one) and takes
    ``dtype`` (f32, f16, q8_0) and ``tokenizer_pre`` (llama.cpp's pre-tokenizer name, when rope-extend does not
    know the tokenizer). Returns an ``ExportResult`` whose ``command`` serves the export at the target length.
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
    dim, base = _geometry(cfg)
    amounts = {
        "factor": factor,
        "target_length": target_length,
        "original_max_position_embeddings": original_max_position_embeddings,
    }
    scaling = _scaling(loaded, cfg, method, amounts, params)
    name = scaling.method.name if scaling is not None else "none"
    decision: Decision = decide(scaling, to, dim, base)
    if decision.status == REFUSED or (decision.status == APPROXIMATE and not approximate):
        raise RopeExtendError(decision.message(name, to))
    notes = [decision.reason] if decision.status == APPROXIMATE else []
    length = scaling.target_length if scaling is not None else int(cfg.max_position_embeddings)
    if to == "gguf":
        llamacpp.check_family(cfg)  # before any weight is read
        if loaded is None:
            loaded = load_model(str(source), trust_remote_code=trust_remote_code)
            tokenizer = tokenizer or load_tokenizer(str(source), trust_remote_code=trust_remote_code)
        return _export_gguf(
            loaded, tokenizer, scaling, name, decision, out, length, dim, base, dtype, tokenizer_pre, notes
        )
    return _export_folder(loaded, tokenizer, source, name, decision, to, out, length, notes, _dtype(cfg, loaded))


def _export_gguf(model, tokenizer, scaling, name, decision, out, length, dim, base, dtype, tokenizer_pre, notes):
    if tokenizer is None:
        raise RopeExtendError("a GGUF file carries the tokenizer: pass tokenizer= with the model")
    form = decision.form
    plain = rope_frequencies(dim, base)
    scaled = scaling.compute(dim, base, length)[0] if scaling is not None and form.kind != DEFAULT else plain
    keys, tensors, how = llamacpp.rope_metadata(form, plain, scaled)
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


def _export_folder(model, tokenizer, source, name, decision, to, out, length, notes, dtype):
    form = decision.form
    updates = configs.config_updates(form, length, to)
    how = json.dumps(updates.get("rope_parameters", updates.get("rope_scaling")) or {"rope_theta": form.base})
    command = configs.serve_command(to, str(out), form, length, dtype)
    longer = configs.longer_note(to, form, length)
    if longer:  # before the info file is written, so that it carries the note too
        notes.append(longer)
    with writing(out) as tmp:
        if source is not None:
            shutil.copytree(source, tmp, ignore=shutil.ignore_patterns(MARKER, INFO, ".*"))
        else:
            model.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        _rewrite_config(tmp, updates, to)
        info = {"tool": f"rope-extend {__version__}", "engine": ENGINES[to], "method": name, "how": how}
        write_json(tmp / INFO, {**info, "command": command, "notes": notes})
        normal_permissions(tmp)  # a copy of a cached folder would keep the cache's 0600 files
    flag = configs.OVERRIDE_FLAG.get(to)
    return ExportResult(out, to, ENGINES[to], name, how, command, notes, updates if flag else None, flag)
