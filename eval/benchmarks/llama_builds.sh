#!/bin/bash
# The two llama-cpp-python 0.3.36 builds that engine_speed.py compares, each installed in a folder of its own:
#
#   bash eval/benchmarks/llama_builds.sh /tmp/llama        # -> /tmp/llama/portable, /tmp/llama/native
#   python eval/benchmarks/engine_speed.py --builds portable=/tmp/llama/portable,native=/tmp/llama/native ...
#
# portable: CI's wheel (.ci/run's flags, GGML_NATIVE=OFF: AVX2, runs on any x86-64 runner), from .ci/run's cache
# when it is there. native: the same flags with GGML_NATIVE=ON (-march=native: AVX-512 and AVX-512 BF16 where the
# CPU has them), cached in native/ beside it: the wheels have the same name, so they never share a folder, and
# pip's wheel cache (keyed by the source, not by CMAKE_ARGS) is bypassed so that one build is never taken for the
# other. Both Release (-O3, scikit-build-core's default) with OpenMP (ggml's default). A build takes 10-40 minutes
# on 2 cores. The native wheel runs only on CPUs with this one's instructions: CI cannot cache or test it.
set -euo pipefail
out=${1:?usage: llama_builds.sh FOLDER}
eng=${ROPE_EXTEND_ENGINES:-$HOME/.cache/rope-extend/engines}
flags="-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF -DMTMD_BUILD=OFF"

wheel() {  # $1: the folder it is cached in, $2: GGML_NATIVE
    if ! ls "$1"/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1; then
        rm -rf "$1.tmp" && mkdir -p "$1.tmp"
        CMAKE_ARGS="$flags -DGGML_NATIVE=$2" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
            python3 -m pip wheel -q --no-cache-dir --no-deps "llama-cpp-python==0.3.36" -w "$1.tmp"
        mkdir -p "$1" && mv "$1.tmp"/llama_cpp_python-0.3.36-*.whl "$1"/ && rm -rf "$1.tmp"
    fi
    ls "$1"/llama_cpp_python-0.3.36-*.whl
}

for kind in portable native; do
    if [ "$kind" = portable ]; then whl=$(wheel "$eng" OFF); else whl=$(wheel "$eng/native" ON); fi
    rm -rf "$out/$kind.tmp"
    python3 -m pip install -q --no-deps --target "$out/$kind.tmp" "$whl" "diskcache>=5.6.1"
    rm -rf "${out:?}/$kind" && mv "$out/$kind.tmp" "$out/$kind"
    echo "$kind: $(PYTHONPATH="$out/$kind" python3 -c 'import llama_cpp; print(llama_cpp.llama_print_system_info().decode())')"
done
