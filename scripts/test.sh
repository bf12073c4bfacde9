#!/usr/bin/env bash
# Sets up (idempotently), then builds and runs the whole test suite: the C++ core's
# GoogleTest suite (plain, then under ASan+UBSan), a compile of the CUDA kernels with nvcc
# when it is installed, and the Python tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
PYTHON=${PYTHON:-python3}
JOBS=${MAX_JOBS:-$(nproc)}

core_build() {  # core_build DIR [cmake args...]: the torch-free core and its tests
  local dir=$1; shift
  cmake -S . -B "$dir" -G Ninja -DPAGEDOPTIM_BUILD_PYTHON=OFF -DPAGEDOPTIM_BUILD_TESTS=ON "$@" >/dev/null
  cmake --build "$dir" -j "$JOBS"
}

echo "== C++ tests"
core_build build/cpp
ctest --test-dir build/cpp --output-on-failure -j "$JOBS"

echo "== C++ tests under ASan + UBSan"
core_build build/cpp-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DPAGEDOPTIM_SANITIZE=address;undefined"
ctest --test-dir build/cpp-asan --output-on-failure -j "$JOBS"

# The io engines and the pager run threads of their own.
echo "== C++ tests under TSan"
core_build build/cpp-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPAGEDOPTIM_SANITIZE=thread
ctest --test-dir build/cpp-tsan --output-on-failure -j "$JOBS"

if command -v nvcc >/dev/null 2>&1; then
  echo "== CUDA kernels compile (nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"
  cmake -S . -B build/cuda -G Ninja -DPAGEDOPTIM_BUILD_PYTHON=OFF -DPAGEDOPTIM_WITH_CUDA=ON \
        -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" >/dev/null
  cmake --build build/cuda --target pagedoptim_cuda_kernels -j "$JOBS"
fi

echo "== Python tests"
"$PYTHON" -m pytest -q tests/python
