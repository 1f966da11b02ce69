"""Which parts of a model read positions: the attention layers' rotation (``hf.layout.probe``), and anything else.

``hf.layout.probe`` runs the decoder on two rows of the same tokens, row 0 at position 0 everywhere and row 1 at
positions spread over ``0 .. L-1``, with an attention function that records each layer's queries and keys and
returns zeros for both rows. Whatever reaches the decoder's output through transformers' attention interface is
then the same in both rows, so **rows that differ at the decoder's output mean that something outside that
interface reads positions**: a layer that rotates by itself, or a recurrent or convolution layer (linear
attention, Mamba) that would carry positions in the state it caches. ``watch`` measures that during the probe's
forward. Two uses:

- ``hf.rotate_keys``: the dynamic methods' cache keeper turns only the attention layers' cached keys, and leaves
  the recurrent and convolution states of hybrid models as they are. That is exact only where those states hold
  no position, which the rows say (``KeyRotator.outside``).
- ``unread``: a model none of whose layers reads the rotary embedding (every layer linear attention or
  convolution, every attention layer NoPE) would take a frequency method and change nothing; ``patch`` refuses
  it before anything changes. The attention methods refuse such a model from the same probe
  (``hf.attention.plan``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..errors import UnsupportedModelError
from . import families
from . import layout as rope_layout


def _rows_differ(hidden, tolerance: float) -> bool | None:
    """Whether rows 0 and 1 of the decoder's output (``last_hidden_state`` or the first tensor) differ by more
    than ``tolerance`` relative; None for an output it cannot read."""
    if isinstance(hidden, tuple | list):
        hidden = hidden[0] if hidden else None
    elif not isinstance(hidden, torch.Tensor):
        hidden = getattr(hidden, "last_hidden_state", None)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2 or hidden.shape[0] != 2:
        return None
    a, b = hidden[0].detach().float(), hidden[1].detach().float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return None
    return bool((a - b).norm() > tolerance * b.norm().clamp(min=1e-30))


@contextlib.contextmanager
def watch(decoder: nn.Module) -> Iterator[Callable[[], bool | None]]:
    """While ``hf.layout.probe`` runs ``decoder``: yields a function that says, after it, whether the probe's two
    rows differ at the decoder's output (True: something outside the attention interface reads positions; None:
    not seen, the probe's forward did not finish)."""
    seen: list[bool | None] = []
    param = next(decoder.parameters(), None)
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    tolerance = max(2e-3, 16 * torch.finfo(dtype).eps)  # the probe's own (hf.layout._classify)

    def hook(module, args, kwargs, output):
        if not seen:  # the probe's forward is the first one after the hook goes in
            seen.append(_rows_differ(output, tolerance))

    handle = decoder.register_forward_hook(hook, with_kwargs=True)
    try:
        yield lambda: seen[0] if seen else None
    finally:
        handle.remove()


def _on_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def unread(model: nn.Module, config, rotary: list[nn.Module], length: int) -> str | None:
    """Why no layer of ``model`` reads its rotary embedding, or None when some layer does, or when the probe
    cannot tell (a model still on the meta device, one the probe cannot run): then nothing is refused.

    No layer reads it when every attention layer the probe sees is NoPE (or there is none) and the probe's rows
    agree at the decoder's output (nothing else reads positions). ``config`` is the text config, ``rotary`` the
    text rotary modules, ``length`` the original ``L``."""
    if _on_meta(model):
        return None
    try:
        with watch(rope_layout.decoder_of(model)) as differ:
            probed = rope_layout.probe(model, config, rotary, length)
    except UnsupportedModelError:
        return None
    if differ() is not False or any(p.kind != "nope" for p in probed.values()):
        return None
    parts = []
    state = families.ask("state_layers", config)
    if state:
        parts.append(f"its {families.recurrent.describe(state)} keep a recurrent or convolution state")
    if probed:
        count = len(probed)
        parts.append(f"its {count} attention layer{'s' if count > 1 else ''} {'have' if count > 1 else 'has'} no RoPE")
    elif not state:
        parts.append("no layer calls attention")
    return (
        f"no layer of it reads the rotary embedding ({'; '.join(parts)}; a probe of the decoder sees nothing else "
        "read positions), so the patch would change nothing"
    )
