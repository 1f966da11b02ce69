"""transformers' ``generate`` and the length a patch reaches.

``generate`` warns once ("This is a friendly reminder - the current text generation call has exceeded the
model's predefined maximum length") when a sequence passes ``config.max_position_embeddings``; its
``MaxLengthCriteria`` only warns, it never stops. ``patch`` raises that length to its target, so a patched model
is quiet up to the target and warns past it. A method with no length limit (ReRoPE, Dual Chunk Attention:
every relative position stays below ``L``) patched without a factor keeps the target ``L`` yet reaches any
length; for it ``install`` makes that model's own stopping criteria carry no maximum, so the reminder, which
is then wrong, is not printed. Nothing else about generation changes, and ``remove`` (on unpatch) puts it back.
"""

from __future__ import annotations

import functools

from transformers.generation.stopping_criteria import MaxLengthCriteria

ATTR = "_get_stopping_criteria"  # GenerationMixin's method that builds MaxLengthCriteria (5.17 and 5.24)


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
    if not callable(getattr(type(model), ATTR, None)):
        return False
    model.__dict__[ATTR] = functools.partial(_stopping_criteria, model)
    return True


def remove(model) -> None:
    model.__dict__.pop(ATTR, None)
