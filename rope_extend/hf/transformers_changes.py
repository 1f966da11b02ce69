"""Every change ``import rope_extend`` makes to transformers, in one module: ``install`` and ``uninstall``.

``import rope_extend`` calls ``install`` once. transformers' model code takes seconds to import, which
``import rope_extend`` (the command line's ``--help``, a script that only builds a recipe) should not pay, so
when ``transformers.modeling_rope_utils`` is not imported yet ``install`` puts a finder at the front of
``sys.meta_path`` (``deferred.ReadyFinder``) that makes the changes as soon as it is, and removes itself. The changes,
and nothing else:

- ``modeling_rope_utils.ROPE_INIT_FUNCTIONS`` gains the rope types transformers lacks (``ntk``, ``dynamic_ntk``,
  ``ntk_by_parts``, ``dynamic_yarn``) and ``proportional_<type>`` for every method, and
  ``RotaryEmbeddingConfigMixin`` a validator per such type (``hf.register``); an entry transformers already has
  under one of those names is never replaced (that raises). A method registered later gets its types too, and
  one unregistered loses them (listeners on the methods registry: a config naming an unregistered type is then as unknown to transformers
  as any unknown rope type, its own ``KeyError``);
- the config classes of the ``longrope_only`` families (``hf.families``: Phi-3, Phi-4-multimodal) accept the
  types rope-extend writes (``families.longrope_only.opened``);
- ``RotaryEmbeddingConfigMixin._check_received_keys`` ignores the keys rope-extend adds to transformers' own rope
  types (``logn``);
- ``AttentionInterface`` and ``AttentionMaskInterface`` gain the names of rope-extend's attention
  (``hf.attention.registration``);
- ``PreTrainedModel.post_init`` is wrapped so that a model built from a config naming a rope-extend type or an
  attention method gets rope-extend's runtime (``hf.register.attach_from_config``);
- for the length of a sequence-parallel run only (``hf.ulysses``), one entry of transformers'
  ``ALL_ATTENTION_FUNCTIONS``: ``attention_function(name, fn)`` sets it and returns its undo.

Each change records what was there (an attribute of the class itself, or a dict entry, or nothing), and
``uninstall`` puts it back, in reverse order: after it transformers holds exactly the objects it held before
``install``. Both are idempotent. Standard library only at import: importing this module imports no torch.
"""

from __future__ import annotations

from typing import Any

from .. import deferred

_MISSING = object()
# (owner, key, what was there or _MISSING), in the order the changes were made: owner a class (an attribute of
# the class itself) or a dict (an entry)
_undo: list[tuple[Any, str, Any]] = []
_state: dict[str, Any] = {"installed": False, "finder": None}
# name -> what ALL_ATTENTION_FUNCTIONS' own (local) mapping held before ``attention_function`` set it
_scoped: dict[str, Any] = {}


def installed() -> bool:
    """Whether the changes are in transformers now."""
    return _state["installed"]


def install() -> None:
    """Make every change now when ``transformers.modeling_rope_utils`` is imported, else as soon as it is.
    Idempotent."""
    finder = _state["finder"]
    if _state["installed"] or (finder is not None and not finder.done):
        return
    _state["finder"] = deferred.when_transformers_ready(_apply)


def uninstall() -> None:
    """Undo every change (and disarm the finder of a deferred ``install``). Idempotent."""
    finder = _state["finder"]
    if finder is not None:
        finder.disarm()
        _state["finder"] = None
    for name in list(_scoped):
        _restore_attention_function(name)
    if not _state["installed"]:
        return
    from ..methods import registry

    registry.METHODS.remove_listener(_install_rope_types)
    registry.METHODS.remove_listener(_remove_rope_types)
    while _undo:
        _put_back(*_undo.pop())
    _state["installed"] = False


def _put_back(owner: Any, key: str, old: Any) -> None:
    """Make ``owner``'s ``key`` (a dict entry, or an attribute of the class itself) ``old`` again, or remove it
    when ``old`` is ``_MISSING`` (nothing was there)."""
    if isinstance(owner, dict):
        if old is _MISSING:
            owner.pop(key, None)
        else:
            owner[key] = old
    elif old is not _MISSING:
        setattr(owner, key, old)
    elif key in vars(owner):
        delattr(owner, key)


def _set(owner: Any, key: str, value: Any) -> None:
    """``owner[key] = value`` (a dict) or ``setattr(owner, key, value)`` (a class), recording what was there."""
    if isinstance(owner, dict):
        _undo.append((owner, key, owner.get(key, _MISSING)))
        owner[key] = value
    else:
        _undo.append((owner, key, vars(owner).get(key, _MISSING)))
        setattr(owner, key, value)


def _apply() -> None:
    if _state["installed"]:
        return
    _state["installed"] = True  # uninstall undoes what was made if a change below raises
    try:
        _change_transformers()
    except Exception:
        uninstall()
        raise


def _change_transformers() -> None:
    from transformers import modeling_rope_utils as mru
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface, PreTrainedModel
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ..methods import registry
    from . import families, register
    from .attention.registration import entries

    for method in map(registry.get, registry.names()):
        _install_rope_types(method)
    registry.METHODS.on_register(_install_rope_types)  # a method registered later reaches transformers too
    registry.METHODS.on_unregister(_remove_rope_types)  # and one unregistered leaves it
    for model_type in families.model_types_for("longrope_only"):
        if model_type in CONFIG_MAPPING and families.ask("longrope_only", CONFIG_MAPPING[model_type]):
            cls = CONFIG_MAPPING[model_type]
            for key, value in families.longrope_only.opened(cls).items():
                _set(cls, key, value)
    mixin = mru.RotaryEmbeddingConfigMixin
    if not hasattr(mixin._check_received_keys, "__wrapped__"):
        _set(mixin, "_check_received_keys", register.ignoring_extra_keys(mixin._check_received_keys))
    for name, forward, mask in entries():
        _set(AttentionInterface._global_mapping, name, forward)
        _set(AttentionMaskInterface._global_mapping, name, mask)
    _set(PreTrainedModel, "post_init", register.wrapped_post_init(PreTrainedModel.post_init))


def _install_rope_types(method) -> None:
    """Put ``method``'s rope types (its own, unless transformers has it, and its proportional variant) into
    ``ROPE_INIT_FUNCTIONS`` with a validator; a name transformers already uses for something else raises."""
    from transformers import modeling_rope_utils as mru

    from ..errors import RopeExtendError
    from . import register
    from .rope_types import PROPORTIONAL, layout_rope_type

    types = [] if method.in_transformers else [method.rope_type]
    types.append(layout_rope_type(PROPORTIONAL, method.rope_type))
    for rope_type in types:
        existing = mru.ROPE_INIT_FUNCTIONS.get(rope_type)
        if existing is not None and existing is not register.init_function:
            raise RopeExtendError(
                f"transformers already defines rope_type {rope_type!r}; rope-extend will not replace it"
            )
    for rope_type in types:
        _set(mru.ROPE_INIT_FUNCTIONS, rope_type, register.init_function)
        _set(mru.RotaryEmbeddingConfigMixin, f"_validate_{rope_type}_rope_parameters", register.validator)


def _remove_rope_types(method) -> None:
    """Take an unregistered ``method``'s rope types out of transformers again: only the entries ``hf.register``
    installed (a method whose rope type is transformers' own, ``linear`` or ``yarn``, leaves transformers' entry)."""
    from transformers import modeling_rope_utils as mru

    from . import register
    from .rope_types import PROPORTIONAL, layout_rope_type

    mixin = mru.RotaryEmbeddingConfigMixin
    for rope_type in (method.rope_type, layout_rope_type(PROPORTIONAL, method.rope_type)):
        if mru.ROPE_INIT_FUNCTIONS.get(rope_type) is register.init_function:
            del mru.ROPE_INIT_FUNCTIONS[rope_type]
        name = f"_validate_{rope_type}_rope_parameters"
        if vars(mixin).get(name) is register.validator:
            delattr(mixin, name)


def attention_function(name: str, fn: Any):
    """Put ``fn`` under ``name`` in transformers' ``ALL_ATTENTION_FUNCTIONS`` (the instance every model reads
    through ``get_interface``; its own mapping, which wins over the class-wide one) and return the undo, which
    puts back exactly what was there. One change per name at a time: a second one before the undo raises (two
    wrappers would stack: a sequence-parallel all-to-all run twice)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in _scoped:
        raise RuntimeError(f"ALL_ATTENTION_FUNCTIONS[{name!r}] is already replaced; undo that change first")
    _scoped[name] = ALL_ATTENTION_FUNCTIONS._local_mapping.get(name, _MISSING)
    ALL_ATTENTION_FUNCTIONS._local_mapping[name] = fn
    return lambda: _restore_attention_function(name)


def _restore_attention_function(name: str) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in _scoped:
        _put_back(ALL_ATTENTION_FUNCTIONS._local_mapping, name, _scoped.pop(name))
