"""transformers' ``generate`` and the length a patch reaches.

``generate`` warns once ("This is a friendly reminder - the current text generation call has exceeded the
model's predefined maximum length") when a sequence passes ``config.max_position_embeddings``; its
``MaxLengthCriteria`` only warns, it never stops. ``patch`` raises that length to its target, so a patched model
is quiet up to the target and warns past it. A method with no length limit (ReRoPE, Dual Chunk Attention:
every relative position stays below ``L``) patched without a factor keeps the target ``L`` yet reaches any
length; for it ``install`` makes that model's own stopping criteria carry no maximum, so the reminder, which
is then wrong, is not printed.

The Phi-3 families' ``generate`` (``families``' ``generate_swaps_cache``) drops the cache once the sequence passes
``original_max_position_embeddings`` (``L``) while the cache holds no more, so that the prefix is computed again
at the new length (for LongRoPE's long factors). transformers 5.24's Phi-3 and PhiMoE then feed the whole
sequence; transformers 5.17 (all three) and 5.24's Phi-4-multimodal feed only the tokens the cache had not seen
(one, in greedy decoding): the new cache holds those alone, and the token generated at the switch already parts
from uncached generation's, unpatched. For a model whose rotary is rope-extend's, ``install_recompute`` makes
the switch do what 5.24's Phi-3 does, whatever the installed version: where the family's
``prepare_inputs_for_generation`` dropped a cache that had seen tokens and kept only the unseen ones, it is asked
again with the whole sequence (``next_sequence_length=None``, which is what 5.24's Phi-3 sets itself). Cached
generation past ``L`` then equals uncached generation, for every method (``tests/test_generation.py``); where
even that feeds less than the whole sequence, the forward is refused, naming the version and the fix.

``remove`` (on unpatch) takes both changes off.
"""

from __future__ import annotations

import functools

from transformers.generation.stopping_criteria import MaxLengthCriteria

from ..errors import UnsupportedModelError
from . import cache_name, families
from .names import PREPARE_INPUTS, STOPPING_CRITERIA


def unbounded(scaling) -> bool:
    """Whether ``scaling`` reaches any length: a method without a length limit, not given a longer target."""
    return bool(getattr(scaling.params, "UNBOUNDED", False)) and scaling.factor == 1.0


def _stopping_criteria(model, *args, **kwargs):
    criteria = type(model)._get_stopping_criteria(model, *args, **kwargs)
    for criterion in criteria:
        if isinstance(criterion, MaxLengthCriteria):
            criterion.max_position_embeddings = None  # what it warns past; the length it stops at is kept
    return criteria


def install(model) -> bool:
    """Drop the max-length reminder from ``model``'s generations; False where it has no ``generate``."""
    if not callable(getattr(type(model), STOPPING_CRITERIA, None)):
        return False
    model.__dict__[STOPPING_CRITERIA] = functools.partial(_stopping_criteria, model)
    return True


def _partial(inputs: dict, ids, cache) -> bool:
    """Whether ``inputs`` (what ``prepare_inputs_for_generation`` made of ``ids`` and ``cache``) drop a cache that
    had seen tokens and feed fewer than all of ``ids``: the forward would compute the prefix from those alone."""
    if cache is None or ids is None or cache_name.passed(inputs) is not None:
        return False
    fed = inputs.get("input_ids")
    seen = cache.get_seq_length() if callable(getattr(cache, "get_seq_length", None)) else 0
    return fed is not None and seen > 0 and fed.shape[-1] < ids.shape[-1]


def _prepare_inputs(model, *args, **kwargs):
    """The model's own ``prepare_inputs_for_generation``; where it dropped the cache and kept only the unseen
    tokens, the same asked again for the whole sequence (see the module docstring)."""
    prepare = getattr(type(model), PREPARE_INPUTS)
    inputs = prepare(model, *args, **kwargs)
    ids, cache = args[0] if args else kwargs.get("input_ids"), cache_name.passed(kwargs)
    if not _partial(inputs, ids, cache):
        return inputs
    inputs = prepare(model, *args, **{**kwargs, "next_sequence_length": None})
    if _partial(inputs, ids, cache):
        import transformers

        kept = inputs.get("input_ids")  # _partial is true only where both hold ids
        fed, given = (kept.shape[-1] if kept is not None else 0), (ids.shape[-1] if ids is not None else 0)
        raise UnsupportedModelError(
            f"{type(model).__name__}.generate {families.ask('generate_swaps_cache', model.config)}, and with "
            f"transformers {transformers.__version__} computes it from the last {fed} of "
            f"the {given} tokens only, which would make every later token wrong: upgrade transformers "
            "(5.24 recomputes the whole prefix), or generate with use_cache=False"
        )
    return inputs


def install_recompute(model) -> bool:
    """Make ``model``'s ``generate`` recompute the whole prefix where its family drops the cache mid-sequence
    (see the module docstring); False where the family does not (or ``model`` has no ``generate``)."""
    if not callable(getattr(type(model), PREPARE_INPUTS, None)):
        return False
    if not families.ask("generate_swaps_cache", getattr(model, "config", None)):
        return False
    model.__dict__[PREPARE_INPUTS] = functools.partial(_prepare_inputs, model)
    return True


PROBE_LENGTH = 8  # the probe's L: where the family's switch comes does not change what it feeds there


def own_switch_is_partial(config) -> bool | None:
    """Whether a model of ``config``'s family, run by transformers alone (a configured folder loaded without
    ``import rope_extend``), computes the prefix again at the switch from the unseen tokens only: the defect
    ``install_recompute`` mends, told as ``_prepare_inputs`` tells it (``_partial``), by the family's own
    ``prepare_inputs_for_generation`` given ``L + 1`` ids and a cache that has seen ``L``. Asked of the
    installed transformers, not of a version number: 5.17 feeds the last token for all three families, 5.24 for
    Phi-4-multimodal only. The model is built on the meta device from a copy of ``config`` with one layer and
    ``L = 8`` (no weights: 0.01 to 0.1 s), which configure writes for every method whether the model shipped
    one or not; False for a family that keeps its cache, None where the model cannot be built so (a remote-code
    config: rope-extend cannot tell)."""
    import copy
    import warnings

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    probe = copy.deepcopy(config)
    text = probe.get_text_config() if callable(getattr(probe, "get_text_config", None)) else probe
    text.__dict__["original_max_position_embeddings"] = PROBE_LENGTH  # as configure writes it, for every method
    if not families.ask("generate_swaps_cache", text):
        return False
    text.num_hidden_layers = 1
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(probe)
        ids = torch.zeros((1, PROBE_LENGTH + 1), dtype=torch.long)
        cache = DynamicCache()
        seen = torch.zeros(1, 1, PROBE_LENGTH, 1)
        cache.update(seen, seen, 0)
        inputs = getattr(type(model), PREPARE_INPUTS)(
            model, ids, next_sequence_length=1, **cache_name.cache_kwargs(cache)
        )
    except Exception:  # noqa: BLE001  (any failure to build or ask the probe: the answer is unknown, said so)
        return None
    return _partial(inputs, ids, cache)


def remove(model) -> None:
    model.__dict__.pop(STOPPING_CRITERIA, None)
    model.__dict__.pop(PREPARE_INPUTS, None)
