"""A scaling written the way serving engines think of one: the engine-neutral ``Form`` each method declares.

Serving engines compute RoPE frequencies once, from a config, for the context they serve; they know a few rope
types (linear, YaRN, Llama 3, LongRoPE) and the base. A method that one of them computes gives its ``Method`` an
``engine_form(scaling, dim, base, at) -> Form | None``: the form that computes the same cos/sin for a rotary
dimension ``dim`` and base ``base`` (``changes`` says what differs where it cannot be the same), or None where
none does. ``at`` is the length the patched model computes a dynamic method's frequencies at for a sequence of the
target's length (the export passes it: the re-rotation grid is ``hf``'s), so that the served model is the patched
one at the target. A method without ``engine_form`` is one no engine knows; the attention methods keep plain
frequencies and need an attention kernel of the engine's own (``export.routes``).

Plain numbers in, plain numbers out; nothing here reads a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT, LINEAR, YARN, LLAMA3, LONGROPE = "default", "linear", "yarn", "llama3", "longrope"


@dataclass(frozen=True)
class Form:
    """A static scaling in the terms engines use.

    ``kind``: ``default`` (plain RoPE at ``base``), ``linear``, ``yarn``, ``llama3`` or ``longrope``.
    ``attention_scale`` is the factor on cos and sin (so every logit grows by its square), as transformers'
    ``attention_factor``. ``values`` holds the kind's own numbers: yarn ``beta_fast``, ``beta_slow``,
    ``truncate``; llama3 ``low_freq_factor``, ``high_freq_factor``; longrope ``short_factor``,
    ``long_factor``. ``changes`` says what differs from the rope-extend method (empty when exact).
    """

    kind: str
    base: float
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    attention_scale: float = 1.0
    values: dict[str, Any] = field(default_factory=dict)
    changes: str = ""

    @property
    def original_length(self) -> int:
        """``original_max_position_embeddings``, which every kind but ``default`` carries."""
        if self.original_max_position_embeddings is None:
            raise ValueError(f"a {self.kind} form without original_max_position_embeddings")
        return self.original_max_position_embeddings
