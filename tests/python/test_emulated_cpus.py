"""Each CPU kernel ISA, run on a CPU that has only that ISA, whatever CPU runs the tests.

The kernels are compiled once per ISA and chosen at run time; a module that works on the
machine that built and tested it can still die on another (it did: an AVX-512 static
initializer killed `import pagedoptim` on every CPU without AVX-512, while CI, on AVX-512
machines, stayed green). Here qemu-user runs the installed module on emulated CPU models:

  Haswell  AVX2, FMA and F16C, no AVX-512  -> the dispatcher must choose "avx2"
  Nehalem  SSE4.2, no AVX                  -> the dispatcher must choose "baseline"

Each run imports pagedoptim and takes two steps of every kernel family in every state form
(isa_steps_child.py); the bytes must equal those of the same steps run natively with
PAGEDOPTIM_CPU_ISA capping the kernels at that ISA (and ATEN_CPU_CAPABILITY capping torch's
own, so that nothing else differs between the runs). qemu cannot emulate AVX-512: the
AVX-512 kernels are compared with the baseline only natively, on a CPU that has it
(tests/cpp/kernels/test_isa_kernels.cpp says when it skipped them).

test_load_time_code_is_isa_free checks the rule that keeps this from breaking again, on
the installed module itself (scripts/check_isa_objects.py; the C++ build checks its objects).
"""

import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys

import pytest

import pagedoptim._C as native

REPO = pathlib.Path(__file__).resolve().parents[2]
CHILD = pathlib.Path(__file__).with_name("isa_steps_child.py")
# Under emulation, importing torch takes about a minute on 2 cores.
EMULATED_TIMEOUT_S = 600

x86_64_only = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                 reason="the CPU models and ISAs here are x86-64's")


def run_child(argv: list, env_overrides: dict) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PAGEDOPTIM_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    env.update(env_overrides, OMP_NUM_THREADS="1")
    result = subprocess.run(argv + [str(CHILD)], env=env, capture_output=True, text=True,
                            timeout=EMULATED_TIMEOUT_S)
    # qemu warns on stderr about CPUID bits its translator does not model; only a failure's
    # stderr is worth reading.
    assert result.returncode == 0, (
        f"{' '.join(argv)} exited with {result.returncode}"
        f"{' (SIGILL: an instruction this CPU lacks)' if result.returncode in (-4, 132) else ''}"
        f":\n{result.stderr[-4000:]}")
    return json.loads(result.stdout)


def qemu() -> str:
    path = shutil.which("qemu-x86_64")
    if path is None:
        pytest.fail("qemu-x86_64 is not installed: scripts/setup.sh installs Debian's qemu-user")
    return path


def qemu_version(path: str) -> str:
    # AVX, AVX2, FMA and F16C are emulated from qemu 7.2 on: an older one runs Haswell's
    # code as Nehalem's, and the dispatcher rightly picks the baseline there.
    return subprocess.run([path, "--version"], capture_output=True, text=True).stdout.split("\n")[0]


def interpreter() -> str:
    """The interpreter for qemu-user, which runs one ELF file: sys.executable itself where it
    is one (a virtualenv's python is a link, and resolving it would leave the virtualenv),
    else the file it links to."""
    with open(sys.executable, "rb") as executable:
        if executable.read(4) == b"\x7fELF":
            return sys.executable
    return os.path.realpath(sys.executable)


@x86_64_only
@pytest.mark.parametrize("cpu_model, isa, aten_capability",
                         [("Haswell", "avx2", "avx2"), ("Nehalem", "baseline", "default")])
def test_steps_on_an_emulated_cpu_match_the_native_steps(cpu_model, isa, aten_capability):
    python = interpreter()
    emulated = run_child([qemu(), "-cpu", cpu_model, python], {})
    assert emulated["isa"] == isa, (
        f"on an emulated {cpu_model} the dispatcher chose {emulated['isa']!r}, expected {isa!r} "
        f"({qemu_version(qemu())}; AVX2 needs qemu 7.2 or newer)")
    natively = run_child([python], {"PAGEDOPTIM_CPU_ISA": isa,
                                    "ATEN_CPU_CAPABILITY": aten_capability})
    if natively["isa"] != isa:
        pytest.skip(f"this CPU cannot run the {isa} kernels natively "
                    f"(PAGEDOPTIM_CPU_ISA={isa} gave {natively['isa']})")
    assert emulated["cases"].keys() == natively["cases"].keys()
    differing = {case: sorted(name for name, digest in hashes.items()
                              if natively["cases"][case].get(name) != digest)
                 for case, hashes in emulated["cases"].items()
                 if hashes != natively["cases"][case]}
    assert not differing, f"{isa} on an emulated {cpu_model} differs from native {isa}: {differing}"


@x86_64_only
def test_load_time_code_is_isa_free():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "check_isa_objects.py"),
                             "--binary", native.__file__], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
