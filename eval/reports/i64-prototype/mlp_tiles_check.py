"""Issue 64 prototype: DeepSpeed TiledMLP (4 tiles) vs the plain MLP, 1 process, LoRA on q/k/v/o and gate/up/down.

    cd eval/reports/i64-prototype && PYTHONPATH=../../..:. /work/venvs/ds/bin/python mlp_tiles_check.py
"""
import json
import warnings

import torch

warnings.filterwarnings("ignore")
from ddp_tiling import build  # noqa: E402
from proto_common import lora_grads, make_batch  # noqa: E402
from rope_extend.hf import checkpointing  # noqa: E402
from rope_extend.training.loss import model_loss  # noqa: E402
from tiling import tiled_mlp  # noqa: E402

torch.set_num_threads(1)
batch = make_batch(64)
rows = []
for ckpt in (False, True):
    g = {}
    for tiles in (None, 4, 7):
        m = build("plain_mlp_lora")
        if tiles:
            tiled_mlp(m, tiles=tiles)
        if ckpt:
            checkpointing.enable(m)
        loss, _ = model_loss(m, batch, 16)
        (loss / 63).backward()
        g[tiles] = (float(loss), lora_grads(m))
    for tiles in (4, 7):
        rows.append({"checkpointing": ckpt, "tiles": tiles, "loss_diff": abs(g[tiles][0] - g[None][0]),
                     "grad_maxdiff": max(float((g[tiles][1][k] - g[None][1][k]).abs().max()) for k in g[None][1])})
print(json.dumps(rows))
