#!/usr/bin/env bash
# Sets up (idempotently), then builds and runs the whole test suite: the C++ core's
# GoogleTest suite (plain, then under ASan+UBSan and TSan), the full CUDA build against a CUDA
# torch with its PTX lint when nvcc is installed, and the Python tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
PYTHON=${PYTHON:-python3}
JOBS=${MAX_JOBS:-$(nproc)}
# As in setup.sh: the sanitizer and CUDA builds below share ccache entries across checkouts.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}

core_build() {  # core_build DIR [cmake args...]: the torch-free core and its tests
  local dir=$1; shift
  cmake -S . -B "$dir" -G Ninja -DPAGEDOPTIM_BUILD_PYTHON=OFF -DPAGEDOPTIM_BUILD_TESTS=ON "$@" >/dev/null
  cmake --build "$dir" -j "$JOBS"
}

echo "== C++ tests"
core_build build/cpp
ctest --test-dir build/cpp --output-on-failure -j "$JOBS"

echo "== C++ tests under ASan (with LeakSanitizer) + UBSan"
core_build build/cpp-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DPAGEDOPTIM_SANITIZE=address;undefined"
# LeakSanitizer runs with ASan here; said explicitly so that a leak always fails the run.
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} ctest --test-dir build/cpp-asan --output-on-failure -j "$JOBS"

# The io engines and the pager run threads of their own.
echo "== C++ tests under TSan"
core_build build/cpp-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPAGEDOPTIM_SANITIZE=thread
ctest --test-dir build/cpp-tsan --output-on-failure -j "$JOBS"

# No GPU needed: the module is built and linked against a CUDA torch (in its own virtualenv)
# and loaded, and the kernels' PTX is linted for the numerics flags.
if command -v nvcc >/dev/null 2>&1; then
  echo "== Full CUDA build (nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"
  ./scripts/cuda_build_check.sh
fi

# The ISA tests skip an ISA this CPU lacks: say which were compared here, and which run only
# on emulated CPUs (tests/python/test_emulated_cpus.py), whatever CPU this run landed on.
"$PYTHON" -c '
import pagedoptim._C as C
native = [isa for isa in ("avx2", "avx512") if C.cpu_runs_isa(isa)]
absent = [isa for isa in ("avx2", "avx512") if not C.cpu_runs_isa(isa)]
print("== CPU kernel ISAs compared with the baseline natively:", ", ".join(native) or "none",
      "| not on this CPU (their tests skipped):", ", ".join(absent) or "none",
      "| on emulated CPUs in the Python tests: avx2 (qemu Haswell), baseline (qemu Nehalem)")'

# One worker per core: the suite spends much of its time in child processes (ranks, the
# examples, plan's peak measurements) and in imports, which overlap well.
echo "== Python tests"
"$PYTHON" -m pytest -q -n "$JOBS" tests/python
