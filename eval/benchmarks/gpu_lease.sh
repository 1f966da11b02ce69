#!/usr/bin/env bash
# Issue 70's GPU checks in one command that fits one lease of the device tool (15 minutes of device time, the
# machine's start included): each step bounded by what is left of BUDGET seconds, in the order of what matters
# most, its output appended to $OUT/log.txt and its JSON written to $OUT as it goes (a step stopped by its limit
# keeps what it measured). Run from the repository root on the GPU machine:
#
#   OUT=/some/dir BUDGET=540 bash eval/benchmarks/gpu_lease.sh
#
# The machine's image has torch and transformers but not DeepSpeed (TiledMLP): a checkout carries it in .gpu/site
# (see docs/benchmarks.md, "GPU"), put on PYTHONPATH below. Nothing is downloaded.
set -u
OUT=${OUT:-/tmp/gpu-lease}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/.gpu/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
B=eval/benchmarks
T0=$SECONDS
log() { echo "$*" | tee -a "$OUT/log.txt"; }
step() {  # step NAME SECONDS COMMAND...: run COMMAND for at most SECONDS (less if less of BUDGET is left)
    local name=$1 want=$2 left
    shift 2
    left=$((BUDGET - (SECONDS - T0)))
    if ((left < 25)); then
        log "== $name: skipped, $left s of the budget left"
        return
    fi
    local limit=$((want < left ? want : left))
    log "== $name: limit $limit s, started at $((SECONDS - T0)) s"
    timeout -k 5 "$limit" "$@" >>"$OUT/log.txt" 2>&1
    log "== $name: exit $? at $((SECONDS - T0)) s"
}

log "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$OUT/log.txt" 2>&1
$PY -c "import torch, transformers, accelerate, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__,
torch.cuda.get_device_name())" >>"$OUT/log.txt" 2>&1
$PY -c "import deepspeed; print('deepspeed', deepspeed.__version__)" >>"$OUT/log.txt" 2>&1

# 1. the gpu-marked tests (bf16 generation, every method against the CPU)
step tests 75 $PY -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -o addopts="" \
    --junitxml="$OUT/tests.xml"
# 2. prefill and decode of the Llama-3-8B layer shape (2 of its 32 layers: the ratios per layer; the attention
#    methods' passes on torch_tiles dominate), 32k / 64k / 128k
step prefill 190 $PY $B/gpu_scale.py --sections prefill --layers 2 --variants native,yarn,self_extend,string,dual_chunk \
    --decode 16 --worker-timeout 75 --out "$OUT/prefill.json"
# 3. one LoRA step of the whole 32-layer shape: HF + PEFT, rope-extend's chunked loss, and + TiledMLP, 16k and 32k
step train 140 $PY $B/train_scale.py --gpu --variants hf rope rope+tiled_mlp --lengths 16384 --max-tokens 32768 \
    --timeout 60 --out "$OUT/train.json"
# 4. the perplexity harness against model(labels=...) at 128k, 32 layers
step perplexity 90 $PY $B/perplexity_memory.py --gpu --lengths 131072 --repeats 1
# 5. the attention passes' kernel: torch_tiles against aten's flash / efficient kernels and FlexAttention
step passes 75 $PY $B/cuda_passes.py --lengths 32768 --repeats 3 --out "$OUT/passes.json"
# 6. compiled decoding with a static cache, patched against unpatched
step compiled 110 $PY $B/compiled_decode.py --layers 4 --prompt 16384 --new 64 --out "$OUT/compiled.json"
log "== done at $((SECONDS - T0)) s"
