"""A family rule, the ordered registry of them, and the one way to ask them (``ask``).

A rule answers one question (its ``quirk``, one of ``QUIRKS``) about a config, a config class or an attention
module (the ``holder``): ``answer(holder, *context)`` returns the answer, or None where the rule has nothing to
say. ``ask`` asks the rules of that quirk in registration order and returns the first answer that is not None,
as peft picks a LoRA backend from an ordered list of small dispatchers. A rule keyed by ``model_type`` names its
types in ``model_types`` (asked only for holders of those types; ``model_types_for`` lists them, for a change
that must find the config classes without importing all of them); a rule keyed by capability leaves it empty
and tests the holder in ``answer``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import RopeExtendError
from ...registry import Registry

# The questions a rule may answer: the name, and what its answer is. A caller in hf asks exactly these.
QUIRKS = {
    "scale_keys": "the rope_parameters keys the family's rotary reads its attention scale from (a tuple)",
    "linear_within_context": "True: a shipped linear factor counts within max_position_embeddings (L = max / s)",
    "own_temperature": "why log-n would compound with a query temperature the family applies itself (a str)",
    "kept_reads": "why the family's own code would not keep a shipped scaling under keep_shipped (a str)",
    "longrope_only": "True: the config class accepts only default and longrope, and must be opened (a class)",
    "generate_swaps_cache": "what the family's generate does to the cache mid-sequence, replacing it (a str)",
    "state_layers": "the layers whose cache holds a recurrent or convolution state: {index: layer type}",
}


@dataclass(frozen=True)
class Rule:
    """One quirk of one family (or of every model with one capability)."""

    name: str  # unique: names the rule in the registry and its messages ("phimoe_scale_keys")
    quirk: str  # the question it answers, one of QUIRKS
    answer: Callable[..., Any]  # (holder, *context) -> the answer, or None where the rule has nothing to say
    model_types: tuple[str, ...] = ()  # asked only for holders of these model types; () asks it for every holder

    def applies_to(self, holder: Any) -> bool:
        return not self.model_types or getattr(holder, "model_type", None) in self.model_types


def _check(rule: Rule) -> None:
    if not isinstance(rule, Rule):
        raise RopeExtendError(f"a family rule must be a families.Rule, got {type(rule).__name__}")
    if rule.quirk not in QUIRKS:
        raise RopeExtendError(
            f"family rule {rule.name!r}: quirk must be one of {', '.join(QUIRKS)}; got {rule.quirk!r}"
        )
    if not callable(rule.answer):
        raise RopeExtendError(f"family rule {rule.name!r}: answer must be callable, got {rule.answer!r}")


# asked in registration order, so the first answer wins. A rule of one's own: ``RULES.register(Rule(...))``.
RULES: Registry[Rule] = Registry("family rule", check=_check)
for _name, _module in (  # the built-in rules, each in the module of its quirk
    ("phimoe_scale_keys", "attention_scale"),
    ("llama4_temperature", "attention_scale"),
    ("scale_keys_kept", "attention_scale"),
    ("mla_softmax_scale_kept", "attention_scale"),
    ("llama4_scaling_beta_kept", "attention_scale"),
    ("gemma3_linear_within_context", "context"),
    ("phi3_longrope_only", "longrope_only"),
    ("phi3_generate_swaps_cache", "longrope_only"),
    ("recurrent_state_layers", "recurrent"),
):
    RULES.register_lazy(_name, f"{__package__}.{_module}:{_name.upper()}")


def ask(quirk: str, holder: Any, *context: Any) -> Any:
    """The first answer of the rules for ``quirk`` (in registration order) that is not None, else None."""
    if quirk not in QUIRKS:  # a misspelt question would silently find no rule
        raise RopeExtendError(f"unknown family quirk {quirk!r}; allowed: {', '.join(QUIRKS)}")
    for rule in RULES.values():
        if rule.quirk == quirk and rule.applies_to(holder):
            answer = rule.answer(holder, *context)
            if answer is not None:
                return answer
    return None


def model_types_for(quirk: str) -> list[str]:
    """The model types the ``model_type``-keyed rules of ``quirk`` name, in registration order."""
    return [t for rule in RULES.values() if rule.quirk == quirk for t in rule.model_types]


def constant(value: Any) -> Callable[..., Any]:
    """An ``answer`` that gives ``value`` to every holder it is asked for (a rule keyed by ``model_type``)."""
    return lambda holder, *context: value
