set -x
O="max_steps=3 logging_steps=1 save_steps=3 overwrite_output_dir=true"
start=$(date +%s)
OMP_NUM_THREADS=2 python -m rope_extend train smollm2-135m-32k $O output_dir=/tmp/real-sp/one > one.log 2>&1
echo "one rc=$? $(( $(date +%s)-start ))s"
start=$(date +%s)
OMP_NUM_THREADS=1 ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 3 -m rope_extend train smollm2-135m-32k $O parallel.sequence=3 memory.tiled_mlp=true output_dir=/tmp/real-sp/three > three.log 2>&1
echo "three rc=$? $(( $(date +%s)-start ))s"
