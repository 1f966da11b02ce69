"""The folder targets (vLLM, SGLang, transformers 4): the model folder as it is, with the rope settings of its
``config.json`` written the way the engine reads them. ``FolderTarget`` holds what they share; each engine's
module (``targets/``) says where it differs, and cites the engine's source for it.

- The rope dict is transformers': ``rope_type``, ``factor``, ``original_max_position_embeddings``, YaRN's
  ``beta_fast`` / ``beta_slow`` / ``truncate`` / ``attention_factor``, Llama 3's frequency factors, LongRoPE's
  short and long factors.
- **dtype**: vLLM (``config/model.py``, ``_resolve_auto_dtype``, line 2423) and SGLang (``model_config.py``,
  ``_get_and_verify_dtype``) load a float32 model in 16 bits unless ``--dtype`` says otherwise, which moves
  every log-prob (yarn x4 on SmolLM2 at 6144 tokens: perplexity 27.512 against 27.487 in vLLM 0.32, greedy
  tokens parting at the 6th): the command names the model's dtype.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ..errors import RopeExtendError, UnsupportedModelError
from ..io import MARKER, copy_folder, normal_permissions, write_json, writing
from ..methods.engine_form import DEFAULT, LINEAR, LLAMA3, LONGROPE, YARN, Form
from ..untrusted import read_object
from ..version import __version__
from .forms import DYNAMIC, yarn_attn_factor
from .targets import TARGETS
from .targets.base import INFO, ExportJob, ExportResult, ExportTarget


class FolderTarget(ExportTarget):
    """An engine that serves a transformers-format folder: the weights copied, ``config.json`` rewritten."""

    writes = "a model folder: the weights as they are, config.json with the scaling in the engine's keys"
    override_flag: str | None = None  # the flag that takes the config keys as JSON, to serve the original folder
    linear_multiplies = False  # the engine serves max_position_embeddings x factor for linear (vLLM, SGLang)
    longrope_mscale = False  # LongRoPE's scale as short_mscale / long_mscale (vLLM, SGLang), else attention_factor
    dropped: tuple[str, ...] = ()  # config keys the engine must not see

    def rope_dict(self, form: Form) -> dict[str, Any]:
        """The ``rope_parameters`` / ``rope_scaling`` dict of ``form``, without ``rope_theta`` (where it goes
        differs)."""
        if form.kind == DEFAULT:
            return {"rope_type": "default"}
        out: dict[str, Any] = {"rope_type": form.kind, "factor": float(form.factor)}
        if form.kind in (LINEAR, DYNAMIC):
            return out
        out["original_max_position_embeddings"] = int(form.original_length)
        if form.kind == YARN:
            out["beta_fast"], out["beta_slow"] = form.values["beta_fast"], form.values["beta_slow"]
            if not form.values["truncate"]:
                out["truncate"] = False
            if yarn_attn_factor(form) != 1.0:  # not YaRN's own temperature
                out["attention_factor"] = float(form.attention_scale)
        elif form.kind == LLAMA3:
            out.update(form.values)
        elif form.kind == LONGROPE:
            out.update({k: list(v) for k, v in form.values.items()})
            if self.longrope_mscale:
                out["short_mscale"] = out["long_mscale"] = float(form.attention_scale)
            else:
                out["attention_factor"] = float(form.attention_scale)
        return out

    def max_positions(self, form: Form, target_length: int) -> int:
        """``max_position_embeddings`` to write: an engine that multiplies it by ``factor`` gets ``L``, so that
        its longest length is the target, not ``s`` times it."""
        if (self.linear_multiplies and form.kind == LINEAR) or form.kind == DYNAMIC:
            return int(form.original_length)
        return int(target_length)

    def config_updates(self, form: Form, target_length: int) -> dict[str, Any]:
        """The top-level config keys to set (the rest of the config is the model's own): transformers 5's
        ``rope_parameters`` with ``rope_theta`` inside."""
        return {
            "max_position_embeddings": self.max_positions(form, target_length),
            "rope_parameters": {**self.rope_dict(form), "rope_theta": float(form.base)},
        }

    def serve_command(self, model: str, form: Form | None, target_length: int, dtype: str | None) -> str:
        """The command that serves the folder at ``target_length`` tokens in ``dtype`` ("" for a library)."""
        return ""

    def longer_note(self, form: Form, target_length: int) -> str | None:
        """What serving past ``target_length`` tokens gives (None for a target without a command)."""
        return None

    def write(self, job: ExportJob) -> ExportResult:
        form = job.decision.served
        updates = self.config_updates(form, job.length)
        rope = updates.get("rope_parameters", updates.get("rope_scaling"))
        how = json.dumps(rope or {"rope_theta": form.base})
        command = self.serve_command(str(job.out), form, job.length, model_dtype(job))
        longer = self.longer_note(form, job.length)
        if longer:  # before the info file is written, so that it carries the note too
            job.notes.append(longer)
        self.write_folder(job, updates, method=job.method, how=how, command=command, notes=job.notes)
        return self.result(job, how=how, command=command, overrides=updates if self.override_flag else None)

    def result(
        self, job: ExportJob, *, how: str, command: str, overrides=None, method: str | None = None, engine: str = ""
    ):
        """The ``ExportResult`` of ``job`` written by this target (``engine``: another engine than the target's
        own, as the vLLM plugin's release)."""
        return ExportResult(
            out=job.out,
            target=self.name,
            engine=engine or self.engine,
            method=method or job.method,
            how=how,
            command=command,
            notes=job.notes,
            overrides=overrides,
            override_flag=self.override_flag if overrides else None,
        )

    def write_folder(
        self,
        job: ExportJob,
        updates: dict[str, Any],
        *,
        method: str,
        how: str,
        command: str,
        notes: list[str],
        engine: str = "",
    ) -> None:
        """The model (copied, or saved from memory) with ``updates`` in its config and the info file beside it
        (``engine``: as in ``result``)."""
        with writing(job.out) as tmp:
            if job.source is not None:
                copy_folder(job.source, tmp, ignore=shutil.ignore_patterns(MARKER, INFO, ".*"))
            else:
                job.model.save_pretrained(tmp)
                if job.tokenizer is not None:
                    job.tokenizer.save_pretrained(tmp)
            self._rewrite_config(tmp, updates)
            info = {"tool": f"rope-extend {__version__}", "engine": engine or self.engine, "method": method, "how": how}
            write_json(tmp / INFO, {**info, "command": command, "notes": notes})
            normal_permissions(tmp)  # a copy of a cached folder would keep the cache's 0600 files

    def _rewrite_config(self, folder: Path, updates: dict[str, Any]) -> None:
        """``folder``'s ``config.json`` with the engine's keys: ``folder`` is the export's own temporary, just
        filled, so the file is read as one rope-extend made (``untrusted``, no link followed: a link there was put
        by someone else, and writing through it would replace another file) and written back by a rename."""
        path = folder / "config.json"
        data = read_object(path, follow_links=False, fix="the export's copy of the model folder was changed")
        if "text_config" in data:
            raise UnsupportedModelError("composite configs (a text_config inside) are not exported yet")
        for key in ("rope_scaling", "rope_parameters", "rope_theta", *self.dropped):
            data.pop(key, None)
        data.update({k: v for k, v in updates.items() if v is not None})
        write_json(path, data)  # a new file renamed over the name: a link planted since is replaced, not followed


def model_dtype(job: ExportJob) -> str | None:
    """The dtype the served model should compute in: a loaded model's own, else the folder's config's (what
    transformers loads it in); ``float32``, ``bfloat16`` or ``float16``, None when the config does not say."""
    dtype = next(job.model.parameters()).dtype if job.model is not None else getattr(job.text, "dtype", None)
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    return name if name in ("float32", "bfloat16", "float16") else None


def config_updates(form: Form, target_length: int, target: str) -> dict[str, Any]:
    """The top-level config keys ``target`` (a folder target) reads ``form`` from; refused for a target that
    writes no config (``gguf``)."""
    found = TARGETS.get(target)
    if not isinstance(found, FolderTarget):
        raise RopeExtendError(f"export target {target!r} writes {found.writes}, not a config: it has no config keys")
    return found.config_updates(form, target_length)
