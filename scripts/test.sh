#!/usr/bin/env bash
# Sets up (idempotently), then builds and runs the whole test suite: the C++ core's
# GoogleTest suite (plain, then under ASan+UBSan and TSan), the full CUDA build against a CUDA
# torch with its PTX lint when nvcc is installed, and the Python tests.
#
# On 2 cores a cold run is mostly compiling and the Python suite, which keeps the CPU busy
# only about two thirds of the time (child processes, ranks meeting, files synced): the
# sanitizer suites run beside the CUDA build and the Python tests, at a lower priority,
# their output kept in build/sanitizer-suites.log and shown at the end.
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

# The plain suite builds in the module's own tree (setup.py's build/, Release like the
# module), so the core libraries the module was just built from are compiled once.
echo "== C++ tests"
module_build=${PAGEDOPTIM_BUILD_DIR:-build}
cmake -S . -B "$module_build" -DPAGEDOPTIM_BUILD_TESTS=ON >/dev/null
cmake --build "$module_build" -j "$JOBS"
ctest --test-dir "$module_build" --output-on-failure -j "$JOBS"

sanitizer_suites() {
  echo "== C++ tests under ASan (with LeakSanitizer) + UBSan"
  core_build build/cpp-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DPAGEDOPTIM_SANITIZE=address;undefined"
  # LeakSanitizer runs with ASan here; said explicitly so that a leak always fails the run.
  ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} ctest --test-dir build/cpp-asan --output-on-failure -j "$JOBS"
  # The io engines and the pager run threads of their own.
  echo "== C++ tests under TSan"
  core_build build/cpp-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPAGEDOPTIM_SANITIZE=thread
  ctest --test-dir build/cpp-tsan --output-on-failure -j "$JOBS"
}
sanitizer_log=build/sanitizer-suites.log
mkdir -p build
# Job control on: the background suites get a process group of their own, so that a failure
# in the foreground stops them (and their compilers) with it.
set -m
( renice -n 10 "$BASHPID" >/dev/null; set -e; sanitizer_suites ) >"$sanitizer_log" 2>&1 &
sanitizers=$!
set +m
trap 'kill -- -"$sanitizers" 2>/dev/null || true' EXIT
echo "== C++ tests under ASan+UBSan and TSan: started beside the rest (output at the end)"

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
python_status=0
"$PYTHON" -m pytest -q -n "$JOBS" tests/python || python_status=$?

sanitizer_status=0
wait "$sanitizers" || sanitizer_status=$?
trap - EXIT
cat "$sanitizer_log"
if [ "$sanitizer_status" -ne 0 ]; then
  echo "== the sanitizer suites failed (exit $sanitizer_status): $sanitizer_log" >&2
fi
[ "$python_status" -eq 0 ] && [ "$sanitizer_status" -eq 0 ]
