#!/usr/bin/env bash
# CI's "Full CUDA build", on a machine with nvcc and no GPU: builds pagedoptim._C with the CUDA
# kernels against a CUDA build of torch, installs it, checks what got linked, and lints the
# kernels' PTX (scripts/ptx_lint.py).
#
# The CUDA torch lives in a virtualenv of its own, so the main Python keeps its CPU torch and
# its in-place build (python/pagedoptim/_C*.so, which has the same file name for both
# torches). The build goes through setup.py (pip wheel), as a user's would, in a build
# directory of its own, and the wheel is installed into that virtualenv alone.
#
# Environment (all optional):
#   PAGEDOPTIM_CUDA_VENV        the virtualenv (default /opt/torch-cuda-venv; created if missing)
#   PAGEDOPTIM_CUDA_TORCH       what pip installs into a new one (default torch==2.14.1)
#   PAGEDOPTIM_CUDA_ARCHS       architectures (default 90: one, to keep CI short; a user's
#                               build takes every architecture of the installed torch)
#   PAGEDOPTIM_CUDA_BUILD_DIR   CMake build directory (default build/cuda-torch)
#   CUDACXX                     the nvcc (default: nvcc on PATH)
# Results, timings included, go to $PAGEDOPTIM_CUDA_BUILD_DIR/cuda_build_check.json.
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC=${CUDACXX:-$(command -v nvcc || true)}
VENV=${PAGEDOPTIM_CUDA_VENV:-/opt/torch-cuda-venv}
TORCH_SPEC=${PAGEDOPTIM_CUDA_TORCH:-torch==2.14.1}
ARCHS=${PAGEDOPTIM_CUDA_ARCHS:-90}
BUILD_DIR=${PAGEDOPTIM_CUDA_BUILD_DIR:-build/cuda-torch}
JOBS=${MAX_JOBS:-$(nproc)}
LINT_PYTHON=${PYTHON:-python3}
VPY=$VENV/bin/python

fail() { echo "cuda_build_check: $*" >&2; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

[ -n "$NVCC" ] || fail "no nvcc: put it on PATH or set CUDACXX"
mkdir -p "$BUILD_DIR"
BUILD_DIR=$(cd "$BUILD_DIR" && pwd)
t_all=$(now)

echo "-- CUDA torch in $VENV"
t=$(now)
if [ ! -x "$VPY" ]; then
  python3 -m venv "$VENV"
fi
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q "$TORCH_SPEC"
fi
# The build backend of pyproject.toml; bdist_wheel is part of setuptools since 70.1.
"$VPY" -c "import setuptools" >/dev/null 2>&1 || "$VPY" -m pip install -q "setuptools>=70.1"
torch_cuda=$("$VPY" -c "import torch; print(torch.version.cuda or '')" 2>/dev/null)
[ -n "$torch_cuda" ] || fail "the torch in $VENV is a CPU-only build; it needs a CUDA build"
venv_s=$(since "$t")

echo "-- build (torch CUDA $torch_cuda, $("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/nvcc \1/p'), archs $ARCHS)"
t=$(now)
wheel_dir=$BUILD_DIR/wheel
rm -rf "$wheel_dir"
# setuptools stages the wheel under build/lib.* and build/bdist.*; stale files there (a module
# since deleted) would ride along into the wheel.
rm -rf build/lib.*-cpython-* build/bdist.*
PAGEDOPTIM_WITH_CUDA=1 PAGEDOPTIM_CUDA_ARCHS="$ARCHS" PAGEDOPTIM_BUILD_DIR="$BUILD_DIR" \
  CUDACXX="$NVCC" MAX_JOBS="$JOBS" \
  "$VPY" -m pip wheel -q --no-build-isolation --no-deps -w "$wheel_dir" .
"$VPY" -m pip install -q --no-deps --force-reinstall "$wheel_dir"/pagedoptim-*.whl
build_s=$(since "$t")

echo "-- checks"
t=$(now)
so=$(ls "$BUILD_DIR"/csrc/bindings/_C*.so)
# The -gencode flags nvcc actually got: SASS for each architecture, PTX for the newest.
gencode=$(grep -o -- '--generate-code=[^ ]*' "$BUILD_DIR/build.ninja" | sort -u | tr '\n' ' ')
newest=${ARCHS##*;}
for arch in ${ARCHS//;/ }; do
  [[ $gencode == *"arch=compute_$arch,code=[sm_$arch]"* ]] || fail "no SASS for sm_$arch: $gencode"
done
[[ $gencode == *"arch=compute_$newest,code=[compute_$newest]"* ]] || fail "no PTX for $newest: $gencode"

# One CUDA runtime in the process, torch's: the module needs the shared libcudart of torch's
# CUDA major version and defines none of the runtime's functions itself (a static cudart
# linked in would define them, cudaMalloc and the rest).
cudart="libcudart.so.${torch_cuda%%.*}"
# (Whole outputs into variables: under pipefail, a reader quitting early fails the pipe.)
needed=$(readelf -d "$so")
[[ $needed == *"Shared library: [$cudart]"* ]] || fail "$so does not need $cudart"
own_runtime=$(nm "$so" | awk '$2 ~ /^[TtWwDd]$/ && $3 ~ /^(cuda[A-Z]|__cudaRegisterFatBinary$)/ { print $3 }')
[ -z "$own_runtime" ] || fail "$so defines CUDA runtime functions (a static cudart?): ${own_runtime:0:200}"
ldd_cudart=$(ldd "$so" | awk '/libcudart/ { print $1 " => " $3 }')
echo "ldd: $ldd_cudart"
# The CUDA build is the module GPU users install: it too must load on any x86-64 CPU.
if [ "$(uname -m)" = x86_64 ]; then
  "$LINT_PYTHON" scripts/check_isa_objects.py --binary "$so" || fail "ISA code at load time in $so"
fi

# From outside the checkout (-I: neither the current directory nor PYTHONPATH on sys.path), so
# the installed wheel is what loads. Once loaded, exactly one libcudart is mapped: torch's.
import_json=$(cd / && "$VPY" -I - <<'EOF'
import json, warnings
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch
import pagedoptim
import pagedoptim._C as C
report = {"module": C.__file__, "torch": torch.__version__}
for query in ("cuda_built", "cuda_version", "cuda_archs"):
    if hasattr(C, query):
        value = getattr(C, query)()
        report[query] = value if isinstance(value, (bool, int, str)) else list(value)
if report.get("cuda_built") is False:
    raise SystemExit("pagedoptim._C says it was built without CUDA")
with open("/proc/self/maps") as maps:
    runtimes = sorted({line.split()[-1] for line in maps if "libcudart" in line})
if len(runtimes) != 1:
    raise SystemExit(f"expected one CUDA runtime in the process, found {runtimes}")
report["libcudart_loaded"] = runtimes[0]
print(json.dumps(report))
EOF
) || fail "importing pagedoptim._C from $VENV failed"
echo "$import_json"
check_s=$(since "$t")

echo "-- PTX lint"
t=$(now)
lint_json=$("$LINT_PYTHON" scripts/ptx_lint.py --nvcc "$NVCC" \
              --compile-commands "$BUILD_DIR/compile_commands.json") || fail "PTX lint failed"
echo "$lint_json"
lint_s=$(since "$t")

summary=$(cat <<EOF
{"torch_cuda": "$torch_cuda", "archs": "$ARCHS", "gencode": "${gencode% }",
 "ldd_cudart": "$ldd_cudart", "import": $import_json, "ptx_lint": $lint_json,
 "seconds": {"venv": $venv_s, "build": $build_s, "checks": $check_s, "lint": $lint_s,
             "total": $(since "$t_all")}}
EOF
)
echo "$summary" > "$BUILD_DIR/cuda_build_check.json"
echo "$summary"
