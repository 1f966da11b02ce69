"""The one way rope-extend's runtime goes into a model, whichever way the model got its scaling.

Two roads lead here: ``rope_extend.patch`` (a loaded model; it has checked everything and written the scaling
into the config and the frequency buffers) and a model built from a config that already names a rope-extend
type (``hf.register``'s ``post_init``: transformers computed the buffers through rope-extend's init function).
Both then need the same things, in the same order, with the same checks: each rotary module's frequency sets
(``hf.rotary_plan``, checked while planning: its buffer must hold the frequencies the config implies), the rotary runtime (float32 frequencies,
dynamic methods) and the cache keeper of the dynamic ones (``hf.cache_keeper``), the attention method's plans
(``hf.attention``), ``generate``'s length reminder dropped for a method without a length limit, and the
recompute of the Phi-3 families' ``generate`` at ``L`` made whole (``hf.generation``). ``attach`` does them and says what it installed, so that ``unpatch`` can take it off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from . import attention, cache_keeper, generation, rotary
from .names import SHIPPED_ATTR
from .reading import text_config
from .rotary_plan import RotaryPlan

logger = logging.getLogger("rope_extend")


@dataclass(frozen=True)
class AttentionInstall:
    """An attention method in a model: the text ``config`` it was installed for, the implementation the model ran
    before (``inner``, which the layers it leaves alone keep) and the attention modules given a plan."""

    model: nn.Module
    config: Any
    inner: str
    modules: list[nn.Module]

    def kernel(self) -> str:
        """What runs the patched layers' attention now (``hf.attention.kernel``)."""
        return attention.kernel(self.model, self.config, self.inner, self.modules)

    def remove(self) -> None:
        attention.remove(self.model, self.config, self.inner, self.modules)


@dataclass
class Attached:
    """What ``attach`` installed: the cache keepers ``(decoder, hook key)``, the attention method and the model
    whose ``generate`` no longer warns past ``L`` (or recomputes the Phi-3 switch); ``detach`` takes them off."""

    hooks: list[tuple[nn.Module, int]] = field(default_factory=list)
    attention: AttentionInstall | None = None
    generation: nn.Module | None = None

    def detach(self) -> None:
        for decoder, hook in self.hooks:
            cache_keeper.remove(decoder, hook)
        if self.attention is not None:
            self.attention.remove()
        if self.generation is not None:
            generation.remove(self.generation)


def attach(model: nn.Module, rotaries: list[RotaryPlan], scaling, planned, modules: list[nn.Module]) -> Attached:
    """Install rope-extend's runtime in ``model``: for each of ``rotaries`` the rotary runtime and its cache keeper, then the attention plans ``planned`` (``hf.attention.
    plans``; none for a frequency method) of ``scaling``, whose layers rotate with the text rotary ``modules``,
    and ``generate``'s reminder for an unbounded method. Everything is planned and checked before it is called."""
    attached = Attached()
    for planned_rotary in rotaries:
        runtime = rotary.install(planned_rotary.module, planned_rotary.entries)
        hook = cache_keeper.install(model, runtime, planned_rotary.config)
        if hook is not None:
            attached.hooks.append(hook)
    if planned:
        config = text_config(rotary.module_config(model, modules[0]))
        inner = planned[0][1].inner
        attention.install(model, config, planned, scaling, modules)
        attached.attention = AttentionInstall(model, config, inner, [m for m, _ in planned])
        param = next(model.parameters(), None)
        device = param.device if param is not None else None
        # a model still on meta (built by from_pretrained before its weights) is not where it will run
        if (
            device is not None
            and device.type not in ("cpu", "meta")
            and attached.attention.kernel().startswith("torch_tiles")
        ):
            logger.warning(
                "%s runs its attention passes in plain torch over key tiles on %s (no fused kernel with a "
                "log-sum-exp there yet): slower than the model's %s",
                scaling.method.name,
                device,
                inner,
            )
    if scaling is not None and generation.unbounded(scaling) and generation.install(model):
        attached.generation = model
    if _scaled_by_rope_extend(model, modules, attached) and generation.install_recompute(model):
        attached.generation = model  # the Phi-3 families: their switch at L made whole
    return attached


def _scaled_by_rope_extend(model: nn.Module, modules: list[nn.Module], attached: Attached) -> bool:
    """Whether rope-extend runs or wrote ``model``'s rotary scaling: its runtime in a rotary module, an attention
    method, or a config one of its writes made (``SHIPPED_ATTR``: a model saved with a transformers type such as
    ``yarn`` reloads as transformers' own, from rope-extend's numbers). A model rope-extend never touched is left
    as transformers has it."""
    runtime = any(isinstance(m.__dict__.get("forward"), rotary.RotaryRuntime) for m in modules)
    if runtime or attached.attention is not None:
        return True
    config = getattr(model, "config", None)
    return config is not None and SHIPPED_ATTR in text_config(config).__dict__
