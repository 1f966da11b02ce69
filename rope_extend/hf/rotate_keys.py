"""Turning the keys a KV cache already holds, in each layer's own rotation: the one mechanism under both keepers.

RoPE rotations compose, so a cached key, rotated to its position when it was computed, is brought to what it
would be now by one more rotation of each rotary pair by an angle ``a``: ``hf.cache_keeper.CacheKeeper`` turns by
``p (theta' - theta)`` when dynamic frequencies change (times ``m' / m`` when the attention scale changes with
them), ``sinks.SinkKeeper`` by ``-e theta`` when ``e`` tokens are evicted before the kept ones. Both need the same
three things, which live here so that they cannot drift apart:

- how each layer rotates and what its cache stores, found once by running the model (``hf.layout.probe`` with
  a cache: pairing, which dimensions, direction, frequency set; NoPE layers; a compressed MLA cache), and from
  the same forward whether anything outside the attention layers reads positions (``hf.rotary_reads.watch``:
  where nothing does, a hybrid's recurrent and convolution states hold no position and are left as they are);
- a refusal, before anything runs, when some layer's cached keys cannot be turned (``hf.layout.cached_layout``),
  in the words of the keeper that needs the turn;
- the turn itself: float64 angles, float32 keys, back to the cache's dtype (``Layout.turn``).

What differs stays with each keeper: when to turn and by which angles, which cache layers it accepts, and how
it rebuilds a cache layer (the sink keeper drops slots as it turns).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..errors import UnsupportedModelError
from . import layout as rope_layout
from . import rotary_reads


class KeyRotator:
    """How ``model``'s layers rotate their cached keys (probed once), and the turn of those keys.

    ``config`` is the text config the layers read their attention implementation from (the probe switches it);
    ``rotary`` the language model's rotary modules, whose frequencies the candidate layouts use."""

    def __init__(self, model: nn.Module, config, rotary: list[nn.Module]):
        self.model = model
        self.config = config
        self.rotary = rotary
        # layer index -> hf.layout.LayerProbe, once probed; ``unprobed``: why the probe itself failed (lenient)
        self.layouts: dict[int, rope_layout.LayerProbe] | None = None
        self.unprobed: str | None = None
        # whether something outside the attention layers reads positions (``hf.rotary_reads.watch``; None: not
        # known): where it does not, a hybrid's recurrent and convolution states hold no position to turn
        self.outside: bool | None = None
        self.probing = False  # the probe's own forward is under way (a keeper's hook lets it pass)

    def probe(self, length: int, lenient: bool = False) -> None:
        """Find each layer's rotation once, at probe positions below ``length`` (the original ``L``).

        The probe's forward fills a cache, so each layer's ``cached_width`` is known and a cache whose keys cannot
        be turned is refused before a forward runs. Strict (the default), a failed probe raises its own error.
        ``lenient``: a model that cannot run with a cache is probed without one, and one that cannot be probed at
        all is recorded (``unprobed``), so that a keeper refuses it only once a turn is needed, in its words."""
        if self.layouts is not None:
            return
        self.probing = True
        try:
            if not lenient:
                self.layouts = self._probe(length, True)
                return
            try:
                try:
                    self.layouts = self._probe(length, True)
                except UnsupportedModelError:
                    self.layouts = self._probe(length, False)
            except UnsupportedModelError as exc:
                self.layouts, self.unprobed = {}, str(exc)
        finally:
            self.probing = False

    def _probe(self, length: int, cached: bool) -> dict[int, rope_layout.LayerProbe]:
        """One probe forward: the layers' rotations, and ``outside`` from the same forward."""
        with rotary_reads.watch(rope_layout.decoder_of(self.model)) as differ:
            layouts = rope_layout.layer_probes(self.model, self.config, list(self.rotary), length, cached)
        self.outside = differ()
        return layouts

    def layout(self, index: int, width: int | None, refuse: Callable[[str], str]) -> rope_layout.Layout | None:
        """Layer ``index``'s rotation for cached keys of size ``width``; None for a NoPE layer (nothing to turn).

        Raises ``UnsupportedModelError(refuse(why))`` when it is unknown, when the probe failed, or when the cache
        holds keys of another size than the layer's attention sees (a compressed MLA cache): ``refuse`` puts the
        reason in the keeper's words (what it needs the turn for, what to do instead)."""
        layout, why = rope_layout.cached_layout(self.layouts or {}, index, width, self.unprobed)
        if why is not None:
            raise UnsupportedModelError(refuse(why))
        return layout

    def check(self, refuse: Callable[[str], str], select: Callable[[int], bool] | None = None) -> None:
        """Refuse (as ``layout`` does) when some probed layer's cached keys could not be turned: every layer, or
        those ``select`` accepts by index. Run before the first forward that may need a turn, not at the turn,
        after forwards have changed the cache."""
        if self.unprobed:
            self.layout(-1, None, refuse)  # raises with the probe's reason
        for index, seen in (self.layouts or {}).items():
            if select is None or select(index):
                self.layout(index, seen.cached_width or seen.width, refuse)


def turned(keys: torch.Tensor, layout: rope_layout.Layout, angles: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``keys`` ``[batch, heads, slots, head_dim]`` with each rotary pair turned by ``angles`` (float64,
    ``[..., slots, dim/2]``, broadcast over batch and heads) in float32 and the rotary dimensions times ``scale``;
    in ``keys``' dtype."""
    return layout.turn(keys.float(), angles, scale).to(keys.dtype)


def shift_angles(layout: rope_layout.Layout, delta: torch.Tensor, device) -> torch.Tensor:
    """The angles ``delta[t] * theta`` ``[slots, dim/2]`` (float64) that move the key in slot ``t`` by ``delta[t]``
    positions under ``layout``'s frequencies (``Layout.rotate``'s)."""
    return delta.to(device=device, dtype=torch.float64)[:, None] * layout.frequencies(device)[None]


def turn_layer(layer, layout: rope_layout.Layout, angles: torch.Tensor, scale: float = 1.0) -> None:
    """Turn the cached keys of the cache layer ``layer`` in place by ``angles`` ``[batch, 1, slots, dim/2]``: the
    last ``slots`` of a dynamic layer (a sliding window keeps the last ones), the first ones of a static layer
    (slots by cache position); the rotary dimensions times ``scale``."""
    from transformers.cache_utils import StaticLayer

    keys = layer.keys
    slots = min(keys.shape[-2], angles.shape[2])
    static = isinstance(layer, StaticLayer)
    part = keys[:, :, :slots] if static else keys[:, :, -slots:]
    rotated = turned(part, layout, angles[:, :, -slots:], scale)
    if static:
        keys[:, :, :slots].copy_(rotated)
    else:
        layer.keys = torch.cat([keys[:, :, :-slots], rotated], dim=2) if keys.shape[-2] > slots else rotated
