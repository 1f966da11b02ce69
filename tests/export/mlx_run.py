"""Run a folder in mlx-lm (CPU, the weights' dtype) on token ids; a script for the MLX venv, started by
``eval/mlx_parity.py`` with that venv's interpreter (it imports mlx and mlx-lm, nothing of rope-extend's).

    /path/to/mlx-venv/bin/python tests/export/mlx_run.py SPEC.json OUT.json

SPEC: ``{"model": folder, "ids": [...], "new": n}``. OUT: ``logprobs`` (``log p(ids[t+1] | ids[:t+1])`` from one
forward over the ids into mlx-lm's own KV cache), ``greedy`` (``new`` tokens, one per step from that cache, so each
step's rope runs at an offset), ``rope`` (each layer's rope module as mlx-lm built it, as ``[class, inverse
frequencies, scale on q and k]``: what the audit's model of mlx-lm is checked against) and the versions.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path


def rope_of(rope, length: int) -> list:
    """``[class name, inverse frequencies, q/k scale]`` of one mlx-lm rope module, for a sequence of ``length``."""
    import mlx.core as mx
    import numpy as np

    name = type(rope).__name__
    dims = rope.dim if name == "SuScaledRoPE" else rope.dims  # SuScaledRoPE names it dim
    pairs = np.arange(0, dims, 2, dtype=np.float64) / dims
    if name == "RoPE":  # nn.RoPE: positions times ``scale``, frequencies base^(-2i/d)
        return [name, (rope.scale * rope.base**-pairs).tolist(), 1.0]
    if name == "DynamicNTKScalingRoPE":  # its own forward's base at a sequence of ``length`` from offset 0
        n = max(length, rope.max_position_embeddings)
        base = rope.base * ((rope.factor * n / rope.max_position_embeddings) - (rope.factor - 1)) ** (dims / (dims - 2))
        return [name, (base**-pairs).tolist(), 1.0]
    inv = (1.0 / np.array(rope._freqs.astype(mx.float32), dtype=np.float64)).tolist()
    scale = getattr(rope, "mscale", None) or getattr(rope, "_scale", 1.0)
    return [name, inv, float(scale)]


def main(spec_path: str, out_path: str) -> None:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    mx.set_default_device(mx.cpu)
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    model, _ = load_model(Path(spec["model"]))
    ids = spec["ids"]
    cache = make_prompt_cache(model)
    # one forward: the prompt's log-probs, and the cache the greedy steps go on from
    out = model(mx.array([ids]), cache=cache)[0]
    logits = np.array(out.astype(mx.float32), dtype=np.float64)[:-1]
    logits -= logits.max(axis=-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    logprobs = logp[np.arange(len(ids) - 1), ids[1:]].tolist()
    step = out[-1]
    greedy = []
    for _ in range(spec["new"]):
        token = int(mx.argmax(step).item())
        greedy.append(token)
        step = model(mx.array([[token]]), cache=cache)[0, -1]
    rope = [rope_of(layer.self_attn.rope, len(ids)) for layer in model.layers]
    out = {"logprobs": logprobs, "greedy": greedy, "rope": rope, "mlx": version("mlx"), "mlx_lm": version("mlx-lm")}
    Path(out_path).write_text(json.dumps(out), encoding="utf-8")


if __name__ == "__main__":
    main(*sys.argv[1:3])
