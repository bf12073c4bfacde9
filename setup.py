"""Builds pagedoptim's native extension through CMake, against the torch already installed.

    pip install --no-build-isolation .       # or -e . for development

With a CUDA build of torch and an nvcc of the same CUDA major version, the CUDA kernels and
the CUDA backend are compiled into pagedoptim._C and linked against torch's shared CUDA
runtime. Whether a GPU is present does not matter: the build never asks
torch.cuda.is_available().

Environment:
    PAGEDOPTIM_WITH_CUDA=1|0   force the CUDA build on or off (default: on when the installed
                               torch is a CUDA build, torch.version.cuda, and nvcc is found)
    PAGEDOPTIM_CUDA_ARCHS      CUDA architectures, e.g. "90" or "80;90" (default: those the
                               installed torch was built for, torch.cuda.get_arch_list());
                               SASS for each, PTX for the newest
    CUDACXX                    the nvcc to use (default: nvcc on PATH, then $CUDA_HOME/bin)
    PAGEDOPTIM_BUILD_DIR       CMake build directory, reused between builds (default: build/)
    PAGEDOPTIM_CMAKE_ARGS      extra arguments for the CMake configure step
    MAX_JOBS                   parallel compile jobs (default: number of CPUs)

Besides the package, the install puts two files at the top of site-packages: pagedoptim.pth
and _pagedoptim_startup.py, the startup hook of `PAGEDOPTIM=1 python train.py` (see
docs/one_flag.md). Without PAGEDOPTIM set, the .pth does nothing beyond one dict lookup.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Command, Extension, find_packages, setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _find_nvcc() -> str | None:
    explicit = os.environ.get("CUDACXX")
    if explicit:
        return explicit
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


def _want_cuda(nvcc: str | None) -> bool:
    forced = os.environ.get("PAGEDOPTIM_WITH_CUDA")
    if forced is not None:
        return forced.strip().lower() in ("1", "on", "true", "yes")
    # Decided from the toolkit and the torch build, never from torch.cuda.is_available():
    # build machines often have no GPU.
    import torch

    return torch.version.cuda is not None and nvcc is not None


def _cuda_archs_from_torch(arch_list: list[str]) -> str:
    """CMake's list of the architectures torch was built for: ['sm_80', 'sm_90a',
    'compute_90'] -> '80;90'. PTX entries (compute_*) are dropped, since the build adds PTX
    for the newest architecture itself, and arch-specific variants (sm_90a) become the plain
    architecture, which is all the kernels use."""
    archs = {int(m.group(1)) for a in arch_list if (m := re.fullmatch(r"sm_(\d+)[af]?", a))}
    return ";".join(str(a) for a in sorted(archs))


def _cuda_configure_args(nvcc: str) -> list[str]:
    import torch

    archs = os.environ.get("PAGEDOPTIM_CUDA_ARCHS") or _cuda_archs_from_torch(
        torch.cuda.get_arch_list())
    if not archs:
        raise RuntimeError(
            "No CUDA architectures to build for: torch.cuda.get_arch_list() is empty (a "
            "CPU-only torch?). Set PAGEDOPTIM_CUDA_ARCHS (e.g. 90), or PAGEDOPTIM_WITH_CUDA=0.")
    return [
        f"-DCMAKE_CUDA_COMPILER={nvcc}",
        f"-DPAGEDOPTIM_CUDA_ARCHS={archs}",
        # CMake checks nvcc's major version against it, with a message naming both.
        f"-DPAGEDOPTIM_TORCH_CUDA_VERSION={torch.version.cuda or ''}",
    ]


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import torch.utils

        build_dir = Path(os.environ.get("PAGEDOPTIM_BUILD_DIR", ROOT / "build"))
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake",
            "-S", str(ROOT),
            "-B", str(build_dir),
            "-G", "Ninja" if shutil.which("ninja") else "Unix Makefiles",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython_EXECUTABLE={sys.executable}",
            "-DCMAKE_BUILD_TYPE=Release",
            "-DPAGEDOPTIM_BUILD_PYTHON=ON",
        ]
        nvcc = _find_nvcc()
        if _want_cuda(nvcc):
            if nvcc is None:
                raise RuntimeError("PAGEDOPTIM_WITH_CUDA=1 but no nvcc was found: put it on "
                                   "PATH or point CUDACXX at it.")
            configure += ["-DPAGEDOPTIM_WITH_CUDA=ON"] + _cuda_configure_args(nvcc)
        else:
            configure += ["-DPAGEDOPTIM_WITH_CUDA=OFF"]
        configure += shlex.split(os.environ.get("PAGEDOPTIM_CMAKE_ARGS", ""))
        subprocess.run(configure, check=True)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "_C", "-j", jobs],
                       check=True)

        built = sorted(build_dir.glob("csrc/bindings/_C*.so"))
        if not built:
            raise RuntimeError(f"CMake built no extension module under {build_dir}")
        destination = Path(self.get_ext_fullpath(ext.name))
        destination.parent.mkdir(parents=True, exist_ok=True)
        # Copy beside the target, then rename over it: a process that has the old module
        # mapped keeps its (now unlinked) file instead of seeing it rewritten under it.
        staging = destination.with_name(destination.name + ".tmp")
        shutil.copyfile(built[-1], staging)
        os.replace(staging, destination)


class BuildStartupHook(Command):
    """Puts pagedoptim.pth at the root of the wheel, which is site-packages once installed:
    site runs a .pth file only from there, never from a package or from python/.

    A build sub-command, so a regular wheel (bdist_wheel installs build_lib) and an editable
    one both get it. In editable mode build_lib is ignored: setuptools' editable_wheel packs
    the directory it gave the install command as install_lib, so the file goes there.
    """

    description = "add the PAGEDOPTIM startup hook (pagedoptim.pth) to the wheel"
    user_options: list = []
    PTH = "pagedoptim.pth"

    def initialize_options(self) -> None:
        self.build_lib = None
        self.editable_mode = False

    def finalize_options(self) -> None:
        self.set_undefined_options("build", ("build_lib", "build_lib"))

    def _destination(self) -> Path:
        if self.editable_mode:
            return Path(self.get_finalized_command("install").install_lib) / self.PTH
        return Path(self.build_lib) / self.PTH

    def run(self) -> None:
        destination = self._destination()
        destination.parent.mkdir(parents=True, exist_ok=True)
        self.copy_file(str(ROOT / "python" / self.PTH), str(destination))

    def get_outputs(self) -> list[str]:
        return [] if self.editable_mode else [str(self._destination())]

    def get_source_files(self) -> list[str]:
        return [str(Path("python") / self.PTH)]

    def get_output_mapping(self) -> dict[str, str]:
        return {}


class BuildWithStartupHook(build):
    sub_commands = build.sub_commands + [("build_startup_hook", None)]


setup(
    name="pagedoptim",
    version="0.2.0",
    description="Drop-in PyTorch optimizers with compressed, paged optimizer state",
    license="BSD-3-Clause",
    python_requires=">=3.10",
    package_dir={"": "python"},
    packages=find_packages("python"),
    py_modules=["_pagedoptim_startup"],
    # The native module's type stub (python/pagedoptim/_C.pyi), so editors and type checkers
    # follow step() into the binding; the pickles of old layouts are test data, not package.
    package_data={"pagedoptim": ["_C.pyi", "py.typed"]},
    ext_modules=[CMakeExtension("pagedoptim._C")],
    cmdclass={"build": BuildWithStartupHook, "build_startup_hook": BuildStartupHook,
              "build_ext": CMakeBuild},
    install_requires=["torch>=2.4"],
    # HF Trainer, PEFT and accelerate routes (pagedoptim.integrations.transformers) and the
    # examples that use them; the core never imports them.
    # The optimizers benchmarks/peers.py compares with (docs/comparison.md): install deepspeed
    # with DS_BUILD_OPS=0 (it builds its CPU Adam with ninja on first use), and keep the
    # installed torch (pip install --no-deps, or a constraint torch==<installed>).
    extras_require={"hf": ["transformers", "peft", "accelerate"],
                    "peers": ["bitsandbytes>=0.45", "torchao>=0.10", "deepspeed", "ninja"]},
    zip_safe=False,
)
