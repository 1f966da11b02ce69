"""transformers 4 (4.45 onwards): a model folder whose ``config.json`` says the scaling as transformers 4 reads it.

- **transformers 4** (4.45 onwards): ``rope_scaling`` with ``rope_type`` (and the older ``type``) and a top-level
  ``rope_theta``; ``yarn`` reads ``attention_factor``, ``beta_fast``, ``beta_slow`` and
  ``original_max_position_embeddings`` (``truncate`` from 4.56 on).
- **LongRoPE in transformers 4** (read in 4.57.1, ``modeling_rope_utils.py``: ``_compute_longrope_parameters``
  lines 430-433 and ``dynamic_rope_update``'s ``longrope_frequency_update`` lines 46-50): ``L`` is the config's
  *top-level* ``original_max_position_embeddings`` (Phi-3's place), never ``rope_scaling``'s, and without it
  ``max_position_embeddings``: the target length, so the long factors would never be chosen and the default
  attention scale would be 1. So a longrope export writes ``L`` at the top level too (``factor`` there is then
  ``max_position_embeddings / L``, the export's own).
"""

from __future__ import annotations

from typing import Any

from ...hf.names import SHIPPED_ATTR
from ...methods.engine_form import DEFAULT, LONGROPE, Form
from ...methods.resolved import Scaling
from ..configs import FolderTarget
from ..forms import DYNAMIC
from .base import APPROXIMATE, Decision


class Transformers4Target(FolderTarget):
    name = "transformers4"
    engine = "transformers 4"
    dropped = (SHIPPED_ATTR,)

    def decide(self, scaling: Scaling | None, form: Form | None, base: float) -> Decision | None:
        if scaling is None or scaling.method.name != "dynamic":
            return None
        # transformers 4's own dynamic NTK (alpha from the length against max_position_embeddings, kept at L)
        return Decision(
            APPROXIMATE,
            Form(DYNAMIC, float(base), scaling.factor, scaling.original_max_position_embeddings),
            "transformers 4's dynamic recomputes the base at every length past L and never re-rotates cached "
            "keys; rope-extend's changes the base on a grid of lengths and re-rotates the cache (logits differ "
            "by about 1e-4 past L, the same below)",
        )

    def rope_dict(self, form: Form) -> dict[str, Any]:
        out = super().rope_dict(form)
        if form.kind == DEFAULT:
            return out
        head = {key: out.pop(key) for key in ("rope_type", "factor")}
        return {**head, "type": form.kind, **out}  # transformers before 4.45 read "type"

    def config_updates(self, form: Form, target_length: int) -> dict[str, Any]:
        """``rope_scaling`` (None for plain RoPE) and a top-level ``rope_theta``; for longrope ``L`` at the top
        level too (the module docstring)."""
        top = {"original_max_position_embeddings": int(form.original_length)} if form.kind == LONGROPE else {}
        return {
            "max_position_embeddings": self.max_positions(form, target_length),
            **top,
            "rope_theta": float(form.base),
            "rope_scaling": None if form.kind == DEFAULT else self.rope_dict(form),
        }


TARGET = Transformers4Target()
