#!/usr/bin/env bash
# Installs everything PagedOptim needs on a fresh Debian/Ubuntu machine and builds it in
# place. Idempotent: each step is skipped when its result is already there, and the CMake
# build directory (build/) plus ccache make a rebuild incremental.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}

packages=(build-essential cmake ninja-build ccache liburing-dev libgtest-dev pkg-config)
# qemu-user runs the module on emulated CPUs that have only one ISA each
# (tests/python/test_emulated_cpus.py): the CPU under the tests may have any of them.
[ "$(uname -m)" = x86_64 ] && packages+=(qemu-user)
need_apt=()
for pkg in "${packages[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# A user's own torch (a CUDA build, say) is built against and never replaced.
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  echo "setup: no torch found, installing torch==2.13.0"
  "$PYTHON" -m pip install -q torch==2.13.0
fi
"$PYTHON" -m pip install -q -r requirements-dev.txt

# ccache hits across checkouts (a fresh clone in CI, a worktree): paths are hashed relative
# to the checkout, and not the build directory's own path.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}

# Rebuild only when a native source or the build's own files changed since the last build
# (the stamp is in build/). The editable install picks up Python changes without one.
stamp=build/.pagedoptim-installed
# Built and importable, and from this checkout: another clone's `pip install -e` (a CI run
# of a fresh clone, say) takes the editable install over.
installed_here='import os, sys, pagedoptim._C as c
sys.exit(not os.path.realpath(c.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep))'
if [ ! -f "$stamp" ] || [ -n "$(find CMakeLists.txt setup.py cmake csrc include -newer "$stamp" \
        \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.txt' -o -name '*.py' -o -name '*.cmake' \) \
        -print -quit)" ] || ! "$PYTHON" -c "$installed_here" "$PWD/python" >/dev/null 2>&1; then
  echo "setup: building pagedoptim"
  "$PYTHON" -m pip install -q --no-build-isolation --no-deps -e .
  mkdir -p build && touch "$stamp"
fi
