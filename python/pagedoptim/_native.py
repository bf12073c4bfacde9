"""Loads the compiled engine, pagedoptim._C.

When the extension is missing (a source checkout that was never built, or a build for
another Python or torch) `import pagedoptim` still works; the first use of the engine
raises an error that says how to build it, instead of a log line nobody reads.
"""

from __future__ import annotations

from typing import Any

_BUILD_HINT = (
    "pagedoptim's native extension (pagedoptim._C) could not be loaded: {error}. "
    "Build it against the installed torch with `pip install --no-build-isolation -e .` "
    "in the source checkout (see README.md)."
)


class _MissingNativeLibrary:
    """Stands in for pagedoptim._C and raises on any use."""

    def __init__(self, error: BaseException) -> None:
        self._error = error

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(_BUILD_HINT.format(error=self._error)) from self._error


try:
    from pagedoptim import _C as native  # type: ignore[attr-defined]
except ImportError as error:  # pragma: no cover - exercised only without a build
    native = _MissingNativeLibrary(error)

__all__ = ["native"]
