"""The CUDA build's own logic, testable without a GPU or a CUDA torch: setup.py's choice of
architectures, the one list of nvcc flags shared by CMake and the PTX lint, and the lint's
rules (against synthetic PTX, and against what nvcc writes when one is installed).

The full CUDA build itself is scripts/cuda_build_check.sh (run by scripts/test.sh when nvcc
is present)."""

import ast
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = ROOT / "scripts" / "ptx_lint.py"
NVCC = shutil.which("nvcc")


def _load_lint():
    spec = importlib.util.spec_from_file_location("ptx_lint", LINT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _setup_function(name):
    # setup.py calls setup() when imported; take the one function out of its source.
    source = (ROOT / "setup.py").read_text()
    node = next(n for n in ast.parse(source).body
                if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {}
    exec("import re\n" + ast.get_source_segment(source, node), namespace)
    return namespace[name]


def test_architectures_follow_torchs_list():
    archs = _setup_function("_cuda_archs_from_torch")
    assert archs(["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]) == "75;80;86;90;100;120"
    # PTX entries dropped (the build adds PTX for the newest itself), arch-specific variants
    # folded into the plain architecture, sorted numerically and without repeats.
    assert archs(["sm_90a", "compute_90", "sm_100", "sm_80", "sm_90"]) == "80;90;100"
    assert archs([]) == ""


def test_one_list_of_nvcc_flags_for_cmake_and_the_lint():
    flags = _load_lint().kernel_flags()
    for numerics in ("-fmad=false", "-prec-div=true", "-prec-sqrt=true", "-ftz=false"):
        assert numerics in flags
    assert not any("fast_math" in f or "fast-math" in f for f in flags)
    kernels_cmake = (ROOT / "csrc" / "kernels" / "cuda" / "CMakeLists.txt").read_text()
    assert "cmake/cuda_kernel_flags.txt" in kernels_cmake
    # No numerics flag set anywhere else, where the lint would not see it.
    for cmake in [ROOT / "CMakeLists.txt", *ROOT.glob("csrc/**/CMakeLists.txt")]:
        text = cmake.read_text()
        for flag in ("-fmad", "-prec-div", "-prec-sqrt", "-ftz", "fast_math"):
            assert flag not in text, f"{cmake} sets {flag}; it belongs in cuda_kernel_flags.txt"


def test_lint_rules_against_known_ptx():
    result = subprocess.run([sys.executable, str(LINT), "--self-test"], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


TINY_KERNEL = """
__global__ void tiny_kernel(float* x, const float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = sqrtf(x[i] * y[i] + 1.0f) / y[i] - x[i] * 0.5f;
}
"""


def _lint(*args):
    return subprocess.run([sys.executable, str(LINT), *map(str, args)], capture_output=True,
                          text=True)


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_lint_passes_our_flags_and_fails_fast_math(tmp_path):
    source = tmp_path / "tiny.cu"
    source.write_text(TINY_KERNEL)
    ours = _lint("--nvcc", NVCC, source)
    assert ours.returncode == 0, ours.stderr
    assert json.loads(ours.stdout)["fma"] == 0  # the source writes no fmaf
    fast = tmp_path / "fast.ptx"
    subprocess.run([NVCC, "-ptx", "-arch=compute_90", "--use_fast_math", str(source), "-o",
                    str(fast)], check=True)
    theirs = _lint("--ptx", fast)
    assert theirs.returncode == 1
    for rule in (".approx", ".ftz"):
        assert rule in theirs.stderr
    # nvcc's default -fmad=true: the front end fuses what it sees (fma the source did not
    # write, which the lint counts) and leaves other mul/add unrounded for ptxas to fuse.
    fused = tmp_path / "fused.ptx"
    subprocess.run([NVCC, "-ptx", "-arch=compute_90", str(source), "-o", str(fused)], check=True)
    default = _lint("--ptx", fused)
    assert json.loads(default.stdout)["fma"] > 0 or "unrounded float" in default.stderr


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_lint_flags_libdevice_exp_even_with_our_flags(tmp_path):
    # CUDA's expf, powf and logf use ex2.approx.ftz / rcp.approx.ftz inside (within 2 ulp,
    # not correctly rounded), whatever the flags: a kernel calling them fails the lint, so
    # such scalars are computed on the host.
    source = tmp_path / "exp.cu"
    source.write_text("__global__ void exp_kernel(float* x) { x[0] = expf(x[0]); }\n")
    result = _lint("--nvcc", NVCC, source)
    assert result.returncode == 1
    assert ".approx" in result.stderr
