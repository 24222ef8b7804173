#!/usr/bin/env bash
# Builds llama.cpp's Python binding for the peer comparisons (perf_report.py, compare_peers.py);
# not a project dependency. On this machine kind, llama-cpp-python 0.3.36 built with
# -march=native (AMX reported) segfaults in its first decode; 0.3.2 built for AVX-512 without the
# native flags runs the SmolLM2 Q4_1 GGUF. Takes a few minutes on 2 cores.
set -euo pipefail
pip install scikit-build-core cmake ninja
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_AVX512=ON -DGGML_OPENMP=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    pip install --no-build-isolation --no-deps llama-cpp-python==0.3.2 diskcache
