"""The kernels one attention pass runs on, and the log-sum-exp merge that joins passes.

A method's attention is a sum over passes on disjoint keys (``passes``). Each pass returns its output ``o_p``
and its log-sum-exp ``l_p = log sum_j exp(s_ij)``; two passes join exactly as

    l = logaddexp(l_a, l_b),    o = o_a exp(l_a - l) + o_b exp(l_b - l)

(the online-softmax identity of FlashAttention, Dao et al. 2022), so no pass ever holds a full score matrix.

- ``cpu_flash``: aten's CPU flash attention, which returns the log-sum-exp, on the CPU without softcapping;
  a masked pass is cut into an unmasked part, causal squares (the kernel's own causal skipping) and the rest
  with an additive mask (``_partial_cpu``);
- ``torch_tiles``: plain torch over ``TILE`` keys at a time (logit softcapping, other devices, autograd).

Shapes: ``B`` batch, ``H`` query heads, ``H_kv`` key/value heads (``G = H / H_kv`` query heads per key head),
``T`` query rows, ``S`` keys of the pass, ``D`` head size, ``D_v`` value head size.
"""

from __future__ import annotations

import torch

TILE = 1024  # key columns per tile of the plain-torch path (softcapping, non-CPU devices)
SPLIT = 64  # a masked CPU pass is cut into unmasked / causal / masked column ranges from this width on


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the passes run in: the model's for bf16 and fp16 (the kernels accumulate in float32), else
    float32."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def passes_kernel(device_type: str, softcap: bool, autograd: bool = False) -> str:
    """The kernel the method's passes run on: ``cpu_flash`` on the CPU without logit softcapping, else
    ``torch_tiles``; ``_partial`` dispatches by it and ``installation.kernel`` reports it. Under autograd (training
    through an attention method) always ``torch_tiles``: the passes are merged by their log-sum-exp, and aten's
    flash kernels give no gradient through it, so their gradients would be silently wrong.

    Args:
        device_type: ``torch.device.type`` of the queries.
        softcap: whether the layer caps its logits (Gemma 2).
        autograd: whether autograd records the pass.

    Returns:
        ``"cpu_flash"`` or ``"torch_tiles"``.
    """
    return "cpu_flash" if device_type == "cpu" and not softcap and not autograd else "torch_tiles"


def _autograd(*tensors: torch.Tensor) -> bool:
    """Whether autograd records operations on these tensors."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _partial(q, k, v, allow, scaling: float, softcap: float | None):
    """Attention of ``q`` ``(B, H, T, D)`` over ``k``/``v`` ``(B, H_kv, S, D | D_v)`` (GQA by head groups; all
    three of one dtype, the products accumulated in float32) and its log-sum-exp, both returned in float32:
    ``(B, H, T, D_v)`` and ``(B, H, T)``. ``allow`` ``(B, 1 | H, T, S)`` (True: attend) or None. Rows with no key
    allowed give output 0 and log-sum-exp -inf. Value heads narrower or wider than query heads (MLA) are padded
    with zeros, which changes neither the scores nor the output."""
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - dv))  # (B, H_kv, S, D)
    elif dv > q.shape[-1]:
        q, k = (torch.nn.functional.pad(t, (0, dv - t.shape[-1])) for t in (q, k))  # (B, H | H_kv, T | S, D_v)
    out, lse = _partial_padded(q, k, v, allow, scaling, softcap)
    return out[..., :dv].float(), lse  # (B, H, T, D_v), (B, H, T)


def _partial_padded(q, k, v, allow, scaling: float, softcap: float | None):
    """``_partial`` on one head size, by the kernel ``passes_kernel`` picks."""
    if passes_kernel(q.device.type, softcap is not None, _autograd(q, k, v)) == "cpu_flash":
        return _partial_cpu(q, k, v, allow, scaling)
    return _partial_torch(q, k, v, allow, scaling, softcap)


def _partial_cpu(q, k, v, allow, scaling: float):
    """The CPU flash kernel. A masked pass is cut where its mask allows: a causal square at its end (the diagonal
    block) runs with the kernel's own causal skipping, and so does the mirror square at its start (row ``t`` sees
    columns ``t ..``, the start of a band: rows and columns reversed make it causal); the columns every row sees
    run with no mask, and only the rest with an additive mask (a band pass then costs about its allowed area)."""
    if allow is None or allow.shape[-1] < 2 * SPLIT:
        return _flash_cpu(q, k, v, allow, scaling)
    rows, start, end = allow.shape[-2], 0, allow.shape[-1]
    squares = rows >= SPLIT  # a few rows (a decode step) take the columns they all see in one call
    pieces = []  # (first column, last + 1, mask or None, causal, mirrored)
    if squares and end >= rows and bool((allow[..., end - rows :] == _tril(rows)).all()):  # every batch row, head
        pieces.append((end - rows, end, None, True, False))
        end -= rows
    if squares and end >= rows and bool((allow[..., :rows] == _tril(rows).T).all()):
        pieces.append((0, rows, None, True, True))
        start = rows
    if end > start:
        seen = allow[..., start:end].all(dim=-2).reshape(-1, end - start).all(0)  # (B * (1 | H), S') -> (S',)
        cols = (seen.nonzero().flatten() + start).tolist()  # columns every row sees; one host sync, on the CPU
        masked = [(start, end)]
        if len(cols) >= SPLIT and cols[-1] - cols[0] + 1 == len(cols):
            pieces.append((cols[0], cols[-1] + 1, None, False, False))
            masked = [(start, cols[0]), (cols[-1] + 1, end)]
        pieces += [(c0, c1, allow[..., c0:c1], False, False) for c0, c1 in masked if c1 > c0]
    acc = lse = None
    for c0, c1, mask, causal, mirrored in pieces:
        if mirrored:  # rows and columns reversed along T and S: (B, H | H_kv, T | S, D)
            out, out_lse = _flash_cpu(q.flip(2), k[:, :, c0:c1].flip(2), v[:, :, c0:c1].flip(2), None, scaling, True)
            out, out_lse = out.flip(2), out_lse.flip(2)  # back in row order: (B, H, T, D_v), (B, H, T)
        else:
            out, out_lse = _flash_cpu(q, k[:, :, c0:c1], v[:, :, c0:c1], mask, scaling, causal=causal)
        acc, lse = (out, out_lse) if acc is None else _merge(acc.float(), lse, out.float(), out_lse)
    return acc, lse


def _tril(n: int) -> torch.Tensor:
    """``(n, n)`` booleans, True on and below the diagonal: a causal square."""
    return torch.ones(n, n, dtype=torch.bool).tril()


def _flash_cpu(q, k, v, allow, scaling: float, causal: bool = False):
    """One call of aten's CPU flash attention: ``(B, H, T, D_v)`` and its log-sum-exp ``(B, H, T)``, the rows
    with no key allowed set to 0 and -inf (the kernel leaves them undefined)."""
    bias = None
    if allow is not None:
        bias = torch.zeros(allow.shape, dtype=q.dtype, device=q.device).masked_fill(~allow, float("-inf"))
    # grouped-query attention: the CPU kernel maps query head h to key head h // (h_q / h_kv), as repeat_kv
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=scaling
    )
    if allow is not None:
        none = ~allow.any(-1).expand_as(lse)  # (B, 1 | H, T) -> (B, H, T)
        lse = lse.masked_fill(none, float("-inf"))
        out = out.masked_fill(none[..., None], 0.0)  # none as (B, H, T, 1)
    return out, lse


def _partial_torch(q, k, v, allow, scaling, softcap):
    """Plain torch, keys in tiles of ``TILE`` merged by log-sum-exp (softcapping; non-CPU devices). The query
    heads of one key head are stacked along the rows, so that one matmul serves a group (no ``repeat_kv``)."""
    b, h, n, _ = q.shape
    groups = h // k.shape[1]
    qg = q.reshape(b, k.shape[1], groups * n, q.shape[-1])  # (B, H, T, D) -> (B, H_kv, G * T, D)
    acc = lse = None
    for t0 in range(0, k.shape[2], TILE):
        kt, vt = k[:, :, t0 : t0 + TILE], v[:, :, t0 : t0 + TILE]  # (B, H_kv, S_t, D | D_v)
        # (B, H_kv, G * T, D) @ (B, H_kv, D, S_t) -> (B, H_kv, G * T, S_t) -> (B, H, T, S_t)
        s = torch.matmul(qg, kt.transpose(-1, -2)).view(b, h, n, -1).float() * scaling
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if allow is not None:
            s = s.masked_fill(~allow[..., t0 : t0 + TILE], float("-inf"))
        part_lse = torch.logsumexp(s, dim=-1)  # (B, H, T)
        weights = torch.exp(s - part_lse.masked_fill(part_lse == float("-inf"), 0.0)[..., None])  # (B, H, T, S_t)
        # (B, H, T, S_t) -> (B, H_kv, G * T, S_t) @ (B, H_kv, S_t, D_v) -> (B, H_kv, G * T, D_v)
        part = torch.matmul(weights.to(vt.dtype).reshape(b, k.shape[1], groups * n, -1), vt)
        part = part.reshape(b, h, n, -1).float()  # (B, H, T, D_v)
        acc, lse = (part, part_lse) if acc is None else _merge(acc, lse, part, part_lse)
    return acc, lse


def _merge(out_a, lse_a, out_b, lse_b):
    """Two partial results over disjoint keys as one: weights ``exp(lse_x - lse)``, ``lse = logaddexp(lse_a,
    lse_b)``; outputs ``(..., T, D_v)``, log-sum-exps ``(..., T)``."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.masked_fill(lse == float("-inf"), 0.0)
    wa, wb = torch.exp(lse_a - safe)[..., None], torch.exp(lse_b - safe)[..., None]  # (..., T, 1)
    return out_a * wa + out_b * wb, lse
