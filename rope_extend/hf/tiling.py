"""Tiled MLPs: DeepSpeed's ``TiledMLP`` around every decoder layer's MLP, reversibly.

A decoder MLP widens each token to the intermediate size (Llama-3-8B: 4096 -> 14336, three such tensors while it
runs and again in backward), so at long context the MLP of the one layer being computed (or recomputed, under
activation checkpointing) is the largest activation after the logits. ``TiledMLP``
(``deepspeed.runtime.sequence_parallel.ulysses_sp``, the Arctic Long Sequence Training component) runs the MLP over
sequence tiles, keeps only its input, and recomputes tile by tile in backward: the widened tensors exist for one tile
at a time. An MLP works on each token alone, so the result is the untiled one (loss and gradients equal within
float rounding; tests/test_tiling.py).

Only a plain per-token MLP can be tiled: a mixture of experts keeps router statistics (load-balancing losses,
expert counts) that would be gathered per tile, and dropout inside the MLP would draw a different mask when a tile
is recomputed in backward; both are refused, as is a decoder whose layers have no ``mlp``. Under more than one
process an MLP weight that trains is refused by the training loop (DDP sees one backward per tile: measured wrong or
failing, eval/reports/i64-prototype/DESIGN.md 4.4).

``tile_mlps(model, tiles)`` installs an instance ``forward`` on each MLP and returns an ``undo`` that deletes them:
afterwards the modules are exactly what they were (the class's ``forward`` again). deepspeed is imported here, when
tiling is asked for (it takes seconds to import).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import RopeExtendError, UnsupportedModelError
from .head import unwrap
from .layout import decoder_of
from .names import TILES_ATTR

# submodules (or attributes) whose presence means experts and a router rather than one per-token MLP
MOE_NAMES = ("experts", "router", "shared_expert", "shared_experts", "moe")


def tiles_for(tokens: int, hidden: int, tiles: int | None) -> int:
    """The number of tiles for ``tokens`` tokens: ``tiles``, or DeepSpeed's rule ``ceil(tokens / hidden)`` (a tile
    of about ``hidden`` tokens holds an intermediate tensor no bigger than a square weight) when it is None; never
    more tiles than tokens."""
    n = tiles if tiles is not None else math.ceil(tokens / max(hidden, 1))
    return max(1, min(n, tokens))


def decoder_mlps(model: nn.Module) -> list[nn.Module]:
    """Every decoder layer's MLP (``model`` may be inside PEFT or DDP wrappers), checked to be a plain per-token MLP.

    Raises ``UnsupportedModelError`` naming the layer for a model whose decoder has no ``layers`` with an ``mlp``,
    a mixture of experts, or an MLP holding dropout."""
    base = unwrap(model)
    layers = getattr(decoder_of(base), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise UnsupportedModelError(
            f"memory.tiled_mlp: {type(base).__name__} has no decoder layer list (model.layers) to find its MLPs in; "
            "tiling supports decoders whose layers each hold an `mlp` module (Llama, Qwen, Mistral, Gemma, ...)"
        )
    mlps = []
    for index, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise UnsupportedModelError(
                f"memory.tiled_mlp: decoder layer {index} ({type(layer).__name__}) has no `mlp` module; "
                "tiling needs a plain per-token MLP in every layer"
            )
        _check_plain(mlp, index)
        mlps.append(mlp)
    return mlps


def _check_plain(mlp: nn.Module, index: int) -> None:
    kind = type(mlp).__name__
    names = {name.rsplit(".", 1)[-1] for name, _ in mlp.named_modules()} | set(vars(mlp))
    if any(n in names for n in MOE_NAMES) or "moe" in kind.lower() or "expert" in kind.lower():
        raise UnsupportedModelError(
            f"memory.tiled_mlp: decoder layer {index}'s MLP is a mixture of experts ({kind}): its router statistics "
            "(load-balancing loss, expert counts) would be taken per tile; set memory.tiled_mlp: false for this model"
        )
    dropout = [n for n, m in mlp.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if dropout:
        raise UnsupportedModelError(
            f"memory.tiled_mlp: decoder layer {index}'s MLP ({kind}) has dropout ({', '.join(dropout)}): a tile "
            "recomputed in backward would draw another mask; set lora.lora_dropout: 0 (LoRA on an MLP projection) "
            "or memory.tiled_mlp: false"
        )


def _tiled_mlp_class() -> Any:
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    except ImportError as exc:
        raise UnsupportedModelError(
            f"memory.tiled_mlp needs DeepSpeed's TiledMLP (deepspeed>=0.19.8): {exc}; "
            "pip install 'deepspeed>=0.19.8', or set memory.tiled_mlp: false"
        ) from None
    return TiledMLP


def _tiled_forward(mlp: nn.Module, tiles: int | None, tiled: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The instance ``forward`` of a tiled MLP."""
    plain = type(mlp).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        params = [p for p in mlp.parameters() if p.requires_grad]
        if params and torch.is_grad_enabled() and not x.requires_grad:
            # TiledMLP's output joins the graph only through x (its parameters are not inputs that autograd sees):
            # with a frozen input (the first layer under LoRA on the MLP alone) the MLP's weights would get no
            # gradient. A detached copy that asks for one puts the output in the graph; its own gradient is dropped.
            x = x.detach().requires_grad_(True)
        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device)

        def run(module: nn.Module, part: torch.Tensor) -> torch.Tensor:
            # backward recomputes outside the forward's autocast region: compute every tile as the forward did
            with torch.autocast(device, dtype=dtype, enabled=autocast):
                return plain(module, packed(part))

        return tiled.apply(run, mlp, x, tiles_for(x.shape[-2], x.shape[-1], tiles), params)

    return forward


def packed(t: torch.Tensor) -> torch.Tensor:
    """``t`` laid out as a fresh tensor of its shape (a copy only when it is not).

    A tile that ``torch.chunk`` cuts from ``[1, T, H]`` keeps ``T * H`` as its first stride; ``torch.matmul`` then does
    not fold it into one matrix product but expands and copies the transposed weight for every call (measured with
    torch 2.13 on the CPU: the Llama-3-8B MLP's 117 MB weights copied per tile, a LoRA step 2.4x slower with 4 tiles).
    The tile's copy is ``tile x hidden`` values, small beside the activations the tile creates."""
    stride, want = 1, []
    for size in reversed(t.shape):
        want.append(stride)
        stride *= size
    return t if t.stride() == tuple(reversed(want)) else t.clone(memory_format=torch.contiguous_format)


def tile_mlps(model: nn.Module, tiles: int | None = None, *, processes: int = 1) -> Callable[[], None]:
    """Run every decoder MLP of ``model`` over sequence tiles (``tiles`` per call; None: ``ceil(tokens / hidden)``).

    ``processes``: how many processes train the model together (DDP); with more than one, an MLP weight that
    trains is refused (DDP's reducer sees one backward per tile: measured failing, or wrong with a static graph).
    Returns ``undo``, which puts every MLP back as it was (idempotent; ``untile`` does the same from the model).
    Raises ``UnsupportedModelError`` for a model without plain per-token MLPs (``decoder_mlps``), an MLP tiled
    already, a trained MLP weight under several processes, or a missing deepspeed; ``RopeExtendError`` for
    ``tiles`` that is not a positive integer or None."""
    if tiles is not None and (isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1):
        raise RopeExtendError(f"memory.mlp_tiles: got {tiles!r}; expected an integer >= 1, or null")
    mlps = decoder_mlps(model)
    trained = sorted({n for mlp in mlps for n, p in mlp.named_parameters() if p.requires_grad})
    if processes > 1 and trained:
        raise UnsupportedModelError(
            f"memory.tiled_mlp with {processes} processes: MLP weights train ({', '.join(trained[:4])}"
            f"{', ...' if len(trained) > 4 else ''}), and DDP cannot reduce a gradient that TiledMLP builds tile by tile; keep the MLP frozen (lora."
            "target_modules without gate_proj/up_proj/down_proj or other MLP projections, not lora: null), train in "
            "one process, or set memory.tiled_mlp: false"
        )
    for index, mlp in enumerate(mlps):
        if TILES_ATTR in vars(mlp) or "forward" in vars(mlp):
            raise UnsupportedModelError(
                f"memory.tiled_mlp: decoder layer {index}'s MLP already has its own forward (tiled before, or changed "
                "by other code); undo that first"
            )
    tiled = _tiled_mlp_class()
    for mlp in mlps:
        mlp.forward = _tiled_forward(mlp, tiles, tiled)
        setattr(mlp, TILES_ATTR, tiles)

    def undo() -> None:
        for mlp in mlps:
            _untile(mlp)

    return undo


def _untile(module: nn.Module) -> None:
    state = vars(module)
    if TILES_ATTR in state:
        del state[TILES_ATTR]
        state.pop("forward", None)


def untile(model: nn.Module) -> None:
    """Put back every MLP of ``model`` that ``tile_mlps`` tiled (a no-op when none is)."""
    for module in model.modules():
        _untile(module)


def tiled(model: nn.Module) -> bool:
    """Whether any MLP of ``model`` is tiled now."""
    return any(TILES_ATTR in vars(m) for m in model.modules())
