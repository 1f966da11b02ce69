"""``export``: resolve the scaling, ask ``routes`` whether the engine serves it, write the file or folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import locking
from ..errors import RopeExtendError, UnsupportedModelError
from ..hf.config import scaling_for
from ..hf.reading import config_scaling, nested_layer_types, rotary_geometry, text_config
from ..io import check_writable, remove_abandoned
from ..loading import check_weights, load_config, resolve_name
from ..patching import patched
from .routes import decide
from .targets import TARGETS
from .targets.base import APPROXIMATE, INFO, REFUSED, Decision, ExportJob, ExportOptions, ExportResult

__all__ = ["INFO", "ExportResult", "export"]


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
        return scaling_for(config, method, **amounts, **params)
    if any(v is not None for v in amounts.values()) or params:
        raise RopeExtendError("a factor, target length or parameter was given without a method: name the method")
    return config_scaling(config, layer)


def _read_config(source: Path, trust_remote_code: bool):
    if not (source / "config.json").is_file():
        raise RopeExtendError(f"{source} is not a saved model folder (no config.json)")
    return load_config(source, trust_remote_code=trust_remote_code)


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


def _check_out(out: Path) -> None:
    """``--out`` must be a new path that can be written (``io.check_writable``: a link is refused as one) and
    that no other export is writing (``locking.probe_beside``)."""
    if out.exists() and not out.is_symlink():
        raise RopeExtendError(f"--out {out} exists: nothing there is touched; give a new path")
    check_writable(out)
    locking.probe_beside(out)


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
    ``dtype`` (f32, f16, bf16, q8_0) and ``tokenizer_pre`` (llama.cpp's pre-tokenizer name, when rope-extend does not
    know the tokenizer). ``dynamic_yarn`` to ``vllm`` is served per request by rope-extend's vLLM plugin, with
    YaRN at the smallest of ``buckets`` (factors, default powers of two up to the factor) that covers the prompt
    plus ``max_tokens`` (``adaptive``); with ``approximate`` it is made static instead. Returns an
    ``ExportResult`` whose ``command`` serves the export at the target length.

    Args:
        model: a loaded model, or a saved folder or a name rope-extend knows.
        to: the export target's name (``gguf``, ``vllm``, ``sglang``, ``transformers4``, or a registered one).
        out: the file or folder to write; it must not exist.
        method: the scaling to export, for a model not patched with it.
        factor: with ``method``: ``s = target / L``.
        target_length: with ``method``: the context to reach, instead of ``factor``.
        original_max_position_embeddings: ``L`` when the config's is not the pretraining length.
        tokenizer: the tokenizer (``gguf`` needs it).
        approximate: export a method the engine serves only approximately (it is refused otherwise).
        dtype: ``gguf`` weights: f32, f16, bf16 or q8_0.
        tokenizer_pre: ``gguf``: llama.cpp's pre-tokenizer name.
        trust_remote_code: passed on when the model is read from a folder or name.
        buckets: ``dynamic_yarn`` to ``vllm``: the factors a request can get.
        **params: the method's own parameters.

    Returns:
        An ``ExportResult``: where the export went, the command that serves it, and what changed.

    Raises:
        RopeExtendError: a bad argument, an unknown target, or a method the engine cannot serve (the message names
            the nearest that exports); an ``out`` that exists, cannot be written or is a link, or that another
            export is writing (``locking.beside``: the message names it).
    """
    target = TARGETS.get(to)
    opts = ExportOptions(
        approximate=approximate,
        dtype=dtype,
        tokenizer_pre=tokenizer_pre,
        trust_remote_code=trust_remote_code,
        buckets=buckets,
    )
    out = Path(out)
    _check_out(out)
    target.check(opts)  # before anything is read
    read = _read(model, target, trust_remote_code)
    amounts = {
        "factor": factor,
        "target_length": target_length,
        "original_max_position_embeddings": original_max_position_embeddings,
    }
    scaling = _scaling(read.loaded, read.text, method, amounts, params, read.layer)
    decision = _decide(scaling, to, read, opts)
    return _write(target, _job(read, scaling, decision, out, tokenizer, opts))


@dataclass(frozen=True)
class _Read:
    """What ``export`` reads of the model before it decides: where it came from and its rotary geometry."""

    source: Path | None  # the folder, when ``model`` was one (or a name rope-extend knows)
    config: Any  # the model's config
    text: Any  # its text config (``hf.config.text_config``)
    loaded: Any  # the loaded model, or None for a folder
    layer: str | None  # the layer type whose rope the target exports (``ExportTarget.rope_layer``)
    dim: int
    base: float


def _read(model, target, trust_remote_code: bool) -> _Read:
    """The config (and the model, when loaded) ``export`` was given, with the rotary geometry the target exports."""
    source = None
    if isinstance(model, (str, Path)):
        source = Path(resolve_name(str(model)))
        config, loaded = _read_config(source, trust_remote_code), None
        check_weights(source)  # a folder target copies the weights unread: a truncated file would be served
    else:
        config, loaded = model.config, model
    cfg = text_config(config)
    layer = target.rope_layer(cfg)
    dim, base = _geometry(cfg, layer)
    return _Read(source, config, cfg, loaded, layer, dim, base)


def _decide(scaling, to: str, read: _Read, opts: ExportOptions) -> Decision:
    """How ``to`` serves ``scaling`` (``routes.decide``), refused unless it serves it exactly or, with
    ``approximate``, approximately; ``buckets`` only where the engine serves the method per request."""
    name = scaling.method.name if scaling is not None else "none"
    decision: Decision = decide(scaling, to, read.dim, read.base)
    if decision.status == REFUSED or (decision.status == APPROXIMATE and not opts.approximate):
        raise RopeExtendError(decision.message(name, to))
    if opts.buckets is not None and not (decision.adaptive and not opts.approximate):
        raise RopeExtendError("buckets goes with dynamic_yarn exported to vllm (without --approximate)")
    if decision.adaptive and opts.approximate:  # the static fallback: YaRN at the target for every request
        decision = Decision(APPROXIMATE, decision.served, decision.served.changes)
    return decision


def _job(read: _Read, scaling, decision: Decision, out: Path, tokenizer, opts: ExportOptions) -> ExportJob:
    """Everything the target's ``write`` needs."""
    return ExportJob(
        out=out,
        model=read.loaded,
        tokenizer=tokenizer,
        source=read.source,
        config=read.config,
        text=read.text,
        scaling=scaling,
        method=scaling.method.name if scaling is not None else "none",
        decision=decision,
        length=scaling.target_length if scaling is not None else int(read.text.max_position_embeddings),
        dim=read.dim,
        base=read.base,
        notes=[decision.reason] if decision.status == APPROXIMATE else [],
        options=opts,
    )


def _write(target, job: ExportJob) -> ExportResult:
    """``target.write(job)``, holding the lock on ``job.out``."""
    with locking.beside(job.out):  # one export per path: a second one would silently replace the first
        _check_out(job.out)  # again, holding the lock: an export that ended meanwhile has made it
        remove_abandoned(job.out)  # what an export into the same path that was killed left behind
        return target.write(job)
