"""rope-extend's attention in transformers' registries: the names it is known by, and what is registered
(``entries``; ``hf.transformers_changes`` registers them).

transformers picks a model's attention function by ``config._attn_implementation`` in ``AttentionInterface``,
and the mask it builds for it by the same name in ``AttentionMaskInterface``. A patched model's config carries
``NAME`` over eager and SDPA (whose mask both read) and ``NAME_<inner>`` over the others, so that transformers
still builds the mask the model's own implementation expects (a padding mask for FlashAttention, a ``BlockMask``
for FlexAttention) and still sees ``flash`` in the name, which it reads to prepare FlashAttention's inputs.
"""

from __future__ import annotations

from typing import Any

from .forward import attention_forward
from .state import INNER, NAME


def registered_name(inner: str) -> str:
    """The name the config carries while patched, for a model whose layers used ``inner``: ``NAME`` over eager
    and sdpa (the SDPA mask), ``NAME_<inner>`` over the others, so that the mask transformers builds is the one
    ``inner`` expects (and ``flash`` stays in the name, which transformers reads to prepare flash inputs)."""
    return NAME if inner in ("eager", "sdpa") else f"{NAME}_{inner}"


def is_registered_name(name: str | None) -> bool:
    """Whether ``name`` (a config's ``_attn_implementation``) is one of rope-extend's."""
    return name in {registered_name(inner) for inner in INNER}


def entries() -> list[tuple[str, Any, Any]]:
    """``(name, attention function, mask function)`` under ``registered_name`` of every implementation in
    ``INNER`` that this transformers has (its mask function is transformers' SDPA mask for ``NAME``): what
    ``hf.transformers_changes`` puts into ``AttentionInterface`` and ``AttentionMaskInterface``."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    masks = AttentionMaskInterface._global_mapping
    out = []
    for inner in INNER:
        name = registered_name(inner)
        mask = sdpa_mask if name == NAME else masks.get(inner)
        if mask is not None:  # an implementation this transformers does not have stays unregistered
            out.append((name, attention_forward, mask))
    return out
