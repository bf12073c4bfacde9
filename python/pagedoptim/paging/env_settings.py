"""The PAGEDOPTIM* environment variables: the one-flag switch and the paging settings.

    PAGEDOPTIM=1                     torch.optim's classes resolve to ours (see pagedoptim.patch)
    PAGEDOPTIM_OFFLOAD=host|nvme|none
    PAGEDOPTIM_NVME_DIR=/path
    PAGEDOPTIM_CACHE_BYTES=4GiB      plain bytes or a size: 512MiB, 4GiB, 2GB, 1.5GiB
    PAGEDOPTIM_STATE_BITS=8|32
    PAGEDOPTIM_MASTER_BITS=24|32|none
    PAGEDOPTIM_PAGE_BYTES=2MiB
    PAGEDOPTIM_PREFETCH=4
    PAGEDOPTIM_POLICY=auto|lru|plan
    PAGEDOPTIM_RELEASE_GRADS=0|1
    PAGEDOPTIM_ALGORITHM=adamw|skewadam   what torch.optim.AdamW and Adam build

Each value is parsed here and every error names the variable and what it expects. Any other
PAGEDOPTIM_* variable is a typo unless the build, the scripts or the native library read it
(RESERVED): a misspelt setting that were ignored would silently train with the default.
"""

from __future__ import annotations

import difflib
import os
from typing import Any, Callable, Mapping, Optional

from pagedoptim.paging.options import PagingOptions
from pagedoptim.paging.setting_text import parse_bool, parse_byte_size, parse_int

FLAG = "PAGEDOPTIM"
PREFIX = FLAG + "_"

# PAGEDOPTIM_* names read elsewhere: setup.py and CMake (build options), scripts/ (GPU
# checks, PAGEDOPTIM_PEER_WHEELS), the tests (PAGEDOPTIM_FUZZ_SECONDS, PAGEDOPTIM_GPU_TARGET:
# tests/python/gpu_target.py), the native library
# (PAGEDOPTIM_CPU_ISA, PAGEDOPTIM_CUDA_DEBUG_SYNC) and pagedoptim.paging
# (PAGEDOPTIM_IO_BACKEND). test_one_flag.py greps the repository so a new
# one cannot be added without listing it here.
RESERVED = frozenset({
    "PAGEDOPTIM_BENCH_FILE", "PAGEDOPTIM_BUILD_DIR", "PAGEDOPTIM_BUILD_PYTHON",
    "PAGEDOPTIM_BUILD_TESTS", "PAGEDOPTIM_CCACHE", "PAGEDOPTIM_CMAKE_ARGS", "PAGEDOPTIM_CPU_ISA",
    "PAGEDOPTIM_CUDA_ARCHITECTURES", "PAGEDOPTIM_CUDA_ARCHS", "PAGEDOPTIM_CUDA_BUILD_DIR",
    "PAGEDOPTIM_CUDA_DEBUG_SYNC", "PAGEDOPTIM_CUDA_TORCH", "PAGEDOPTIM_CUDA_VENV",
    "PAGEDOPTIM_FUZZ_SECONDS", "PAGEDOPTIM_GPU_CHECK_BUDGET", "PAGEDOPTIM_GPU_CHECK_GVISOR",
    "PAGEDOPTIM_GPU_CHECK_LIMITS", "PAGEDOPTIM_GPU_TARGET", "PAGEDOPTIM_HAVE_IO_URING",
    "PAGEDOPTIM_IO_BACKEND", "PAGEDOPTIM_LIBURING", "PAGEDOPTIM_LIBURING_FOUND",
    "PAGEDOPTIM_LIBURING_INCLUDE_DIR", "PAGEDOPTIM_LIBURING_LIBRARY", "PAGEDOPTIM_PEER_WHEELS",
    "PAGEDOPTIM_SANITIZE", "PAGEDOPTIM_TORCH_CUDA_VERSION", "PAGEDOPTIM_TORCH_PYTHON_LIBRARY",
    "PAGEDOPTIM_WITH_CUDA", "PAGEDOPTIM_WITH_IO_URING",
})

_NONE = "none"


class EnvironmentSettingError(ValueError):
    """A PAGEDOPTIM* environment variable that cannot be used; the message names it."""


def _bad(variable: str, value: str, expected: str) -> EnvironmentSettingError:
    return EnvironmentSettingError(f"{variable}={value!r}: expected {expected}")


def _parsed_by(parse: Callable[[str], Any]) -> Callable[[str, str], Any]:
    """A setting_text parser whose error names the variable and its value."""
    def parse_variable(variable: str, value: str) -> Any:
        try:
            return parse(value)
        except ValueError as error:
            raise _bad(variable, value, str(error).removeprefix("expected ")) from None
    return parse_variable


_parse_bool = _parsed_by(parse_bool)
_parse_size = _parsed_by(parse_byte_size)
_parse_int = _parsed_by(parse_int)


def _choice(*choices: Optional[Any]) -> Callable[[str, str], Any]:
    """A parser for one of `choices`; None is spelt 'none', ints are compared as ints."""
    spelt = {(_NONE if c is None else str(c)): c for c in choices}

    def parse(variable: str, value: str) -> Any:
        key = value.strip().lower()
        if key not in spelt:
            raise _bad(variable, value, "one of " + ", ".join(spelt))
        return spelt[key]
    return parse


def _parse_path(variable: str, value: str) -> str:
    if not value.strip():
        raise _bad(variable, value, "a directory path")
    return value


# Variable suffix -> (PagingOptions field, parser). The choices repeat PagingOptions' own,
# which validates them again; here the error can name the variable.
_SETTINGS: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "OFFLOAD": ("offload", _choice(None, "host", "nvme")),
    "NVME_DIR": ("nvme_dir", _parse_path),
    "CACHE_BYTES": ("cache_bytes", _parse_size),
    "STATE_BITS": ("state_bits", _choice(8, 32)),
    "MASTER_BITS": ("master_bits", _choice(24, 32, None)),
    "MIN_8BIT_SIZE": ("min_8bit_size", _parse_int),
    "PAGE_BYTES": ("page_bytes", _parse_size),
    "PREFETCH": ("prefetch", _parse_int),
    "POLICY": ("policy", _choice("auto", "lru", "plan")),
    "RELEASE_GRADS": ("release_grads", _parse_bool),
}
# Which of our algorithms torch's Adam names build (see pagedoptim.patch); not a paging
# setting, so it is read on its own.
ALGORITHM_VARIABLE = PREFIX + "ALGORITHM"
_parse_algorithm = _choice("adamw", "skewadam")
SETTING_VARIABLES = tuple(PREFIX + suffix for suffix in _SETTINGS) + (ALGORITHM_VARIABLE,)


def flag_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether PAGEDOPTIM asks for the patch (1/true/yes/on; unset, 0/false/no/off: not)."""
    value = environ.get(FLAG)
    return value is not None and _parse_bool(FLAG, value)


def settings_from_environment(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The paging keyword arguments set by PAGEDOPTIM_* variables, each parsed and checked
    (an unknown PAGEDOPTIM_* variable raises, naming the closest known one). Whether they
    fit together is for the caller to check, after merging its own arguments: see
    check_together()."""
    known = set(SETTING_VARIABLES) | RESERVED
    settings: dict[str, Any] = {}
    for variable in sorted(environ):
        if not variable.startswith(PREFIX):
            continue
        if variable not in known:
            close = difflib.get_close_matches(variable, SETTING_VARIABLES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise EnvironmentSettingError(
                f"Unknown environment variable {variable}{hint}: PagedOptim reads "
                f"{', '.join(SETTING_VARIABLES)}; unset it so that no setting is silently "
                "ignored")
        if variable in RESERVED or variable == ALGORITHM_VARIABLE:
            continue
        field, parse = _SETTINGS[variable[len(PREFIX):]]
        settings[field] = parse(variable, environ[variable])
    return settings


def algorithm_from_environment(environ: Mapping[str, str] = os.environ) -> str:
    """PAGEDOPTIM_ALGORITHM: 'adamw' (unset) or 'skewadam'."""
    value = environ.get(ALGORITHM_VARIABLE)
    return "adamw" if value is None else _parse_algorithm(ALGORITHM_VARIABLE, value)


def check_together(from_environment: Mapping[str, Any], overrides: Mapping[str, Any]) -> None:
    """Raises if the settings from the environment, with `overrides` on top, do not fit
    together (prefetch without paging, say); the message names the variables."""
    try:
        PagingOptions(**{**from_environment, **overrides})
    except ValueError as error:
        if not from_environment:
            raise
        names = ", ".join(PREFIX + suffix for suffix, (field, _) in _SETTINGS.items()
                          if field in from_environment)
        source = f"the environment ({names})" + (" and the arguments" if overrides else "")
        raise EnvironmentSettingError(
            f"The PagedOptim settings from {source} do not fit together: {error}") from error
