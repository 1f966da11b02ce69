"""The audit itself: read the path with its engine's model, compute the reference, compare layer by layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import RopeExtendError
from ...untrusted import head, read_json
from ..targets.mlx import ENGINE as MLX_ENGINE
from . import gguf_file, gguf_read, mlx, reference, vllm_sglang
from .rope import FACTOR_RTOL, FREQ_RTOL, SCALE_RTOL, Rope, close, differences

TARGETS = ("transformers", "gguf", "vllm", "sglang", "mlx")
LOCAL_TYPES = ("sliding_attention", "chunked_attention", "local_attention")
NOTE = "rope-extend-export.json"  # what an export wrote about itself: said in the report, never computed with
NOTE_BYTES = 1 << 16


@dataclass
class Group:
    """Layers that get the same rope in the engine and in the reference."""

    layers: list[int]
    layer_type: str | None
    engine: Rope
    reference: Rope | None
    differs: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {
            "layers": _span(self.layers),
            "layer_type": self.layer_type,
            "engine": self.engine.what,
            "reference": self.reference.what if self.reference else None,
            "scale": self.engine.scale,
            "frequencies": self.engine.freqs.size,
            "differs": self.differs,
        }


@dataclass
class Report:
    path: str
    engine: str
    length: int
    groups: list[Group]
    reference: str | None
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def mismatch(self) -> bool:
        return any(g.differs for g in self.groups)

    @property
    def exit_code(self) -> int:
        return 1 if self.mismatch else 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "engine": self.engine,
            "length": self.length,
            "reference": self.reference,
            "tolerance": {"frequencies": FREQ_RTOL, "scale": SCALE_RTOL},
            "result": "mismatch" if self.mismatch else ("equal" if self.reference else "unchecked"),
            "layers": [g.as_dict() for g in self.groups],
            "warnings": self.warnings,
            "notes": self.notes,
        }

    def text(self) -> str:
        lines = [f"{self.path}: {self.engine} at {self.length} tokens, against {self.reference or 'no reference'}"]
        for g in self.groups:
            where = f"layers {_span(g.layers)}" + (f" ({g.layer_type})" if g.layer_type else "")
            lines.append(f"  {where}: {g.engine.what}; {g.engine.freqs.size} frequencies, scale {g.engine.scale:.6g}")
            if g.reference is not None:
                lines += [f"    MISMATCH: {d}" for d in g.differs] or ["    equal to the reference"]
                if g.differs:
                    lines.append(f"    reference: {g.reference.what}; scale {g.reference.scale:.6g}")
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  note: {n}" for n in self.notes]
        verdict = "MISMATCH" if self.mismatch else ("equal" if self.reference else "no reference: nothing compared")
        lines.append(f"result: {verdict} (frequencies within {FREQ_RTOL:g}, scale within {SCALE_RTOL:g}, relative)")
        return "\n".join(lines)


def _span(layers: list[int]) -> str:
    runs, start = [], layers[0]
    for a, b in zip(layers, [*layers[1:], None], strict=True):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            if b is not None:  # None: past the last layer
                start = b
    return ", ".join(runs)


def kind_of(path: Path, engine: str | None) -> str:
    """``gguf``, ``vllm``, ``sglang`` or ``transformers`` for ``path`` (and ``--engine``)."""
    if engine is not None and engine not in ("vllm", "sglang", "mlx", "transformers"):
        raise RopeExtendError(f"unknown --engine {engine!r}; allowed: vllm, sglang, mlx, transformers")
    if path.is_file() and (path.suffix.lower() == ".gguf" or head(path, 4) == b"GGUF"):
        if engine not in (None,):
            raise RopeExtendError(f"{path} is a GGUF file (llama.cpp): --engine {engine} reads a model folder")
        return "gguf"
    if (path / "config.json").is_file() or (path.is_file() and path.suffix == ".json"):
        return engine or "transformers"
    if not path.exists():
        raise RopeExtendError(f"{path} does not exist: give a .gguf file, a model folder or a config.json")
    raise RopeExtendError(f"{path} is neither a GGUF file nor a model folder with a config.json")


def audit(
    path,
    *,
    reference_path=None,
    overrides: dict[str, Any] | None = None,
    engine: str | None = None,
    length: int | None = None,
) -> Report:
    """Audit ``path`` (a GGUF file, or a model folder read by ``engine``: transformers by default, ``vllm`` or
    ``sglang`` with ``overrides`` as their override JSON) against transformers on ``reference_path`` (a folder
    or config.json; by default the folder's own config for an engine folder, none for a GGUF file) at a served
    context of ``length`` tokens (by default the longest the file or config allows)."""
    path = Path(path)
    kind = kind_of(path, engine)
    if length is not None and length < 1:
        raise RopeExtendError(f"--length must be a positive number of tokens, got {length}")
    if overrides and kind in ("gguf", "mlx"):
        raise RopeExtendError(
            "--overrides is vLLM's or SGLang's override JSON for a model folder, not for a GGUF file or mlx-lm "
            "(which has no override flag)"
        )
    got, served, name, warnings = _engine_layers(kind, path, overrides, length)
    notes: list[str] = []
    if path.is_dir() and (path / NOTE).exists():
        note, warning = export_note(path / NOTE)
        notes += note
        warnings += warning
    ref_config, ref_name = None, None
    if reference_path is not None:
        ref_config, ref_name = reference.load(reference_path), f"transformers on {reference_path}"
    elif kind in ("vllm", "sglang", "mlx"):
        ref_config, ref_name = reference.load(path, overrides), "transformers on the same config"
    want = reference.layers(ref_config, served) if ref_config is not None else None
    if want is not None and len(want) != len(got):
        raise RopeExtendError(f"{path} has {len(got)} layers, the reference {len(want)}: not the same model")
    groups = _groups(got, want)
    return Report(str(path), name, served, groups, ref_name, warnings, notes)


def _engine_layers(kind: str, path: Path, overrides, length: int | None):
    """``(layers, served length, engine name, warnings)`` of ``path`` read by ``kind``."""
    if kind == "gguf":
        try:
            keys, tensors = gguf_read.read(path)
        except RopeExtendError as exc:
            raise RopeExtendError(f"{path} is not a readable GGUF file: {exc}") from None
        try:
            s = gguf_file.settings(keys)
            served = length or s.context or 4096
            return gguf_file.layers(s, tensors, served), served, gguf_file.ENGINE, gguf_warnings(s, tensors)
        except RopeExtendError as exc:
            raise RopeExtendError(f"{path}: {exc}") from None
    if kind == "mlx":  # mlx-lm reads the JSON itself, not through transformers (``mlx``): what it says comes first
        got, served, said = mlx.layers(path, length)
        return got, served, MLX_ENGINE, traps(reference.load(path)) + said
    config = reference.load(path, overrides)
    warnings = traps(config)
    if kind == "transformers":
        served = length or int(config.max_position_embeddings)
        return reference.layers(config, served), served, "transformers (this version)", warnings
    served = length or vllm_sglang.longest(config, kind)
    got, said = vllm_sglang.layers(config, kind, served)
    return got, served, vllm_sglang.ENGINES[kind], warnings + said  # said: what the engine does by design


def _groups(got, want) -> list[Group]:
    """Layers grouped by the rope they get on both sides, each group's differences and their likely cause."""
    groups: list[Group] = []
    for i, (layer_type, rope) in enumerate(got):
        ref = want[i][1] if want is not None else None
        differs = differences(rope, ref) if ref is not None else []
        last = groups[-1] if groups else None
        if last and last.engine is rope and last.reference is ref:
            last.layers.append(i)
        else:
            same = next((g for g in groups if g.engine is rope and g.reference is ref), None)
            if same is not None:
                same.layers.append(i)
            else:
                groups.append(Group([i], layer_type or (want[i][0] if want else None), rope, ref, differs))
    for g in groups:  # name the likely cause of a difference
        if g.differs and g.reference is not None:
            g.differs += causes(g)
    return groups


def causes(g: Group) -> list[str]:
    """A one-line guess at why the engine's rope differs, from the settings on both sides; a setting is named
    only where the two sides differ in it (none without a reference)."""
    if g.reference is None:
        return []
    e, r = g.engine.what, g.reference.what
    out = []
    local = g.layer_type in LOCAL_TYPES
    if local and "default" in r.split(",")[0] and g.engine.freqs.size == g.reference.freqs.size:
        out.append("a scaling on local (sliding-window) layers, which the reference keeps at plain RoPE")
    if "yarn" in r and "yarn" not in e and not local:
        out.append("the reference's YaRN is not there: dropped, or written as another type")
    if "truncate False" in r:
        out.append("the reference's YaRN has truncate=false (GPT-OSS): the engine floors and ceils the ramp")
    ours, theirs = g.engine.original, g.reference.original
    if ours is not None and theirs is not None and ours != theirs:
        out.append(
            f"the original length differs: {ours} in the engine, {theirs} in the reference "
            "(rope.scaling.original_context_length / original_max_position_embeddings)"
        )
    our_factor, their_factor = g.engine.factor, g.reference.factor
    if (
        not out
        and our_factor is not None
        and their_factor is not None
        and not close(our_factor, their_factor, FACTOR_RTOL)
    ):
        out.append(f"the factor differs: x{our_factor:g} in the engine, x{their_factor:g} in the reference")
    return [f"likely: {c}" for c in out]


def export_note(file: Path) -> tuple[list[str], list[str]]:
    """``(notes, warnings)`` from an export's note: what it says it made, or a warning that the note is damaged
    (it describes the export; the audit reads the rope from the files themselves, so a bad note stops nothing)."""
    fields = ("tool", "engine", "method", "how")
    try:
        made = read_json(
            file, limit=NOTE_BYTES, name=f"the export note {file}", fix="a note rope-extend writes is under 1 kB"
        )
        if not isinstance(made, dict):
            raise RopeExtendError(f"the export note {file} is {type(made).__name__}, not a JSON object")
        wrong = [k for k in fields if not isinstance(made.get(k, ""), str)]
        if wrong:
            raise RopeExtendError(f"the export note {file} has {', '.join(wrong)} that are not text")
    except RopeExtendError as exc:
        return [], [f"{exc}: not said here"]
    said = {k: made.get(k, "?")[:200] for k in fields}
    return [f"exported by {said['tool']} for {said['engine']}: {said['method']} ({said['how']})"], []


def _rope(config, layer_type):
    return reference.rope_params(config, layer_type)


def traps(config) -> list[str]:
    """What is suspicious in a transformers config, without a reference."""
    out = []
    kinds = sorted({k for k in reference.layer_types(config)}, key=str)
    for kind in kinds:
        params = _rope(config, kind)
        rope_type = params.get("rope_type", "default")
        where = f"{kind} layers" if kind else "the model"
        if kind in LOCAL_TYPES and rope_type != "default":
            out.append(
                f"{where} have {rope_type} x{params.get('factor')}: Gemma 3 and models like it keep their local layers "
                "at plain RoPE (a converter copying the global scaling to every layer type does this)"
            )
        if getattr(config, "model_type", "") == "gpt_oss" and rope_type == "yarn" and params.get("truncate", True):
            out.append(
                f"{where}: GPT-OSS's YaRN was trained with truncate=false; this config floors and ceils the ramp"
            )
        if rope_type == "longrope":
            original = params.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None
            )
            if original is None or original >= config.max_position_embeddings:
                out.append(
                    f"{where}: LongRoPE's original length {original} is not below max_position_embeddings "
                    f"{config.max_position_embeddings}: its long factors are never chosen"
                )
        if rope_type == "default":
            original = params.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None
            )
            if original and config.max_position_embeddings > original and kind not in LOCAL_TYPES:
                out.append(
                    f"{where}: max_position_embeddings {config.max_position_embeddings} > original length {original} "
                    "with no scaling: scaling dropped?"
                )
    return out


def gguf_warnings(s: gguf_file.Settings, tensors: dict) -> list[str]:
    """What is suspicious in a GGUF file's rope keys (checked: ``gguf_file.settings``), without a reference."""
    out = []
    kind, context, original = s.kind, s.context, s.original
    scaled = (kind in ("linear", "yarn") and s.freq_scale != 1.0) or "rope_freqs" in tensors or kind == "longrope"
    if original and context and context > original and not scaled:
        out.append(
            f"context_length {context} > rope.scaling.original_context_length {original} with no scaling: scaling "
            "dropped? (GGUFs converted under transformers 5 lost their YaRN keys this way)"
        )
    if kind in ("yarn", "longrope") and not original:
        out.append(
            f"rope.scaling.type {kind} without rope.scaling.original_context_length: llama.cpp takes context_length "
            f"{context} as the original length"
            + (" (the YaRN ramp is placed for it)" if kind == "yarn" else " (the long factors are never chosen)")
        )
    if s.arch == "gpt-oss" and kind == "yarn":
        out.append(
            "gpt-oss with YaRN: llama.cpp floors and ceils the ramp ends, GPT-OSS was trained with truncate=false "
            "(compare with --reference to see which frequencies differ)"
        )
    if kind == "longrope" and original and context and context > original:
        out.append(
            f"LongRoPE: started with more than {original} tokens of context, llama.cpp uses the long factors for "
            f"every sequence; transformers uses the short ones for sequences up to {original}"
        )
    return out
