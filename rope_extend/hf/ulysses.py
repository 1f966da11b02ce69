"""Ulysses sequence parallelism on a transformers model: DeepSpeed's ``UlyssesSPAttentionHF`` under the model's own
attention key, checked first and undone after.

Under Ulysses each of ``N`` ranks holds ``T/N`` consecutive tokens of one sequence; inside every attention layer an
all-to-all gives each rank all ``T`` positions for ``H/N`` of the heads, the attention runs on those, and a second
all-to-all gives the shards back. DeepSpeed (>= 0.19.8, ``deepspeed.runtime.sequence_parallel.ulysses_sp``) does
the all-to-alls; rope-extend writes none of its own. What this module adds:

- ``head_split(model, degree, batch_size)``: every refusal that needs the model, before any step, each naming the reason
  and what is allowed: heads or key-value heads the degree does not divide (the allowed degrees listed), an
  attention key the wrapper cannot serve (``eager``, FlexAttention: DeepSpeed rebuilds a plain causal block mask),
  sliding-window or chunked layers on SDPA (the wrapper drops the mask that carries the window), attention sinks
  (one logit per head, passed on unsplit), MLA (a value head size other than the query's), M-RoPE (position ids
  ``[3, B, T]``, gathered on the wrong dimension) and recurrent layers (their state runs along the sequence);
- ``install(model, split, group)``: the wrapper under the model's key (``config._attn_implementation``: ``sdpa``, a
  flash name, or rope-extend's own attention name, whose inner SDPA then stays unwrapped: wrapping both would
  all-to-all twice), through ``hf.transformers_changes.attention_function``; ``remove`` undoes it and puts back every
  attention module's ``num_key_value_groups`` (DeepSpeed lowers it for good when it replicates key-value heads);
- ``expect(model, split)``: the same record and undo when accelerate's DeepSpeed sequence parallelism installs
  DeepSpeed's own registration in ``prepare`` (for the whole process, with no undo of its own).

Install once for the whole run: activation checkpointing recomputes the layers in backward, under the same wrapper.
The wrapper drops tensor attention masks, as DeepSpeed's own registration does: the mask transformers built is for
the shard's length, and the attention runs causal over the gathered sequence with the gathered ``position_ids``.
That is exact for right padding (no real query sees a later pad) and positions that run on; positions restarting
per document need FlashAttention's varlen path (the sdpa case is refused by the recipe check).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..errors import UnsupportedModelError
from . import families, mrope
from . import transformers_changes as changes
from .attention.registration import is_registered_name
from .attention.state import NAME
from .head import unwrap

SERVED = ("sdpa", "flash_attention_2", "flash_attention_3")  # the keys the wrapper serves (and ours over them)


@dataclass(frozen=True)
class HeadSplit:
    """How Ulysses splits the heads, checked exact (``head_split``): the degree, the model's attention key and its
    head geometry, which ``install`` builds the wrapper from."""

    degree: int
    key: str
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    batch_size: int


@dataclass
class Installed:
    """An installed wrapper: its undo and the ``num_key_value_groups`` every attention module had before."""

    split: HeadSplit
    undo: Any
    groups: list[tuple[nn.Module, int]] = field(default_factory=list)


def allowed_degrees(heads: int, kv_heads: int) -> list[int]:
    """The degrees above 1 DeepSpeed's Ulysses splits this geometry into: divisors of the query heads that divide
    the key-value heads or are a multiple of them (then key-value heads are replicated)."""
    return [d for d in range(2, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]


def head_split(model: nn.Module, degree: int, batch_size: int) -> HeadSplit:
    """Check that Ulysses over ``degree`` ranks is exact on ``model`` (``UnsupportedModelError`` naming the reason
    otherwise) and return what ``install`` needs."""
    config: Any = unwrap(model).config
    text = config.get_text_config()
    key = str(config._attn_implementation)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    where = f"sequence parallelism over {degree} processes"
    # rope-extend's own name over eager/sdpa runs its own causal passes; over another implementation, that one
    inner = "sdpa" if key == NAME else key.removeprefix(f"{NAME}_") if is_registered_name(key) else key
    if inner not in SERVED:
        raise UnsupportedModelError(
            f"{where}: attention implementation {key!r} is not served by DeepSpeed's Ulysses here; "
            f"use one of {', '.join(SERVED)}"
        )
    if degree not in allowed_degrees(heads, kv_heads):
        allowed = ", ".join(map(str, allowed_degrees(heads, kv_heads))) or "none"
        raise UnsupportedModelError(
            f"{where}: the model has {heads} attention heads and {kv_heads} key-value heads; Ulysses splits heads, "
            f"so the degree must divide the attention heads and divide or be a multiple of the key-value heads: "
            f"allowed degrees {allowed}"
        )
    _refuse_layers(model, text, key, where)
    return HeadSplit(degree, key, heads, kv_heads, head_dim, int(text.num_hidden_layers), batch_size)


def _refuse_layers(model: nn.Module, text, key: str, where: str) -> None:
    """The layer kinds whose inputs DeepSpeed's wrapper does not split or carry exactly."""
    types = getattr(text, "layer_types", None)
    local = sorted({t for t in types or () if t in families.LOCAL_LAYER_TYPES})
    windowed = local or (types is None and getattr(text, "sliding_window", None) is not None)
    if windowed and "flash" not in key:
        what = f"layer types {', '.join(local)}" if local else f"sliding_window {text.sliding_window}"
        raise UnsupportedModelError(
            f"{where}: the model has local attention ({what}), whose window SDPA reads from the mask that Ulysses "
            "drops; use model.attn_implementation flash_attention_2 (GPU), which takes the window itself"
        )
    if any("sinks" in name.rsplit(".", 1)[-1] for name, _ in unwrap(model).named_parameters()):
        raise UnsupportedModelError(
            f"{where}: the model's attention has sinks (one logit per head), which DeepSpeed's Ulysses passes on "
            "unsplit; train it in one process per sequence"
        )
    v_dim = getattr(text, "v_head_dim", None)
    qk_dim = getattr(text, "qk_head_dim", None) or getattr(text, "head_dim", None)
    if getattr(text, "kv_lora_rank", None) is not None or (v_dim is not None and v_dim != qk_dim):
        raise UnsupportedModelError(
            f"{where}: multi-head latent attention (a value head size other than the query's) does not fit "
            "DeepSpeed's Ulysses shapes; train it in one process per sequence"
        )
    if mrope.sections(text) is not None:
        raise UnsupportedModelError(
            f"{where}: M-RoPE position ids ([axes, batch, tokens]) are gathered on the wrong dimension by DeepSpeed's "
            "Ulysses; train it in one process per sequence"
        )
    state = families.ask("state_layers", text)
    if state:
        raise UnsupportedModelError(
            f"{where}: {families.recurrent.describe(state)} carry a state along the sequence, which a shard cannot "
            "continue; train it in one process per sequence"
        )


def install(model: nn.Module, split: HeadSplit, group: Any) -> Installed:
    """DeepSpeed's ``UlyssesSPAttentionHF`` over ``group`` under ``split.key``; ``remove`` undoes it."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    groups = _kv_groups(model)
    ulysses = UlyssesSPAttentionHF(
        attn=ALL_ATTENTION_FUNCTIONS[split.key],
        batch_size=split.batch_size,
        attn_head_count=split.heads,
        attn_head_size=split.head_dim,
        kv_head_count=split.kv_heads,
        num_hidden_layers=split.layers,
        process_group=group,
        seq_length_is_variable=True,
    )

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        # the mask transformers built is for the shard: causal over the gathered sequence instead (a block mask,
        # FlexAttention's, would be kept, but head_split refuses flex)
        mask = attention_mask if not hasattr(attention_mask, "shape") else None
        return ulysses(module, query, key, value, mask, *args, **kwargs)

    return Installed(split, changes.attention_function(split.key, attention), groups)


def _kv_groups(model: nn.Module) -> list[tuple[nn.Module, int]]:
    return [
        (m, vars(m)["num_key_value_groups"])
        for m in model.modules()
        if isinstance(vars(m).get("num_key_value_groups"), int)
    ]


def expect(model: nn.Module, split: HeadSplit) -> Installed:
    """What DeepSpeed's own registration (``UlyssesSPAttentionHF.register_with_transformers``, which accelerate's
    DeepSpeed sequence parallelism calls in ``prepare``) will change, recorded before it does so that ``remove`` puts
    it back: it replaces ``split.key`` in transformers' attention registry for the whole process, with no undo,
    and lowers ``num_key_value_groups`` when it replicates key-value heads. Call it just before ``prepare``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    groups = _kv_groups(model)
    # through the ledger: the same function under the key now, and the undo puts back what was there before
    return Installed(split, changes.attention_function(split.key, ALL_ATTENTION_FUNCTIONS[split.key]), groups)


def remove(installed: Installed) -> None:
    """Undo ``install``: transformers' attention function and every module's ``num_key_value_groups`` as before."""
    installed.undo()
    for module, groups in installed.groups:
        vars(module)["num_key_value_groups"] = groups  # a plain attribute of the module (an int)
