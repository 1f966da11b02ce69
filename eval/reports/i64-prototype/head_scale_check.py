"""Issue 64 prototype: TiledFusedLogitsLoss with a trained LM head under a rescaled loss (1 process, no DDP).

    cd eval/reports/i64-prototype && PYTHONPATH=../../..:. /work/venvs/ds/bin/python head_scale_check.py

The loop backpropagates ``loss_sum * processes / tokens``. TiledFusedLogitsLoss runs the head's backward inside its
forward with an incoming gradient of 1 (or 1/shards), and its backward scales only the hidden states' gradient by
the outer gradient: the head's weight gradient misses the factor. rope-extend's ChunkedLinearCrossEntropy scales all.
"""
import json
import warnings

import torch

warnings.filterwarnings("ignore")
from ddp_tiling import build, loss_of  # noqa: E402
from proto_common import lora_grads, make_batch  # noqa: E402

torch.set_num_threads(1)
batch = make_batch(64)
tokens = int((batch["targets"] != -100).sum())
out = {}
for scale_name, scale in (("1", 1.0), ("1/tokens", 1.0 / tokens)):
    g = {}
    for case in ("head", "head_chunked"):
        m = build(case)
        (loss_of(m, batch, case) * scale).backward()
        g[case] = lora_grads(m)
    head_keys = [k for k in g["head"] if "lm_head" in k]
    other = [k for k in g["head"] if "lm_head" not in k]
    out[scale_name] = {
        "lm_head_grad_maxdiff": max(float((g["head"][k] - g["head_chunked"][k]).abs().max()) for k in head_keys),
        "lm_head_grad_max": max(float(g["head_chunked"][k].abs().max()) for k in head_keys),
        "lm_head_ratio_ds_over_chunked": float(g["head"][head_keys[0]].norm() / g["head_chunked"][head_keys[0]].norm()),
        "other_grad_maxdiff": max(float((g["head"][k] - g["head_chunked"][k]).abs().max()) for k in other),
    }
print(json.dumps({"tokens": tokens, **out}, indent=1))
