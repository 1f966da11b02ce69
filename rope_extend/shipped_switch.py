"""A model that ships transformers' own ``longrope`` run with cached keys kept consistent.

transformers' ``longrope`` switches a model's frequencies from the short factors to the long ones when a
forward's longest position reaches ``L`` (``original_max_position_embeddings``; ``dynamic_rope_update``), and
leaves the keys already in the KV cache as they were rotated. A ``generate`` whose prompt ends within ``L`` and
whose answer runs past it reads its prompt's keys with the short factors' angles and its new queries with the
long ones: the answer is neither what the short rope nor what the long rope computes (a SmolLM2 fine-tune
answered " 1. The. The is is" for its 8192-token passkey prompts; the same model with the switch held off,
and under the long rope, finds the key). An uncached forward of the same tokens has no such mixture.

``exact_shipped_switch(model)`` puts rope-extend's ``longrope`` in place of the shipped one with the config's own
factors, factor, ``L`` and attention factor, whose cache keeper turns the cached keys when the factors switch
(``hf.cache_keeper``), so cached generation computes what the uncached forward computes. Before it returns it
checks that the rope is unchanged: the rotary modules' cos and sin, patched against shipped, at ``L`` and
``L + 1`` positions (the two sides of the switch), to float32 rounding; otherwise it undoes the patch and
refuses. A model that ships anything else is left as it is. ``config_run(model)`` tells an evaluation record that
the patch in place is this one, so the record names the config's scaling (``scaling_from: config``), as for any
model run with the scaling it ships.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from .errors import UnsupportedModelError
from .hf.installed import installed
from .hf.names import SHIPPED_SWITCH
from .hf.reading import config_scaling, original_length, text_config
from .hf.rotary import rotary_modules
from .patching import patch, unpatch

SWITCHING = "longrope"  # transformers' own rope types whose frequencies change with the length


def _ships_switch(config) -> dict | None:
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or params.get("rope_type") != SWITCHING:
        if isinstance(params, dict) and any(
            isinstance(v, dict) and v.get("rope_type") == SWITCHING for v in params.values()
        ):
            raise UnsupportedModelError(
                f"{type(config).__name__} ships transformers' {SWITCHING} for some layer types only; rope-extend "
                "cannot keep its cached keys consistent across the switch at L there. Evaluate it with an explicit "
                "method (rope-extend's longrope and the config's factors)"
            )
        return None
    return params


@contextlib.contextmanager
def _quiet():
    log = logging.getLogger("rope_extend")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _rotary(model: nn.Module, positions: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _, module in rotary_modules(model):
        buffer = next((b for b in module.buffers()), None)
        device = buffer.device if buffer is not None else torch.device("cpu")
        x = torch.zeros(1, 1, positions, 1, device=device, dtype=torch.float32)
        ids = torch.arange(positions, device=device)[None]
        with torch.no_grad():
            cos, sin = module(x, ids)
        out.append((cos.float(), sin.float()))
    return out


def exact_shipped_switch(model: nn.Module) -> str | None:
    """Run a model that ships transformers' ``longrope`` with rope-extend's (see the module docstring); returns
    a line that says so, or None when the model ships no such scaling (nothing done)."""
    config = text_config(model.config)
    params = _ships_switch(config)
    if params is None:
        return None
    L = original_length(config)
    factor = params.get("factor") or config.max_position_embeddings / L
    kwargs = {key: params.get(key) for key in ("short_factor", "long_factor")}  # missing: patch refuses, by name
    if params.get("attention_factor") is not None:
        kwargs["attention_factor"] = params["attention_factor"]
    shipped_scaling = config_scaling(config)
    shipped = [_rotary(model, L), _rotary(model, L + 1)]
    target = round(float(factor) * L)  # a factor counts from the shipped context, which is not L here
    with _quiet():  # patch's "rope-extend replaces the shipped scaling" would say the opposite of what happens
        patch(model, SWITCHING, target_length=target, original_max_position_embeddings=L, **kwargs)
    try:
        ours = [_rotary(model, L), _rotary(model, L + 1)]
        for at, (a, b) in zip((L, L + 1), zip(shipped, ours, strict=True), strict=True):
            for (cos_a, sin_a), (cos_b, sin_b) in zip(a, b, strict=True):
                if not (
                    torch.allclose(cos_a, cos_b, rtol=0, atol=2e-6) and torch.allclose(sin_a, sin_b, rtol=0, atol=2e-6)
                ):
                    raise UnsupportedModelError(
                        f"{type(config).__name__} ships transformers' {SWITCHING}, which switches its factors at "
                        f"L = {L} without turning cached keys, and rope-extend's {SWITCHING} with the config's "
                        f"parameters does not reproduce its rope at {at} positions; evaluate it with an explicit "
                        "method instead"
                    )
    except BaseException:
        unpatch(model)
        raise
    # records name the config's scaling, not a patch: the rope is the shipped one (checked above)
    model.__dict__[SHIPPED_SWITCH] = (installed(model), shipped_scaling)
    return (
        f"the model ships transformers' {SWITCHING} (short factors within L = {L}, long ones past it); it runs with "
        f"rope-extend's {SWITCHING} and the same factors, which turns cached keys when the factors switch, as "
        "transformers' does not"
    )


def config_run(model: nn.Module):
    """The config's own scaling when the patch in force is the one ``exact_shipped_switch`` put in place, else
    None."""
    kept = model.__dict__.get(SHIPPED_SWITCH)
    now = installed(model)
    return kept[1] if kept is not None and now is not None and kept[0] is now else None
