"""Builds pagedoptim's native extension through CMake, against the torch already installed.

    pip install --no-build-isolation .       # or -e . for development

Environment:
    PAGEDOPTIM_WITH_CUDA=1|0   force the CUDA kernels on or off (default: on when nvcc is
                               found and the installed torch is a CUDA build)
    PAGEDOPTIM_BUILD_DIR       CMake build directory, reused between builds (default: build/)
    PAGEDOPTIM_CMAKE_ARGS      extra arguments for the CMake configure step
    MAX_JOBS                   parallel compile jobs (default: number of CPUs)
"""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _want_cuda() -> bool:
    forced = os.environ.get("PAGEDOPTIM_WITH_CUDA")
    if forced is not None:
        return forced.strip().lower() in ("1", "on", "true", "yes")
    # Decided from the toolkit and the torch build, never from torch.cuda.is_available():
    # build machines often have no GPU.
    import torch

    return torch.version.cuda is not None and shutil.which("nvcc") is not None


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
            f"-DPAGEDOPTIM_WITH_CUDA={'ON' if _want_cuda() else 'OFF'}",
        ] + shlex.split(os.environ.get("PAGEDOPTIM_CMAKE_ARGS", ""))
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


setup(
    name="pagedoptim",
    version="0.1.0",
    description="Drop-in PyTorch optimizers with compressed, paged optimizer state",
    license="BSD-3-Clause",
    python_requires=">=3.10",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[CMakeExtension("pagedoptim._C")],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=["torch>=2.4"],
    zip_safe=False,
)
