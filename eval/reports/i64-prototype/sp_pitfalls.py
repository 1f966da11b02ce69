"""Issue 64 prototype: DeepSpeed Ulysses side effects a reversible integration must undo or refuse.

    cd eval/reports/i64-prototype && OMP_NUM_THREADS=1 PYTHONPATH=../../..:. \
        /work/venvs/ds/bin/python -m torch.distributed.run --nproc_per_node 4 sp_pitfalls.py

1. world > kv heads: UlyssesSPAttentionHF sets ``module.num_key_value_groups`` on every attention module, for good.
2. ``register_with_transformers`` replaces ALL_ATTENTION_FUNCTIONS[impl] for the whole process, with no undo, and
   a second call fails (its mpu asserts the group is new).
3. A model run outside the SP context after (1): what happens.
"""

from __future__ import annotations

import json
import warnings

import torch

warnings.filterwarnings("ignore")

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402

from proto_common import make_batch, shard, tiny_model, ulysses  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    report = {"world": world}
    from rope_extend.training.loss import model_loss

    model = tiny_model("yarn")  # 4 heads, 2 kv heads
    attn = model.base_model.model.model.layers[0].self_attn
    report["num_key_value_groups_before"] = attn.num_key_value_groups
    batch = make_batch(64)
    with torch.no_grad():
        full_before, _ = model_loss(model, batch, 16)
    with ulysses(model.config, "sdpa", group):
        model_loss(model, shard(batch, rank, world), 16)
    report["num_key_value_groups_after"] = attn.num_key_value_groups
    try:
        with torch.no_grad():
            full_after, _ = model_loss(model, batch, 16)
        report["full_forward_after_sp"] = f"runs; loss change {abs(float(full_after - full_before)):.3g}"
    except Exception as exc:
        report["full_forward_after_sp"] = f"{type(exc).__name__}: {str(exc)[:200]}"

    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    m2 = tiny_model("yarn")
    UlyssesSPAttentionHF.register_with_transformers(m2, "sdpa", world, 1, seq_length_is_variable=True)
    report["register_replaces_sdpa_globally"] = ALL_ATTENTION_FUNCTIONS["sdpa"] is not before
    try:
        UlyssesSPAttentionHF.register_with_transformers(m2, "sdpa", world, 1, seq_length_is_variable=True)
        report["second_register"] = "ok"
    except BaseException as exc:  # noqa: BLE001
        report["second_register"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    if rank == 0:
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
