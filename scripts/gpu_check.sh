#!/usr/bin/env bash
# The one prepared check of the GPU path, for a lent GPU machine (docs/gpu.md): versions, a
# build for the present architecture, compute-sanitizer's memcheck over quick cases, the GPU
# tests, the GPU benchmarks, FSDP2 on NCCL, leaks. A lease gives one command of about 8
# minutes, cold: by default the run fits in 420 s (--budget), so a call with timeout_s=480
# leaves it a minute of slack for start-up and the copy back.
#
#   bash scripts/gpu_check.sh [RESULTS_DIR] [options]
#
# RESULTS_DIR defaults to $OUT, else ./gpu-results. It receives (a lease returns at most eight
# files, two folders down), each written as its part runs:
#   gpu_check.log      everything every part printed, in order
#   summary.json       versions, each part's status and seconds, test counts, benchmark targets;
#                      rewritten after every part, and when the run is interrupted
#   tests-junit.xml    the GPU tests, one entry per test (also for a part stopped at its limit)
#   bench.jsonl        benchmarks/gpu_step.py's JSON lines
#   paging.jsonl       benchmarks/gpu_paging.py's JSON lines (link, offloaded step, 1B, 8B)
#   fsdp2.jsonl        examples/fsdp2.py on NCCL at world size 1: one JSON line per run
#   prebuilt/_C*.so    the module the build part built (gzipped past 15 MiB): a retry that
#                      changes only Python reuses it with --prebuilt, skipping the build
#   peers.jsonl        benchmarks/peers.py --device cuda's JSON lines (only with --peers)
#
# Options:
#   --only a,b       run only these parts (in their fixed order)
#   --with a,b       add optional parts to the default ones; --NAME does the same for one part
#   --skip a,b       leave these parts out
#   --budget S       seconds for the whole run (default 420). Each part gets what is left, up
#                    to its own limit, less the least time of the required parts after it; a
#                    part that would get less than its own least time is skipped
#   --prebuilt DIR   the build part takes the module in DIR (a results folder's prebuilt/) in
#                    place of a build, if it imports here with its CUDA kernels
#   --no-large       leave out the tests named *large* (the 2**31-element span, ~18 GB)
#   --quick          a smoke run: quick benchmark, no large tests
#   --dry-run        walk every part on a machine without a GPU (CI): stand-ins for
#                    nvidia-smi, nvcc and compute-sanitizer must be on the PATH, the build is
#                    --prebuilt's CPU module, the tests run on the simulated device and the
#                    scripts in their CPU modes. Nothing it prints is a GPU result.
#   --list           list the parts and exit
#
# Parts, in their order (default: all but racecheck, initcheck and peers). Each runs under its
# own `timeout`, which stops it with SIGINT (then SIGKILL 20 s later), so pytest still writes
# its junit and tracebacks and the benchmarks keep the lines they printed; a failure does not
# stop the run, and parts that need the build are skipped when the build failed:
#   versions   nvidia-smi, nvcc, compute-sanitizer, python, torch, the device and its arch
#   build      PAGEDOPTIM_WITH_CUDA=1 pip install -e . for this GPU's architecture only (or
#              --prebuilt); the module is copied to RESULTS_DIR/prebuilt
#   sanitize   compute-sanitizer memcheck over scripts/gpu_sanitize_cases.py --quick, before
#              the tests: a kernel fault is named here, by the kernel, before it floods them
#   tests      pytest -v -rfE tests/python/test_cuda_step.py, test_cuda_paging.py,
#              test_device_dispatch.py (faulthandler dumps a hung test's stacks)
#   bench      benchmarks/gpu_step.py
#   paging     benchmarks/gpu_paging.py: link bandwidth, offloaded step, 1B and 8B training
#   fsdp2      examples/fsdp2.py with CUDA params on NCCL, world size 1: FSDP2 steps, a DCP
#              save half-way and a resume that must end bit for bit (8-bit, and offload=host)
#   leaks      scripts/gpu_leak_check.py: create/step/close cycles per configuration
#              (resident, offload host, offload nvme) leave torch.cuda.memory_allocated
#              exact, descriptors exact, and RSS (pinned cudaHostAlloc memory) flat
#   synccheck  compute-sanitizer synccheck over the quick cases (only if time is left)
#   racecheck  compute-sanitizer racecheck (optional: no kernel uses shared memory today)
#   initcheck  compute-sanitizer initcheck, quick cases (optional)
#   peers      benchmarks/peers.py --device cuda (optional: --peers): ours next to torch,
#              bitsandbytes (paged too), torchao (CPU offload too) and flashoptim, with a
#              memory-pressure workload; peers are installed from $PAGEDOPTIM_PEER_WHEELS
#              (default shared/wheels, see docs/comparison.md), else reported skipped
# compute-sanitizer refuses gVisor machines (the H200 kind: kernel 4.4.0): there the sanitizer
# parts are reported UNAVAILABLE at once and do not count against the run.
# A new check is added as a part by writing a function part_NAME (it gets its time limit in seconds
# as $1 and returns 0 for pass, 3 when the machine cannot run it) and registering it below
# with register_part; `--NAME` then selects it (e.g. --peers).
#
# Environment: PAGEDOPTIM_GPU_CHECK_BUDGET (the default --budget), PAGEDOPTIM_GPU_CHECK_LIMITS
# ("part=seconds,..." overrides parts' limits), PAGEDOPTIM_GPU_CHECK_GVISOR (1/0: whether to
# treat the machine as gVisor; default: kernel 4.4.0), PAGEDOPTIM_CUDA_ARCHS, CUDACXX, MAX_JOBS.
#
# Exit status: 0 when every selected part passed; 1 when one failed or timed out; 2 when none
# failed but a required part could not run (no time left, or its tool refused the machine);
# 130 when the run was interrupted (summary.json says where).

# The part_* functions are called through "part_$name".
# shellcheck disable=SC2317
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1

PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# The lent machine reaches no package index: pip must not try to.
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# -- the parts ------------------------------------------------------------------------------

ALL_PARTS=()
declare -A PART_LIMIT PART_MIN PART_DEFAULT PART_NEEDS_BUILD PART_IF_TIME PART_DOC

# register_part NAME LIMIT_S MIN_S DEFAULT(1|0) NEEDS_BUILD(1|0) IF_TIME(1|0) DESCRIPTION
# IF_TIME=1: a part skipped for lack of time does not make the run incomplete, and no earlier
# part gives up time for it.
register_part() {
  ALL_PARTS+=("$1")
  PART_LIMIT[$1]=$2; PART_MIN[$1]=$3; PART_DEFAULT[$1]=$4; PART_NEEDS_BUILD[$1]=$5
  PART_IF_TIME[$1]=$6; PART_DOC[$1]=$7
}
# Limits for an H100 with 16 cores, cold (docs/gpu.md): their sum is more than the budget on
# purpose, since a part that ends early leaves its time to the next.
register_part versions   30   5 1 0 0 "nvidia-smi, nvcc, compute-sanitizer, python, torch, device"
register_part build     240  60 1 0 0 "pip install -e . with the CUDA kernels for this GPU"
register_part sanitize   75  30 1 1 0 "compute-sanitizer memcheck over the quick cases"
register_part tests     150  40 1 1 0 "pytest tests/python/test_cuda_step.py, test_cuda_paging.py"
register_part bench      60  20 1 1 0 "benchmarks/gpu_step.py"
register_part paging     75  25 1 1 0 "benchmarks/gpu_paging.py: link, offloaded step, 1B, 8B"
register_part fsdp2      50  20 1 1 0 "examples/fsdp2.py on NCCL, world size 1, DCP resume"
register_part leaks      40  15 1 1 0 "scripts/gpu_leak_check.py: create/step/close cycles"
register_part synccheck  60  30 1 1 1 "compute-sanitizer synccheck, quick cases"
register_part racecheck  90  40 0 1 1 "compute-sanitizer racecheck, quick cases"
register_part initcheck  90  40 0 1 1 "compute-sanitizer initcheck, quick cases"
register_part peers     300  60 0 1 1 "benchmarks/peers.py --device cuda: torch, ours, bnb, torchao, flashoptim"

find_nvcc() {
  local c
  for c in "${CUDACXX:-}" "$(command -v nvcc 2>/dev/null)" "${CUDA_HOME:-/nonexistent}/bin/nvcc" \
           /usr/local/cuda/bin/nvcc; do
    if [ -n "$c" ] && [ -x "$c" ]; then echo "$c"; return 0; fi
  done
  return 1
}

find_sanitizer() {
  local c nvcc_dir=""
  [ -n "$NVCC" ] && nvcc_dir=$(dirname "$NVCC")
  for c in "$(command -v compute-sanitizer 2>/dev/null)" "$nvcc_dir/compute-sanitizer" \
           "$nvcc_dir/../compute-sanitizer/compute-sanitizer" \
           /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    if [ -n "$c" ] && [ -x "$c" ]; then echo "$c"; return 0; fi
  done
  return 1
}

# gVisor reports kernel 4.4.0, and compute-sanitizer refuses its devices.
on_gvisor() {
  case ${PAGEDOPTIM_GPU_CHECK_GVISOR:-} in
    1) return 0 ;;
    0) return 1 ;;
  esac
  [ "$(uname -r)" = 4.4.0 ]
}

# limited LIMIT COMMAND...: runs COMMAND for at most LIMIT seconds, then stops it with SIGINT
# (pytest writes its junit, a benchmark keeps its lines) and kills it 20 s later.
limited() {
  local limit=$1; shift
  timeout -s INT --kill-after=20 "$limit" "$@"
}

part_versions() {
  local limit=$1
  echo "-- nvidia-smi"
  if command -v nvidia-smi >/dev/null 2>&1; then
    local fields=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm,clocks.mem
    timeout 20 nvidia-smi --query-gpu="$fields,temperature.gpu,power.draw" --format=csv
    timeout 20 nvidia-smi -L
  else
    echo "nvidia-smi not found"
  fi
  echo "-- toolchain"
  if [ -n "$NVCC" ]; then "$NVCC" --version | tail -2; else echo "nvcc not found"; fi
  if [ -n "$SANITIZER" ]; then "$SANITIZER" --version | head -3; else echo "compute-sanitizer not found"; fi
  cmake --version 2>/dev/null | head -1; echo "ninja $(ninja --version 2>/dev/null)"
  "${CXX:-c++}" --version 2>/dev/null | head -1
  ldconfig -p 2>/dev/null | grep -q liburing && echo "liburing: present" || echo "liburing: absent"
  echo "kernel $(uname -r)$(on_gvisor && echo ' (gVisor: compute-sanitizer is refused here)')"
  echo "-- python"
  limited "$limit" "$PYTHON" - "$WORK/versions.json" "$DRY_RUN" <<'EOF'
import importlib.metadata as md, json, os, platform, subprocess, sys
import torch
info = {"python": platform.python_version(), "executable": sys.executable,
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count(),
        "dry_run": sys.argv[2] == "1",
        "torch_arch_list": torch.cuda.get_arch_list() if torch.cuda.is_available() else []}
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                multiprocessors=props.multi_processor_count, memory_bytes=props.total_memory,
                device_count=torch.cuda.device_count())
for name in ("transformers", "peft", "pytest", "pytest-timeout", "setuptools", "pybind11"):
    try:
        info[name] = md.version(name)
    except md.PackageNotFoundError:
        info[name] = None
try:
    info["git"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                 timeout=10).stdout.strip() or None
except Exception:
    info["git"] = None
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info))
sys.exit(0 if info["cuda_available"] or info["dry_run"] else 1)
EOF
}

# The module pagedoptim imports, checked from outside the checkout: CUDA kernels built in
# (or, in a dry run, any module), and where it is.
check_module() {
  (cd /tmp && timeout 60 "$PYTHON" - "$DRY_RUN" <<'EOF'
import json, sys
import torch
import pagedoptim, pagedoptim._C as C
info = {"module": C.__file__, "cuda_built": C.cuda_built(), "cuda_version": C.cuda_version(),
        "cpu_isa": C.cpu_isa() if hasattr(C, "cpu_isa") else None}
print(json.dumps(info))
sys.exit(0 if info["cuda_built"] or sys.argv[1] == "1" else 1)
EOF
  )
}

# Copies the module that check_module found to RESULTS/prebuilt (gzipped when it would not
# come back from a lease whole: 16 MiB a file).
save_module() {
  local so
  so=$(cd /tmp && "$PYTHON" -c "import pagedoptim._C as C; print(C.__file__)") || return 1
  mkdir -p "$RESULTS/prebuilt"
  rm -f "$RESULTS"/prebuilt/_C*
  if [ "$(stat -c %s "$so")" -gt $((15 << 20)) ]; then
    gzip -c "$so" >"$RESULTS/prebuilt/$(basename "$so").gz"
  else
    cp "$so" "$RESULTS/prebuilt/"
  fi
  echo "-- saved $(ls "$RESULTS"/prebuilt/) for --prebuilt"
}

part_build() {
  local limit=$1
  if [ -n "$PREBUILT_PKG" ]; then
    echo "-- the prebuilt module from $PREBUILT (no build): $PREBUILT_PKG/pagedoptim"
    check_module || return 1
    save_module
    return
  fi
  if [ "$DRY_RUN" = 1 ]; then
    echo "dry run: the stand-in nvcc builds nothing; give --prebuilt DIR with a module"
    return 1
  fi
  if [ -z "$NVCC" ]; then echo "no nvcc: set CUDACXX or put nvcc on PATH"; return 1; fi
  local arch=${PAGEDOPTIM_CUDA_ARCHS:-}
  if [ -z "$arch" ]; then
    arch=$("$PYTHON" -c "import torch; M, m = torch.cuda.get_device_capability(); print(f'{M}{m}')") \
      || { echo "could not read the device's compute capability"; return 1; }
  fi
  local cmake_args=${PAGEDOPTIM_CMAKE_ARGS:-}
  # liburing is absent on the lent machine; the build would fall back with a warning, this
  # says so up front.
  if [[ $cmake_args != *PAGEDOPTIM_WITH_IO_URING* ]] && ! ldconfig -p 2>/dev/null | grep -q liburing; then
    cmake_args="$cmake_args -DPAGEDOPTIM_WITH_IO_URING=OFF"
  fi
  local build_dir="$ROOT/build/gpu-sm$arch"
  echo "-- building for sm_$arch with $NVCC into $build_dir (cmake args:$cmake_args)"
  PAGEDOPTIM_WITH_CUDA=1 PAGEDOPTIM_CUDA_ARCHS="$arch" PAGEDOPTIM_BUILD_DIR="$build_dir" \
    PAGEDOPTIM_CMAKE_ARGS="$cmake_args" CUDACXX="$NVCC" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
    limited "$((limit - 20))" "$PYTHON" -m pip install --no-build-isolation --no-deps -v -e . \
    || return $?
  echo "-- the installed module, imported from outside the checkout"
  check_module || return 1
  save_module
}

part_tests() {
  local limit=$1
  local files=(tests/python/test_cuda_step.py tests/python/test_cuda_paging.py)
  [ -f tests/python/test_device_dispatch.py ] && files+=(tests/python/test_device_dispatch.py)
  # -v: one line per test as it ends, so a part stopped at its limit still says how far it
  # got; faulthandler_timeout: a test hung for a minute dumps every thread's stack.
  local args=(-v -rfE -p no:cacheprovider -o faulthandler_timeout=60
              -o junit_family=xunit1 --junitxml="$RESULTS/tests-junit.xml")
  if "$PYTHON" -c "import pytest_timeout" >/dev/null 2>&1; then
    args+=(--timeout=120)
  fi
  if [ "$QUICK" = 1 ]; then
    args+=(-k "not large and not tiny_llama")
  elif [ "$LARGE" != 1 ]; then
    args+=(-k "not large")
  fi
  echo "-- pytest ${args[*]} ${files[*]}"
  limited "$limit" "$PYTHON" -m pytest "${args[@]}" "${files[@]}"
  local rc=$?
  "$PYTHON" - "$RESULTS/tests-junit.xml" "$WORK/tests.json" "$DRY_RUN" <<'EOF' || { [ "$rc" = 0 ] && rc=1; }
import json, sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as error:
    print(f"no junit report: {error}")
    sys.exit(0)
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
# The GPU tests proper: if every one of them was skipped, nothing ran on the GPU.
gpu = [case for case in root.iter("testcase")
       if any(m in case.get("classname", "") for m in ("test_cuda_step", "test_cuda_paging"))]
counts["gpu_tests"] = len(gpu)
counts["gpu_skipped"] = sum(1 for case in gpu if case.find("skipped") is not None)
counts["target"] = "simulated" if sys.argv[3] == "1" else "cuda"
json.dump(counts, open(sys.argv[2], "w"))
print("-- counts", json.dumps(counts))
if counts["gpu_tests"] == 0 or counts["gpu_skipped"] == counts["gpu_tests"]:
    print("every test of test_cuda_step.py was skipped: the GPU path was not exercised")
    sys.exit(1)
EOF
  return "$rc"
}

# run_sanitizer TOOL LIMIT [case-script args...]: 0 clean, 3 the tool refused the machine.
run_sanitizer() {
  local tool=$1 limit=$2; shift 2
  if on_gvisor; then echo "$tool: skipped, compute-sanitizer refuses gVisor's devices"; return 3; fi
  if [ -z "$SANITIZER" ]; then echo "compute-sanitizer not found next to nvcc or on PATH"; return 3; fi
  local filter=() api=() candidate
  # Options differ between versions: each is tried on a program without CUDA first, so a
  # spelling this version does not know costs nothing but the option.
  sanitizer_accepts() { timeout 30 "$SANITIZER" --tool "$tool" "$@" /bin/true >/dev/null 2>&1; }
  # Only our kernels are instrumented: torch's own would cost minutes and prove nothing here.
  for candidate in "--kernel-name kns=pagedoptim" "--filter kns=pagedoptim"; do
    # shellcheck disable=SC2086  # the candidate is two words on purpose
    if sanitizer_accepts $candidate; then read -r -a filter <<<"$candidate"; break; fi
  done
  # API errors that torch provokes and handles itself (probing calls) are not ours; our own
  # launches are checked by the extension, synchronously in debug mode.
  sanitizer_accepts --report-api-errors no && api=(--report-api-errors no)
  local out="$WORK/sanitize-$tool.out" cases=(--quick)
  [ "$DRY_RUN" = 1 ] && cases+=(--simulated)
  echo "-- $tool: $SANITIZER --tool $tool ${filter[*]} ${api[*]}"
  # No caching allocator: each tensor (each page slab too) is its own allocation, so an access
  # past its end is outside any allocation and memcheck sees it.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 PAGEDOPTIM_CUDA_DEBUG_SYNC=1 \
    limited "$limit" "$SANITIZER" --tool "$tool" --error-exitcode 86 \
    --print-limit 20 "${filter[@]}" "${api[@]}" "$PYTHON" scripts/gpu_sanitize_cases.py \
    "${cases[@]}" 2>&1 | tee "$out"
  local rc=${PIPESTATUS[0]}
  if grep -q -e "Device not supported" -e "not supported on this platform" "$out"; then
    echo "$tool: compute-sanitizer refused this machine (some sandboxes, gVisor for one, do)"
    return 3
  fi
  if grep -q '"skipped"' "$out"; then echo "$tool: the cases were skipped"; return 1; fi
  grep -h "ERROR SUMMARY" "$out" | tail -1
  return "$rc"
}

part_sanitize() { run_sanitizer memcheck "$1"; }
part_synccheck() { run_sanitizer synccheck "$1"; }
part_racecheck() { run_sanitizer racecheck "$1"; }
part_initcheck() { run_sanitizer initcheck "$1"; }

# Runs a benchmark script with its JSON lines into $RESULTS/OUT as they come; a "skipped"
# line (no GPU, no CUDA kernels) fails the part.
run_json_bench() {
  local limit=$1 script=$2 out=$3; shift 3
  local args=("$@")
  [ "$QUICK" = 1 ] && args+=(--quick)
  limited "$limit" "$PYTHON" "$script" "${args[@]}" | tee "$RESULTS/$out"
  local rc=${PIPESTATUS[0]}
  if grep -q '"skipped"' "$RESULTS/$out"; then echo "$script: skipped"; return 1; fi
  return "$rc"
}

part_bench() {
  local harness=()
  [ "$DRY_RUN" = 1 ] && harness=(--device cpu --params 1M --lora-groups 1 --copy-mib 16
                                 --repeats 2 --block 2)
  run_json_bench "$1" benchmarks/gpu_step.py bench.jsonl "${harness[@]}"
}

part_paging() {
  local harness=()
  [ "$DRY_RUN" = 1 ] && harness=(--device cpu --quick)
  run_json_bench "$1" benchmarks/gpu_paging.py paging.jsonl "${harness[@]}"
}

# FSDP2 with CUDA params: one process is a mesh of one on NCCL. Every line must come from a
# CUDA device on NCCL (gloo and the CPU in a dry run) and resume from its DCP checkpoint bit
# for bit.
part_fsdp2() {
  local limit=$1 out="$RESULTS/fsdp2.jsonl" rc=0 flags
  : >"$out"
  for flags in "" "--offload host"; do
    # shellcheck disable=SC2086
    limited $(( limit / 2 )) "$PYTHON" examples/fsdp2.py --nproc 1 --steps 8 $flags \
      | tee -a "$out"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
  "$PYTHON" - "$out" "$DRY_RUN" <<'EOF' || rc=1
import json, sys
lines = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
backend, device = ("gloo", "cpu") if sys.argv[2] == "1" else ("nccl", "cuda")
bad = [line for line in lines if not (line["resumed_matches"] and line["backend"] == backend
                                      and line["device"].startswith(device))]
print(f"-- fsdp2: {len(lines)} runs, {len(bad)} not on {device}/{backend} or not resumed exactly")
sys.exit(1 if bad or len(lines) != 2 else 0)
EOF
  return "$rc"
}

part_leaks() {
  local args=()
  [ "$DRY_RUN" = 1 ] && args=(--simulated --cycles 3)
  limited "$1" "$PYTHON" scripts/gpu_leak_check.py "${args[@]}"
}

# The peers of docs/comparison.md. The lent machine reaches no index, so their wheels travel
# with the working tree (pip download on a machine that has one; docs/comparison.md has the
# command). --no-deps keeps the installed CUDA torch (and its triton, which flashoptim needs).
# A peer whose wheel is not there stays uninstalled and peers.py prints it as skipped with the
# reason, which does not fail the part: only peers.py failing or measuring nothing does.
part_peers() {
  local limit=$1 wheels=${PAGEDOPTIM_PEER_WHEELS:-$ROOT/shared/wheels} pkg args=(--device cuda)
  [ "$QUICK" = 1 ] && args+=(--quick)
  if [ -d "$wheels" ]; then
    for pkg in bitsandbytes torchao flashoptim; do
      if ls "$wheels"/"$pkg"-*.whl >/dev/null 2>&1; then
        echo "-- installing $pkg from $wheels"
        timeout 120 "$PYTHON" -m pip install -q --no-index --no-deps --find-links "$wheels" "$pkg" \
          || echo "-- $pkg did not install from $wheels"
      else
        echo "-- no $pkg wheel in $wheels"
      fi
    done
  else
    echo "-- no wheel folder $wheels: the peers not installed here are reported skipped"
  fi
  limited "$(( limit - 30 ))" "$PYTHON" benchmarks/peers.py "${args[@]}" \
    | tee "$RESULTS/peers.jsonl"
  local rc=${PIPESTATUS[0]}
  grep -q '"benchmark": "peers_throughput"' "$RESULTS/peers.jsonl" || { echo "peers.py measured nothing"; return 1; }
  return "$rc"
}

# -- options --------------------------------------------------------------------------------

usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }

RESULTS=${OUT:-./gpu-results}
BUDGET=${PAGEDOPTIM_GPU_CHECK_BUDGET:-420}
LARGE=1
QUICK=0
DRY_RUN=0
PREBUILT=""
ONLY=""
WITH=""
SKIP=""

is_part() { local p; for p in "${ALL_PARTS[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }

results_given=0
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --list) for p in "${ALL_PARTS[@]}"; do
              optional=""; [ "${PART_DEFAULT[$p]}" = 1 ] || optional=" (optional)"
              printf '%-10s %s%s\n' "$p" "${PART_DOC[$p]}" "$optional"
            done; exit 0 ;;
    --only) ONLY=${2:?--only needs a list}; shift ;;
    --only=*) ONLY=${1#*=} ;;
    --with) WITH="$WITH,${2:?--with needs a list}"; shift ;;
    --with=*) WITH="$WITH,${1#*=}" ;;
    --skip) SKIP="$SKIP,${2:?--skip needs a list}"; shift ;;
    --skip=*) SKIP="$SKIP,${1#*=}" ;;
    --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
    --budget=*) BUDGET=${1#*=} ;;
    --prebuilt) PREBUILT=${2:?--prebuilt needs a folder}; shift ;;
    --prebuilt=*) PREBUILT=${1#*=} ;;
    --no-large) LARGE=0 ;;
    --quick) QUICK=1; LARGE=0 ;;
    --dry-run) DRY_RUN=1 ;;
    --*) if is_part "${1#--}"; then
           WITH="$WITH,${1#--}"
         else
           echo "unknown option $1" >&2; usage >&2; exit 64
         fi ;;
    *) if [ "$results_given" = 1 ]; then echo "one results folder only, got $1" >&2; exit 64; fi
       RESULTS=$1; results_given=1 ;;
  esac
  shift
done
[[ $BUDGET =~ ^[0-9]+$ ]] || { echo "--budget must be whole seconds, got $BUDGET" >&2; exit 64; }

# PAGEDOPTIM_GPU_CHECK_LIMITS="tests=30,bench=20": limits other than the registered ones.
IFS=, read -r -a limit_overrides <<<"${PAGEDOPTIM_GPU_CHECK_LIMITS:-}"
for entry in "${limit_overrides[@]}"; do
  [ -n "$entry" ] || continue
  name=${entry%%=*} value=${entry#*=}
  if ! is_part "$name" || ! [[ $value =~ ^[0-9]+$ ]]; then
    echo "PAGEDOPTIM_GPU_CHECK_LIMITS: '$entry' is not part=seconds (see --list)" >&2; exit 64
  fi
  PART_LIMIT[$name]=$value
  (( PART_MIN[$name] > value )) && PART_MIN[$name]=$value
done

in_list() { [[ ",$2," == *",$1,"* ]]; }
SELECTED=()
for p in "${ALL_PARTS[@]}"; do
  if [ -n "$ONLY" ]; then in_list "$p" "$ONLY" || continue
  elif [ "${PART_DEFAULT[$p]}" != 1 ] && ! in_list "$p" "$WITH"; then continue; fi
  in_list "$p" "$SKIP" && continue
  SELECTED+=("$p")
done
for p in ${ONLY//,/ } ${WITH//,/ } ${SKIP//,/ }; do
  is_part "$p" || { echo "unknown part '$p' (see --list)" >&2; exit 64; }
done
[ ${#SELECTED[@]} -gt 0 ] || { echo "no parts selected" >&2; exit 64; }

mkdir -p "$RESULTS" || exit 1
RESULTS=$(cd "$RESULTS" && pwd)
LOG="$RESULTS/gpu_check.log"
: >"$LOG"
rm -f "$RESULTS/summary.json"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
NVCC=$(find_nvcc || true)
SANITIZER=$(find_sanitizer || true)

say() { echo "$*" | tee -a "$LOG"; }

if [ "$DRY_RUN" = 1 ]; then
  # The GPU test modules run on the simulated device; the scripts take their CPU modes.
  export PAGEDOPTIM_GPU_TARGET=simulated
fi

# --prebuilt: the checkout's Python package next to the prebuilt module, in a folder of its
# own first on PYTHONPATH. The checkout's own module is never overwritten (a process may have
# it mapped), and nothing is built.
PREBUILT_PKG=""
if [ -n "$PREBUILT" ]; then
  so=$(ls "$PREBUILT"/_C*.so "$PREBUILT"/_C*.so.gz 2>/dev/null | head -1)
  [ -n "$so" ] || { echo "--prebuilt $PREBUILT holds no _C*.so or _C*.so.gz" >&2; exit 64; }
  PREBUILT_PKG="$WORK/prebuilt"
  mkdir -p "$PREBUILT_PKG"
  cp -r python/pagedoptim "$PREBUILT_PKG/"
  rm -f "$PREBUILT_PKG"/pagedoptim/_C*.so
  case $so in
    *.gz) gunzip -c "$so" >"$PREBUILT_PKG/pagedoptim/$(basename "${so%.gz}")" ;;
    *) cp "$so" "$PREBUILT_PKG/pagedoptim/" ;;
  esac
  export PYTHONPATH="$PREBUILT_PKG${PYTHONPATH:+:$PYTHONPATH}"
fi

# -- the run --------------------------------------------------------------------------------

START=$(date +%s)
DEADLINE=$((START + BUDGET))
declare -A STATUS SECONDS_TAKEN NOTE
CURRENT=""
PART_PID=""
say "gpu_check: parts ${SELECTED[*]}; budget ${BUDGET}s; results in $RESULTS$( [ "$DRY_RUN" = 1 ] && echo "; DRY RUN: no GPU result")"

# Writes summary.json from what is known now: after every part, and when interrupted.
write_summary() {
  local exit_status=$1 table="$WORK/parts.tsv" part
  : >"$table"
  for part in "${SELECTED[@]}"; do
    printf '%s\t%s\t%s\t%s\n' "$part" "${STATUS[$part]:-NOT_RUN}" "${SECONDS_TAKEN[$part]:-0}" \
      "${NOTE[$part]:-}" >>"$table"
  done
  "$PYTHON" - "$table" "$WORK" "$RESULTS" "$BUDGET" "$(( $(date +%s) - START ))" \
    "$exit_status" "$DRY_RUN" <<'EOF' 2>>"$LOG" || say "summary.json could not be written (see the log)"
import json, os, sys
table, work, results, budget, elapsed, status, dry_run = sys.argv[1:8]


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


parts = []
for line in open(table):
    name, state, seconds, note = line.rstrip("\n").split("\t")
    parts.append({"part": name, "status": state, "seconds": int(seconds), "note": note})
bench, targets, paging, paging_targets, fsdp2 = [], None, [], None, []
for name, records in (("bench.jsonl", bench), ("paging.jsonl", paging),
                      ("fsdp2.jsonl", fsdp2)):
    try:
        for line in open(os.path.join(results, name)):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            records.append(record)
            if record.get("benchmark") == "gpu_targets":
                targets = record
            if record.get("bench") == "gpu_paging_targets":
                paging_targets = record
    except OSError:
        pass
summary = {"exit_status": None if status == "" else int(status), "dry_run": dry_run == "1",
           "budget_s": int(budget), "elapsed_s": int(elapsed), "parts": parts,
           "versions": load(os.path.join(work, "versions.json")),
           "tests": load(os.path.join(work, "tests.json")), "bench_targets": targets,
           "bench": bench, "paging_targets": paging_targets, "paging": paging,
           "fsdp2": fsdp2}
path = os.path.join(results, "summary.json")
with open(path + ".tmp", "w") as f:
    json.dump(summary, f, indent=1)
os.replace(path + ".tmp", path)
EOF
}

# The `timeout` processes among the descendants of process $1.
timeouts_under() {
  ps -e -o pid=,ppid=,comm= | awk -v root="$1" '
    { parent[$1] = $2; name[$1] = $3 }
    END {
      for (pid in parent) {
        for (p = parent[pid]; p != "" && p != 0 && p != 1; p = parent[p]) {
          if (p == root) { if (name[pid] == "timeout") print pid; break }
        }
      }
    }'
}

# A SIGINT or SIGTERM to the run (a lease ending, Ctrl-C): the running part is stopped as its
# limit would stop it, and summary.json says where the run was.
on_signal() {
  trap '' INT TERM
  say "== interrupted during ${CURRENT:-no part}"
  if [ -n "$PART_PID" ]; then
    # The part's `timeout`s get SIGINT and pass it on to their commands, as at a limit. (Not
    # the process group: the caller of this script may share it.)
    local pid
    for pid in $(timeouts_under "$PART_PID"); do kill -INT "$pid" 2>/dev/null; done
    local waited=0
    while kill -0 "$PART_PID" 2>/dev/null && (( waited < 25 )); do sleep 1; waited=$((waited + 1)); done
    kill -KILL "$PART_PID" 2>/dev/null
  fi
  if [ -n "$CURRENT" ]; then
    STATUS[$CURRENT]=INTERRUPTED; NOTE[$CURRENT]="the run was interrupted"
    SECONDS_TAKEN[$CURRENT]=$(( $(date +%s) - PART_T0 ))
  fi
  write_summary 130
  exit 130
}
trap on_signal INT TERM

# The least time the required parts after position $1 of SELECTED need.
reserve_after() {
  local i total=0
  for (( i = $1 + 1; i < ${#SELECTED[@]}; i++ )); do
    local p=${SELECTED[$i]}
    [ "${PART_IF_TIME[$p]}" = 1 ] || total=$(( total + PART_MIN[$p] ))
  done
  echo "$total"
}

for index in "${!SELECTED[@]}"; do
  part=${SELECTED[$index]}
  now=$(date +%s)
  left=$((DEADLINE - now - 5))
  limit=${PART_LIMIT[$part]}
  if [ "${PART_IF_TIME[$part]}" = 1 ]; then
    share=$left
  else
    share=$(( left - $(reserve_after "$index") ))
  fi
  (( share < limit )) && limit=$share
  SECONDS_TAKEN[$part]=0
  build_status=${STATUS[build]:-not run}
  if [ "${PART_NEEDS_BUILD[$part]}" = 1 ] && [ "$build_status" != "not run" ] \
     && [ "$build_status" != PASS ]; then
    STATUS[$part]=SKIP; NOTE[$part]="the build did not pass"
    say "== $part: skipped (the build did not pass)"
    write_summary ""
    continue
  fi
  if (( limit < PART_MIN[$part] )); then
    STATUS[$part]=NO_TIME
    NOTE[$part]="${left}s left of the ${BUDGET}s budget, needs ${PART_MIN[$part]}s"
    say "== $part: skipped, ${NOTE[$part]}"
    write_summary ""
    continue
  fi
  say "== $part (limit ${limit}s): ${PART_DOC[$part]}"
  CURRENT=$part
  PART_T0=$(date +%s)
  # In the background, so that a signal to the run reaches on_signal at once; tee -i keeps
  # the log going while SIGINT stops the part.
  ( "part_$part" "$limit" 2>&1 | tee -i -a "$LOG"; exit "${PIPESTATUS[0]}" ) &
  PART_PID=$!
  wait "$PART_PID"
  rc=$?
  PART_PID=""
  CURRENT=""
  SECONDS_TAKEN[$part]=$(( $(date +%s) - PART_T0 ))
  case $rc in
    0) STATUS[$part]=PASS ;;
    3) STATUS[$part]=UNAVAILABLE; NOTE[$part]="the machine cannot run it" ;;
    124|137) STATUS[$part]=TIMEOUT; NOTE[$part]="stopped at its ${limit}s limit" ;;
    *) STATUS[$part]=FAIL; NOTE[$part]="exit status $rc" ;;
  esac
  say "== $part: ${STATUS[$part]} in ${SECONDS_TAKEN[$part]}s"
  write_summary ""
done

# -- summary --------------------------------------------------------------------------------

exit_status=0
for part in "${SELECTED[@]}"; do
  case ${STATUS[$part]} in
    PASS) ;;
    FAIL|TIMEOUT) exit_status=1 ;;
    SKIP) exit_status=1 ;;  # only ever because the build failed
    NO_TIME) [ "${PART_IF_TIME[$part]}" = 1 ] || { [ $exit_status = 0 ] && exit_status=2; } ;;
    UNAVAILABLE)
      # A sanitizer on gVisor is known not to run there: reported, not held against the run.
      if [[ $part =~ ^(sanitize|synccheck|racecheck|initcheck)$ ]] && on_gvisor; then
        NOTE[$part]="compute-sanitizer refuses gVisor's devices"
      else
        [ $exit_status = 0 ] && exit_status=2
      fi ;;
  esac
done
write_summary "$exit_status"

{
  echo
  echo "== summary ($(( $(date +%s) - START ))s of ${BUDGET}s)$( [ "$DRY_RUN" = 1 ] && echo ", dry run")"
  printf '%-10s %-11s %7s  %s\n' part status seconds note
  for part in "${SELECTED[@]}"; do
    printf '%-10s %-11s %7s  %s\n' "$part" "${STATUS[$part]}" "${SECONDS_TAKEN[$part]}" "${NOTE[$part]:-}"
  done
  [ -f "$WORK/tests.json" ] && echo "tests $(cat "$WORK/tests.json")"
  if [ -f "$RESULTS/bench.jsonl" ]; then
    "$PYTHON" - "$RESULTS/bench.jsonl" <<'EOF' 2>/dev/null || true
import json, sys
for line in open(sys.argv[1]):
    try:
        record = json.loads(line)
    except ValueError:
        continue
    if record.get("benchmark") != "gpu_targets":
        continue
    for t in record["targets"]:
        verdict = "met" if t["met"] else "MISSED"
        print(f"target {t['name']:<44} {t['value']!s:>8} {t['target']:<6} {verdict}")
    print("target_met", str(record["target_met"]).lower())
EOF
  fi
  echo "exit status $exit_status; log, summary.json and results in $RESULTS"
} | tee -a "$LOG"
exit "$exit_status"
