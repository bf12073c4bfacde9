#!/usr/bin/env bash
# The one prepared check of the GPU path, for a lent GPU machine (docs/gpu.md): versions, a
# build for the present architecture, the GPU tests, compute-sanitizer over small cases, and the
# GPU benchmark. By default it fits in 5 minutes (--budget), so that a second run fits in a
# 15-minute lease, start-up included.
#
#   bash scripts/gpu_check.sh [RESULTS_DIR] [options]
#
# RESULTS_DIR defaults to $OUT, else ./gpu-results. It receives (few files: the lease returns at
# most eight):
#   gpu_check.log      everything every part printed, in order
#   summary.json       versions, each part's status and seconds, test counts, benchmark targets
#   tests-junit.xml    the GPU tests, one entry per test
#   bench.jsonl        benchmarks/gpu_step.py's JSON lines
#   paging.jsonl       benchmarks/gpu_paging.py's JSON lines (link, offloaded step, 1B, 8B)
#   fsdp2.jsonl        examples/fsdp2.py on NCCL at world size 1: one JSON line per run
#   peers.jsonl        benchmarks/peers.py --device cuda's JSON lines (only with --peers)
#
# Options:
#   --only a,b     run only these parts (in their fixed order)
#   --with a,b     add optional parts to the default ones; --NAME does the same for one part
#   --skip a,b     leave these parts out
#   --budget S     seconds for the whole run (default 360); a part gets what is left, up to its
#                  own limit, and is skipped when too little is left
#   --no-large     leave out the tests named *large* (the 2**31-element span, ~18 GB)
#   --quick        a smoke run: quick benchmark, sanitizer's quick case list, no large tests
#   --list         list the parts and exit
#
# Parts (default: all but initcheck); each runs under its own `timeout`, a failure does not
# stop the run, and parts that need the build are skipped when the build failed:
#   versions   nvidia-smi, nvcc, compute-sanitizer, python, torch, the device and its arch
#   build      PAGEDOPTIM_WITH_CUDA=1 pip install -e . for this GPU's architecture only
#   tests      pytest tests/python/test_cuda_step.py, test_cuda_paging.py (+ test_device_dispatch.py)
#   fsdp2      examples/fsdp2.py with CUDA params on NCCL, world size 1: FSDP2 steps, a DCP
#              save half-way and a resume that must end bit for bit (8-bit, and offload=host)
#   paging     benchmarks/gpu_paging.py: link bandwidth, offloaded step, 1B and 8B training
#   sanitize   compute-sanitizer memcheck over scripts/gpu_sanitize_cases.py
#   bench      benchmarks/gpu_step.py
#   racecheck  compute-sanitizer racecheck and synccheck, quick cases (only if time is left)
#   initcheck  compute-sanitizer initcheck, quick cases (optional: --with initcheck)
#   leaks      scripts/gpu_leak_check.py: 200 create/step/close cycles per configuration
#              (resident, offload host, offload nvme) leave torch.cuda.memory_allocated
#              exact, descriptors exact, and RSS (pinned cudaHostAlloc memory) flat
#   peers      benchmarks/peers.py --device cuda (optional: --peers): ours next to torch,
#              bitsandbytes (paged too), torchao (CPU offload too) and flashoptim, with a
#              memory-pressure workload; peers are installed from $PAGEDOPTIM_PEER_WHEELS
#              (default shared/wheels, see docs/comparison.md), else reported skipped
# A later issue adds a part by writing a function part_NAME (it gets its time limit in seconds
# as $1 and returns 0 for pass, 3 when the machine cannot run it) and registering it below
# with register_part; `--NAME` then selects it (e.g. --peers).
#
# Exit status: 0 when every selected part passed; 1 when one failed or timed out; 2 when none
# failed but a required part could not run (no time left, or its tool refused the machine).

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
# IF_TIME=1: a part skipped for lack of time does not make the run incomplete.
register_part() {
  ALL_PARTS+=("$1")
  PART_LIMIT[$1]=$2; PART_MIN[$1]=$3; PART_DEFAULT[$1]=$4; PART_NEEDS_BUILD[$1]=$5
  PART_IF_TIME[$1]=$6; PART_DOC[$1]=$7
}
register_part versions   60  10 1 0 0 "nvidia-smi, nvcc, compute-sanitizer, python, torch, device"
register_part build     240  60 1 0 0 "pip install -e . with the CUDA kernels for this GPU"
register_part tests     180  30 1 1 0 "pytest tests/python/test_cuda_step.py, test_cuda_paging.py"
register_part fsdp2      90  30 1 1 0 "examples/fsdp2.py on NCCL, world size 1, DCP resume"
register_part paging    240  60 1 1 0 "benchmarks/gpu_paging.py: link, offloaded step, 1B, 8B"
register_part sanitize  150  40 1 1 0 "compute-sanitizer memcheck over small cases"
register_part bench     150  30 1 1 0 "benchmarks/gpu_step.py"
register_part leaks      60  20 1 1 0 "scripts/gpu_leak_check.py: 200 create/step/close cycles"
register_part racecheck 120  60 1 1 1 "compute-sanitizer racecheck + synccheck, quick cases"
register_part initcheck 120  40 0 1 1 "compute-sanitizer initcheck, quick cases"
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
  echo "-- python"
  timeout "$limit" "$PYTHON" - "$WORK/versions.json" <<'EOF'
import importlib.metadata as md, json, platform, subprocess, sys
import torch
info = {"python": platform.python_version(), "executable": sys.executable,
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
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
sys.exit(0 if info["cuda_available"] else 1)
EOF
}

part_build() {
  local limit=$1
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
    PAGEDOPTIM_CMAKE_ARGS="$cmake_args" CUDACXX="$NVCC" MAX_JOBS="${MAX_JOBS:-16}" \
    timeout --kill-after=15 "$((limit - 20))" \
    "$PYTHON" -m pip install --no-build-isolation --no-deps -v -e . || return $?
  echo "-- the installed module, imported from outside the checkout"
  (cd /tmp && timeout 60 "$PYTHON" - <<'EOF'
import json, sys
import torch
import pagedoptim, pagedoptim._C as C
info = {"module": C.__file__, "cuda_built": C.cuda_built(), "cuda_version": C.cuda_version(),
        "cpu_isa": C.cpu_isa() if hasattr(C, "cpu_isa") else None}
print(json.dumps(info))
sys.exit(0 if info["cuda_built"] else 1)
EOF
  )
}

part_tests() {
  local limit=$1
  local files=(tests/python/test_cuda_step.py tests/python/test_cuda_paging.py)
  [ -f tests/python/test_device_dispatch.py ] && files+=(tests/python/test_device_dispatch.py)
  local args=(-q -rs -p no:cacheprovider -o junit_family=xunit1 --junitxml="$RESULTS/tests-junit.xml")
  if "$PYTHON" -c "import pytest_timeout" >/dev/null 2>&1; then
    args+=(--timeout=120)
  fi
  if [ "$QUICK" = 1 ]; then
    args+=(-k "not large and not tiny_llama")
  elif [ "$LARGE" != 1 ]; then
    args+=(-k "not large")
  fi
  echo "-- pytest ${args[*]} ${files[*]}"
  timeout --kill-after=15 "$limit" "$PYTHON" -m pytest "${args[@]}" "${files[@]}"
  local rc=$?
  "$PYTHON" - "$RESULTS/tests-junit.xml" "$WORK/tests.json" <<'EOF' || { [ "$rc" = 0 ] && rc=1; }
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
  local out="$WORK/sanitize-$tool.out"
  echo "-- $tool: $SANITIZER --tool $tool ${filter[*]} ${api[*]}"
  # No caching allocator: each tensor (each page slab too) is its own allocation, so an access
  # past its end is outside any allocation and memcheck sees it.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 PAGEDOPTIM_CUDA_DEBUG_SYNC=1 \
    timeout --kill-after=15 "$limit" "$SANITIZER" --tool "$tool" --error-exitcode 86 \
    --print-limit 20 "${filter[@]}" "${api[@]}" "$PYTHON" scripts/gpu_sanitize_cases.py "$@" \
    2>&1 | tee "$out"
  local rc=${PIPESTATUS[0]}
  if grep -q -e "Device not supported" -e "not supported on this platform" "$out"; then
    echo "$tool: compute-sanitizer refused this machine (some sandboxes, gVisor for one, do)"
    return 3
  fi
  if grep -q '"skipped"' "$out"; then echo "$tool: the cases were skipped"; return 1; fi
  grep -h "ERROR SUMMARY" "$out" | tail -1
  return "$rc"
}

part_sanitize() {
  local quick=(); [ "$QUICK" = 1 ] && quick=(--quick)
  run_sanitizer memcheck "$1" "${quick[@]}"
}

part_racecheck() {
  local half=$(( $1 / 2 )) rc=0
  run_sanitizer racecheck "$half" --quick || rc=$?
  local rc2=0
  run_sanitizer synccheck "$half" --quick || rc2=$?
  if [ "$rc" = 0 ]; then return "$rc2"; fi
  return "$rc"
}

part_initcheck() {
  run_sanitizer initcheck "$1" --quick
}

# Runs a benchmark script (--quick when asked) with its JSON lines into $RESULTS/OUT; a
# "skipped" line (no GPU, no CUDA kernels) fails the part.
run_json_bench() {
  local limit=$1 script=$2 out=$3 args=()
  [ "$QUICK" = 1 ] && args+=(--quick)
  timeout --kill-after=15 "$limit" "$PYTHON" "$script" "${args[@]}" | tee "$RESULTS/$out"
  local rc=${PIPESTATUS[0]}
  if grep -q '"skipped"' "$RESULTS/$out"; then echo "$script: skipped"; return 1; fi
  return "$rc"
}

part_paging() { run_json_bench "$1" benchmarks/gpu_paging.py paging.jsonl; }

# FSDP2 with CUDA params: one process is a mesh of one on NCCL. Every line must come from a
# CUDA device on NCCL and resume from its DCP checkpoint bit for bit.
part_fsdp2() {
  local limit=$1 out="$RESULTS/fsdp2.jsonl" rc=0 flags
  : >"$out"
  for flags in "" "--offload host"; do
    # shellcheck disable=SC2086
    timeout --kill-after=15 $(( limit / 2 )) "$PYTHON" examples/fsdp2.py --nproc 1 --steps 8 \
      $flags | tee -a "$out"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
  "$PYTHON" - "$out" <<'EOF' || rc=1
import json, sys
lines = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
bad = [line for line in lines if not (line["resumed_matches"] and line["backend"] == "nccl"
                                      and line["device"].startswith("cuda"))]
print(f"-- fsdp2: {len(lines)} runs, {len(bad)} not on cuda/nccl or not resumed exactly")
sys.exit(1 if bad or len(lines) != 2 else 0)
EOF
  return "$rc"
}

part_bench() { run_json_bench "$1" benchmarks/gpu_step.py bench.jsonl; }

part_leaks() {
  timeout --kill-after=15 "$1" "$PYTHON" scripts/gpu_leak_check.py
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
  timeout --kill-after=15 "$(( limit - 30 ))" "$PYTHON" benchmarks/peers.py "${args[@]}" \
    | tee "$RESULTS/peers.jsonl"
  local rc=${PIPESTATUS[0]}
  grep -q '"benchmark": "peers_throughput"' "$RESULTS/peers.jsonl" || { echo "peers.py measured nothing"; return 1; }
  return "$rc"
}

# -- options --------------------------------------------------------------------------------

usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }

RESULTS=${OUT:-./gpu-results}
BUDGET=${PAGEDOPTIM_GPU_CHECK_BUDGET:-360}
LARGE=1
QUICK=0
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
    --no-large) LARGE=0 ;;
    --quick) QUICK=1; LARGE=0 ;;
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
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
NVCC=$(find_nvcc || true)
SANITIZER=$(find_sanitizer || true)

say() { echo "$*" | tee -a "$LOG"; }

# -- the run --------------------------------------------------------------------------------

START=$(date +%s)
DEADLINE=$((START + BUDGET))
declare -A STATUS SECONDS_TAKEN NOTE
say "gpu_check: parts ${SELECTED[*]}; budget ${BUDGET}s; results in $RESULTS"

for part in "${SELECTED[@]}"; do
  now=$(date +%s)
  left=$((DEADLINE - now - 5))
  limit=${PART_LIMIT[$part]}
  (( left < limit )) && limit=$left
  SECONDS_TAKEN[$part]=0
  build_status=${STATUS[build]:-not run}
  if [ "${PART_NEEDS_BUILD[$part]}" = 1 ] && [ "$build_status" != "not run" ] \
     && [ "$build_status" != PASS ]; then
    STATUS[$part]=SKIP; NOTE[$part]="the build did not pass"
    say "== $part: skipped (the build did not pass)"
    continue
  fi
  if (( limit < PART_MIN[$part] )); then
    STATUS[$part]=NO_TIME
    NOTE[$part]="${left}s left of the ${BUDGET}s budget, needs ${PART_MIN[$part]}s"
    say "== $part: skipped, ${NOTE[$part]}"
    continue
  fi
  say "== $part (limit ${limit}s): ${PART_DOC[$part]}"
  t0=$(date +%s)
  "part_$part" "$limit" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  SECONDS_TAKEN[$part]=$(( $(date +%s) - t0 ))
  case $rc in
    0) STATUS[$part]=PASS ;;
    3) STATUS[$part]=UNAVAILABLE; NOTE[$part]="the machine cannot run it" ;;
    124|137) STATUS[$part]=TIMEOUT; NOTE[$part]="killed after ${limit}s" ;;
    *) STATUS[$part]=FAIL; NOTE[$part]="exit status $rc" ;;
  esac
  say "== $part: ${STATUS[$part]} in ${SECONDS_TAKEN[$part]}s"
done

# -- summary --------------------------------------------------------------------------------

exit_status=0
table="$WORK/parts.tsv"
: >"$table"
for part in "${SELECTED[@]}"; do
  status=${STATUS[$part]}
  case $status in
    PASS) ;;
    FAIL|TIMEOUT) exit_status=1 ;;
    SKIP) exit_status=1 ;;  # only ever because the build failed
    NO_TIME) [ "${PART_IF_TIME[$part]}" = 1 ] || { [ $exit_status = 0 ] && exit_status=2; } ;;
    UNAVAILABLE) [ $exit_status = 0 ] && exit_status=2 ;;
  esac
  printf '%s\t%s\t%s\t%s\n' "$part" "$status" "${SECONDS_TAKEN[$part]}" "${NOTE[$part]:-}" >>"$table"
done

"$PYTHON" - "$table" "$WORK" "$RESULTS" "$BUDGET" "$(( $(date +%s) - START ))" "$exit_status" \
  <<'EOF' 2>>"$LOG" || say "summary.json could not be written (see the log)"
import json, os, sys
table, work, results, budget, elapsed, status = sys.argv[1:7]


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
summary = {"exit_status": int(status), "budget_s": int(budget), "elapsed_s": int(elapsed),
           "parts": parts, "versions": load(os.path.join(work, "versions.json")),
           "tests": load(os.path.join(work, "tests.json")), "bench_targets": targets,
           "bench": bench, "paging_targets": paging_targets, "paging": paging,
           "fsdp2": fsdp2}
with open(os.path.join(results, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
EOF

{
  echo
  echo "== summary ($(( $(date +%s) - START ))s of ${BUDGET}s)"
  printf '%-10s %-11s %7s  %s\n' part status seconds note
  while IFS=$'\t' read -r part status seconds note; do
    printf '%-10s %-11s %7s  %s\n' "$part" "$status" "$seconds" "$note"
  done <"$table"
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
