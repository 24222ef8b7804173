#!/usr/bin/env bash
# Builds llama.cpp's Python binding for the peer comparisons (perf_report.py, compare_peers.py);
# not a project dependency. On an AVX-512 + AMX machine, llama-cpp-python 0.3.36 built with
# -march=native segfaulted in its first decode; 0.3.2 built for the CPU's vector extensions
# without the native flags runs the SmolLM2 Q4_1 GGUF. AVX-512 is enabled only where the CPU has
# it (an AMD EPYC with AVX2 alone would stop on an illegal instruction). Takes a few minutes on 2
# cores.
set -euo pipefail
avx512=OFF
grep -qw avx512f /proc/cpuinfo && avx512=ON
pip install scikit-build-core cmake ninja
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_AVX512=$avx512 -DGGML_OPENMP=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    pip install --no-build-isolation --no-deps llama-cpp-python==0.3.2 diskcache
