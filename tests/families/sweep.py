"""One family of the sweep, built once for all of its cells: ``open_family`` builds the tiny model, saves and
reloads it, and records its unpatched logits; ``run(family, method)`` is one cell (``snapshot`` says how cells are
spelled). Every cell leaves the models unpatched and bit-identical, so the next cell starts from the same model;
``test_families.py`` and ``table.py`` both run the sweep through here.

A family that cannot be built or run before rope-extend touches it gets a ``not buildable`` status instead of
models: ``explicit`` when ``tiny.build`` raised ``Unbuildable`` (a reason known in advance), else the exception
that the sweep turns into a failure unless the snapshot records exactly that status.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.families import snapshot
from tests.families.test_attention_families import METHODS as ATTENTION
from tests.families.test_attention_families import _logits as attention_logits
from tests.families.test_attention_families import attention_cell, inputs
from tests.families.test_frequency_families import METHODS as FREQUENCY
from tests.families.test_frequency_families import _logits as frequency_logits
from tests.families.test_frequency_families import frequency_cell
from tests.families.tiny import Unbuildable, build

METHODS = (*FREQUENCY, *ATTENTION)


@contextlib.contextmanager
def one_thread():
    """torch on one intra-op thread while the sweep runs: the tiny models' matmuls are too small to split. On 2
    cores shared with other jobs, two threads took 4-9x as long as one on the same families (llama, gemma3_text,
    qwen3_moe: 24-41 s against 3-7 s each) and spent 6-10x the CPU time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class Family:
    """``model``: reloaded from ``path`` (the frequency cells; ``ref``: its logits, ``reproducible``: whether the
    reload gives the built model's); ``built``: as ``tiny.build`` made it (the attention cells; ``attention_ref``:
    its logits on the attention inputs). ``status``: a ``not buildable`` cell for every method, or for the
    attention methods only (``attention_status``: the unpatched ``N``-token forward fails)."""

    name: str
    path: Path | None = None
    model: torch.nn.Module | None = None
    built: torch.nn.Module | None = None
    ref: torch.Tensor | None = None
    reproducible: bool = False
    attention_ref: torch.Tensor | None = None
    status: str | None = None
    attention_status: str | None = None
    explicit: bool = False

    def close(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)  # a family's weights can be large (Gemma 4's per-layer)
        self.model = self.built = None


def open_family(name: str, path: Path) -> Family:
    """Build, run, save and reload ``name`` once. Only building and the unpatched forwards are caught (as a
    status); saving and reloading must work for every family that builds."""
    warnings.filterwarnings("ignore")
    try:
        built = build(name)
        frequency_logits(built, name)
    except Unbuildable as exc:
        return Family(name, status=snapshot.unbuilt(exc, explicit=True), explicit=True)
    except Exception as exc:  # noqa: BLE001 - a status the sweep fails on unless the snapshot records it
        return Family(name, status=snapshot.unbuilt(exc, explicit=False))
    family = Family(name, path=path, built=built)
    built.save_pretrained(path)
    # with the built model's own config class: transformers 5.24 saves some families (EXAONE 3) under their
    # checkpoints' weight names and maps them back only for that config class, not for the class's default one
    family.model = type(built).from_pretrained(path, config=type(built.config).from_pretrained(path)).eval()
    family.ref = frequency_logits(family.model, name)
    family.reproducible = torch.equal(frequency_logits(built, name), family.ref)
    try:  # the attention cells' forward: token ids alone, longer (transformers 5.24's Llama 4 text-only fails)
        family.attention_ref = attention_logits(built, inputs())
    except Exception as exc:  # noqa: BLE001 - as above, for the attention cells only
        family.attention_status = snapshot.unbuilt(exc, explicit=False)
    return family


def run(family: Family, method: str) -> str:
    """The cell ``(family, method)``; an AssertionError (or any other exception) where the cell is neither exact
    nor refused cleanly."""
    if family.status is not None:
        return family.status
    if method in FREQUENCY:
        return frequency_cell(family, method)
    return family.attention_status or attention_cell(family, method)
