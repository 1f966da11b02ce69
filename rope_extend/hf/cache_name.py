"""The KV cache's argument name, which transformers 5.24 changed from ``past_key_values`` to ``cache``.

transformers 5.24 renamed it everywhere at once: every decoder's ``forward``, ``generate``, the attention mask
functions and the model outputs (``out.cache``). The old name still works there, but ``forward`` and ``generate``
warn (a ``FutureWarning`` from ``deprecate_kwarg``) and ``out.past_key_values`` logs a deprecation. transformers
5.17 to 5.23 have only ``past_key_values``: their ``generate`` rejects ``cache=``, and their forwards take it into
``**kwargs`` and ignore it. rope-extend passes and reads caches only through this module, so its own code runs on
both without a warning; ``name()`` reads it from the model output class (a field named ``cache``), which answers
for any release, development builds included.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

OLD_NAME = "past_key_values"


@functools.cache
def name() -> str:
    """``"cache"`` on transformers >= 5.24, ``"past_key_values"`` before (asked on first use: importing
    transformers here, at import time, would run rope-extend's registration before this module exists)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else OLD_NAME


def cache_kwargs(cache) -> dict[str, Any]:
    """``{name(): cache}``: pass a cache to ``generate`` or a forward as this transformers names it,
    ``model.generate(ids, **cache_kwargs(cache))``."""
    return {name(): cache}


def passed(kwargs: dict):
    """The cache a forward (or ``generate``) was called with, under either name. A forward pre-hook sees the
    caller's name: 5.24's ``deprecate_kwarg`` renames ``past_key_values`` only inside the call."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get(OLD_NAME)


def ignored(kwargs: dict) -> bool:
    """A cache passed as ``cache=`` to a transformers that names it ``past_key_values``: its forwards take it
    into ``**kwargs`` and run without it, silently."""
    return kwargs.get("cache") is not None and kwargs.get(OLD_NAME) is None and name() != "cache"


def returned(output):
    """The cache a model output carries (``out.cache``, ``out.past_key_values`` before 5.24), or None."""
    return getattr(output, name(), None)
