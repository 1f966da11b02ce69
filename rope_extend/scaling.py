"""The scaling request: the one ``ScalingRequest`` that a suite's method, a recipe's ``rope`` section, the
command line's ``--method/--factor/...`` flags and lm-eval's ``model_args`` are all read into.

    ScalingRequest(method="yarn", factor=4)                         # s = 4 relative to the model's L
    ScalingRequest(method="yarn", target_length=32768)              # s = 32768 / L
    ScalingRequest(method="self_extend", params={"group_size": 8})  # attention methods need no factor

What it resolves to once the model's ``L`` is known is a ``methods.Scaling`` (``methods.resolved``): the request
is what a user asks for, the scaling what ``patch`` installs and ``patched`` reports. ``ScalingSpec``, the
request's earlier name, is kept as a deprecated alias for one release.

It is checked, before any model is loaded, by the same rules ``methods.resolve`` applies once the model's
original length ``L`` is known (``methods.resolved.check_amounts``): a known method; its parameters through
the method's own dataclass; exactly one of ``factor`` and ``target_length`` (attention methods may give
neither); ``factor >= 1``; nothing but the method name with ``method: none``. ``L`` is
``original_max_position_embeddings`` everywhere (transformers' name; ``--original-length`` on the command
line); unset, it is read from the model's config.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import untrusted
from .errors import RopeExtendError, deprecated_aliases, shown
from .methods import registry
from .methods._common import check_original_length
from .methods.resolved import check_amounts
from .schema import option

NONE = "none"
MAX_PARAMS_BYTES = 1 << 20  # a longrope.json of two factor lists is a few kB


AMOUNTS = ("factor", "target_length", "original_max_position_embeddings")  # the fields besides method and params


def _same(key: str) -> str:
    return key


@dataclass
class ScalingRequest:
    """A scaling as a user asks for it (see the module docstring); ``check()`` validates it."""

    method: str = option(NONE, help="scaling method (rope-extend methods), or none for the rope as it is")
    factor: float | None = option(None, help="scale factor s = target / original length L")
    target_length: int | None = option(None, help="target context in tokens (instead of factor)")
    original_max_position_embeddings: int | None = option(
        None, help="the original pretraining length L (default: read from the model's config)"
    )
    params: dict[str, Any] = option(help="method parameters, e.g. {beta_fast: 32}", factory=dict)

    @property
    def scales(self) -> bool:
        """Whether a method is asked for (``none`` leaves the model as it is)."""
        return self.method != NONE

    def check(self, spell: Callable[[str], str] = _same) -> ScalingRequest:
        """Raise ``RopeExtendError`` naming the problem (keys written as ``spell(key)``: ``--factor``,
        ``rope.factor``, ``factor=``; a parameter's key is ``params.NAME``); returns ``self``."""
        if not self.scales:
            given = [k for k in AMOUNTS if getattr(self, k) is not None] + [f"params.{k}" for k in self.params]
            if given:
                raise RopeExtendError(
                    f"{', '.join(spell(k) for k in given)} given without a scaling method ({spell('method')} is none): "
                    "name the method (rope-extend methods lists them), or leave them out to use the rope as it is"
                )
            return self
        if not isinstance(self.params, dict):
            raise RopeExtendError(f"{spell('params')} must be a mapping of parameter names, got {self.params!r}")
        try:
            method = registry.get(self.method)  # an unknown name raises, listing the known ones
        except RopeExtendError as exc:
            raise RopeExtendError(f"{spell('method')}: {exc}") from None
        if self.original_max_position_embeddings is not None:
            check_original_length(self.original_max_position_embeddings, spell("original_max_position_embeddings"))
        check_amounts(method, factor=self.factor, target_length=self.target_length, params=self.params, spell=spell)
        return self

    def read_params(self, path: str | os.PathLike, where: str, spell: Callable[[str], str] = _same) -> ScalingRequest:
        """Fill ``params`` (and ``factor`` and ``original_max_position_embeddings`` when unset) from the JSON
        file ``path`` (``where`` names it in errors), then ``check(spell)``; returns ``self``. Only the method's
        own parameter names are read (a search's ``longrope.json`` holds its record too); a ``rope_type``,
        ``factor`` or original length in the file that differs from the spec's is an error, since the parameters
        were made for those; parameters already in ``params`` win. The file is read as hostile
        (``untrusted``: a regular file of at most ``MAX_PARAMS_BYTES``, UTF-8, JSON of bounded depth)."""
        if not self.scales:
            raise RopeExtendError(
                f"{spell('params_from')} given without a scaling method ({spell('method')} is none): name the method"
            )
        fix = "give a JSON object of the method's parameters, such as the longrope.json a search writes"
        data = untrusted.read_object(path, limit=MAX_PARAMS_BYTES, name=where, fix=fix)
        method = registry.get(self.method)
        rope_type = data.get("rope_type", method.rope_type)
        if rope_type not in (method.name, method.rope_type):
            raise RopeExtendError(
                f"{where} holds parameters of rope_type {shown(rope_type)}, not of method {method.name!r}"
            )
        for key in ("factor", "original_max_position_embeddings"):
            if data.get(key) is None:
                continue
            if isinstance(data[key], bool) or not isinstance(data[key], (int, float)):
                raise RopeExtendError(f"{where}: {key} must be a number, got {shown(data[key])}")
            mine = getattr(self, key)
            if key == "factor" and self.target_length is not None:
                raise RopeExtendError(
                    f"{where} was made for factor {data[key]:g}: give that factor instead of {spell('target_length')} "
                    "(the factor a target length means depends on the model's original length)"
                )
            elif key == "factor" and mine is None:
                self.factor = float(data[key])
            elif key == "original_max_position_embeddings" and mine is None:
                self.original_max_position_embeddings = int(data[key])
            elif mine is not None and float(mine) != float(data[key]):
                raise RopeExtendError(
                    f"{where} was made for {key} {data[key]:g}, but the method asks for {mine:g}: "
                    f"leave {spell(key)} out, or use parameters made for it"
                )
        names = [f.name for f in dataclasses.fields(method.params)]
        found = {k: data[k] for k in names if k in data}
        if not found:
            raise RopeExtendError(f"{where} has none of {method.name}'s parameters ({', '.join(names)})")
        self.params = {**found, **self.params}
        return self.check(spell)

    def patch_kwargs(self) -> dict[str, Any]:
        """The keywords of ``rope_extend.patch(model, spec.method, **spec.patch_kwargs())``."""
        return {**{k: getattr(self, k) for k in AMOUNTS}, **self.params}

    def apply(self, model) -> None:
        """Patch ``model`` with this scaling. ``none`` leaves the model as loaded, except one that ships
        transformers' ``longrope``: it runs with rope-extend's, the same rope, whose cached keys are turned when the
        factors switch at ``L`` (``shipped_switch``; said on stderr)."""
        if self.scales:
            from .patching import patch  # here: reading a request (the command line's --help) loads no model code

            patch(model, self.method, **self.patch_kwargs())
            return
        from .shipped_switch import exact_shipped_switch

        said = exact_shipped_switch(model)
        if said is not None:
            print(f"rope-extend: {said}", file=sys.stderr)

    def describe(self) -> str:
        """``yarn x4``, ``yarn to 32768``, ``self_extend`` (an attention method without a target), ``none``."""
        if not self.scales:
            return NONE
        if self.factor is None and self.target_length is None:
            return self.method
        return (
            f"{self.method} x{self.factor:g}" if self.factor is not None else f"{self.method} to {self.target_length}"
        )

    @classmethod
    def from_values(cls, values: dict[str, Any], spell: Callable[[str], str] = _same) -> ScalingRequest:
        """A checked spec from flat ``key: value`` pairs (``method``, ``factor``, ``target_length``,
        ``original_max_position_embeddings``; any other key is a method parameter); None values are unset."""
        given = {k: v for k, v in values.items() if v is not None}
        fields = {k: given.pop(k) for k in ("method", *AMOUNTS) if k in given}
        return cls(**fields, params=given).check(spell)


# the earlier name, kept one release; reading it warns
_DEPRECATED = {"ScalingSpec": "ScalingRequest"}

if TYPE_CHECKING:
    ScalingSpec = ScalingRequest


__getattr__ = deprecated_aliases(__name__, "rope_extend.scaling", _DEPRECATED, globals())
