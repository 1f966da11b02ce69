#!/bin/bash
# The memory measurements of DESIGN.md, one after the other (2 cores: never two at once). ~35 minutes here.
cd eval/reports/i64-prototype
export PYTHONPATH=../../..:. OMP_NUM_THREADS=1
PY=/work/venvs/ds/bin/python
LIVE="MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0"
rm -f sp_memory.jsonl
$PY tiling.py --T 1024 2048 4096 --variants hf rope rope+mlp ds_loss ds_loss+mlp --out tiling.json > tiling.log 2>&1
$PY tiling.py --T 8192 16384 --variants rope rope+mlp ds_loss --out tiling_long.json > tiling_long.log 2>&1
for n in 1 2; do
  for mlp in "" "--mlp"; do
    env $LIVE $PY -m torch.distributed.run --nproc_per_node $n sp_memory.py --T 4096 8192 16384 $mlp 2>&1 \
      | grep '^{' >> sp_memory.jsonl
  done
done
