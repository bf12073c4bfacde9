"""scripts/check_isa_objects.py finds what kills a module on a CPU without an ISA.

Tiny translation units, compiled here with and without ISA flags, stand for the two
failures it exists for: a static initializer in an ISA translation unit (what made
`import pagedoptim` die with SIGILL on CPUs without AVX-512), and an inline function
compiled with ISA flags outside the ISA's namespace (a weak definition the linker may hand
to the baseline code). The clean forms of both must pass, so the check cannot just fail.
"""

import pathlib
import platform
import shutil
import subprocess
import sys

import pytest

CHECK = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "check_isa_objects.py"

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="the ISAs checked are x86-64's")

# A table built by a constructor: GCC vectorizes the loop with the unit's ISA.
INITIALIZED_TABLE = """
namespace pagedoptim::kernels::avx2 {
struct Table { float entries[64]; Table() { for (int i = 0; i < 64; ++i) entries[i] = 1.0f / (i + 1); } };
inline const Table kTable;
float entry(int i) { return kTable.entries[i]; }
}
"""
# The same table computed by the compiler.
CONSTANT_TABLE = """
namespace pagedoptim::kernels::avx2 {
struct Table { float entries[64]; };
constexpr Table make_table() { Table t{}; for (int i = 0; i < 64; ++i) t.entries[i] = 1.0f / (i + 1); return t; }
inline constexpr Table kTable = make_table();
float entry(int i) { return kTable.entries[i]; }
}
"""
# An inline function emitted out of line, outside the ISA's namespace, and inside it.
SHARED_INLINE = """
namespace pagedoptim::kernels {
__attribute__((noinline)) inline float scaled(float x, float s) { return x * s; }
}
namespace pagedoptim::kernels::avx2 { float use(float x) { return scaled(x, 2.0f); } }
"""
NAMESPACED_INLINE = """
namespace pagedoptim::kernels::avx2 {
__attribute__((noinline)) inline float scaled(float x, float s) { return x * s; }
float use(float x) { return scaled(x, 2.0f); }
}
"""


def compile_unit(tmp_path: pathlib.Path, name: str, source: str, *flags: str) -> pathlib.Path:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.fail("no C++ compiler: scripts/setup.sh installs build-essential")
    (tmp_path / f"{name}.cpp").write_text(source)
    obj = tmp_path / f"{name}.o"
    subprocess.run([compiler, "-std=c++20", "-O3", "-fPIC", "-mavx2", "-mfma", *flags, "-c",
                    str(tmp_path / f"{name}.cpp"), "-o", str(obj)], check=True)
    return obj


def link_shared(tmp_path: pathlib.Path, obj: pathlib.Path) -> pathlib.Path:
    library = tmp_path / f"lib{obj.stem}.so"
    subprocess.run([shutil.which("g++") or "c++", "-shared", str(obj), "-o", str(library)],
                   check=True)
    return library


def check(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), *argv], capture_output=True, text=True)


def test_a_static_initializer_in_an_isa_object_fails(tmp_path):
    obj = compile_unit(tmp_path, "initialized", INITIALIZED_TABLE)
    result = check("--isa-objects", str(obj))
    assert result.returncode == 1
    assert ".init_array" in result.stdout


def test_a_module_whose_initializer_runs_isa_code_fails(tmp_path):
    library = link_shared(tmp_path, compile_unit(tmp_path, "initialized", INITIALIZED_TABLE))
    result = check("--binary", str(library))
    assert result.returncode == 1
    assert "load- or exit-time function" in result.stdout


def test_a_constant_table_passes_both_checks(tmp_path):
    obj = compile_unit(tmp_path, "constant", CONSTANT_TABLE)
    result = check("--isa-objects", str(obj), "--binary", str(link_shared(tmp_path, obj)))
    assert result.returncode == 0, result.stdout + result.stderr


def test_isa_code_outside_an_isa_namespace_fails(tmp_path):
    obj = compile_unit(tmp_path, "shared_inline", SHARED_INLINE)
    result = check("--isa-objects", str(obj))
    assert result.returncode == 1
    assert "pagedoptim::kernels::scaled" in result.stdout and "not in an ISA namespace" in result.stdout


def test_isa_code_inside_its_namespace_passes(tmp_path):
    obj = compile_unit(tmp_path, "namespaced_inline", NAMESPACED_INLINE)
    result = check("--isa-objects", str(obj), "--binary", str(link_shared(tmp_path, obj)))
    assert result.returncode == 0, result.stdout + result.stderr
