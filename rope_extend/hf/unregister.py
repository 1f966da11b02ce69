"""Unregistering a method takes its rope types out of transformers again: the undo of what ``hf.register``
installs for each method (``ROPE_INIT_FUNCTIONS[t]`` and the config validator
``RotaryEmbeddingConfigMixin._validate_<t>_rope_parameters``, for ``t`` its own rope type and
``proportional_<t>``), run by the methods registry's ``on_unregister``.

Without it an unregistered method's rope type kept building models after ``get`` had stopped knowing it: a config
naming it validated, and building the model then failed inside rope-extend's init function with an
``AttributeError`` on ``None``. After it, such a config is as unknown to transformers as any unknown rope type
(its own ``KeyError``). Only entries rope-extend
installed are removed (identity with the functions ``hf.register`` installs): a method whose rope type is
transformers' own (``linear``, ``yarn``) leaves transformers' entry where it is.
"""

from __future__ import annotations

from collections.abc import Callable

from ..methods import registry
from ..methods._common import Method
from .config import PROPORTIONAL, layout_rope_type

_listening = False


def listen(init_function: Callable, validator: Callable) -> None:
    """Remove a method's rope types from transformers whenever it is unregistered from now on; ``init_function``
    and ``validator`` are what ``hf.register`` installs (the only entries removed). Idempotent."""
    global _listening
    if _listening:
        return

    def remove(method: Method) -> None:
        from transformers import modeling_rope_utils as mru

        mixin = mru.RotaryEmbeddingConfigMixin
        for rope_type in (method.rope_type, layout_rope_type(PROPORTIONAL, method.rope_type)):
            if mru.ROPE_INIT_FUNCTIONS.get(rope_type) is init_function:
                del mru.ROPE_INIT_FUNCTIONS[rope_type]
            name = f"_validate_{rope_type}_rope_parameters"
            if vars(mixin).get(name) is validator:
                delattr(mixin, name)

    registry.on_unregister(remove)
    _listening = True
