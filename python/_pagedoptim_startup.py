"""The startup hook behind `PAGEDOPTIM=1 python train.py`.

pagedoptim.pth (installed into site-packages) imports this module only when PAGEDOPTIM is
set, and calls install(). Importing torch here would cost every Python process a second or
more, and an exception raised while site processes a .pth file is printed and then
ignored, so a bad setting would train with torch's optimizer. Instead install() waits for
the script to import torch and patches right after it: errors then surface from the
script's own `import torch`. The module uses the standard library only.

The patch needs pagedoptim, which imports torch itself. When the script imports
pagedoptim first, torch finishes loading while pagedoptim is half imported, so in that case
the patch waits until pagedoptim is complete.

It imports nothing beyond sys and os, which site has loaded already (importlib.abc and
typing alone would cost tens of milliseconds): a meta path finder is any object with
find_spec.
"""

from __future__ import annotations

import os  # already loaded by site: free
import sys

_TRIGGERS = ("torch", "pagedoptim")


class _PatchAfterImport:
    """A meta path finder that finds nothing itself: for torch and pagedoptim it asks the
    finders after it, then has the module's loader apply the patch once the module has
    executed. It removes itself once the patch is applied."""

    def __init__(self) -> None:
        self._importing: set[str] = set()

    def find_spec(self, name: str, path: object, target: object = None) -> object:
        if name not in _TRIGGERS or name in self._importing:
            return None
        spec = self._spec_from_other_finders(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        self._run_after_exec(name, spec.loader)
        return spec

    def _spec_from_other_finders(self, name: str, path: object, target: object) -> object:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                return spec
        return None

    def _run_after_exec(self, name: str, loader: object) -> None:
        # An attribute on this loader instance only, removed once the module has run, so
        # the module keeps its own loader (importlib.resources and friends look at it).
        exec_module = loader.exec_module

        def exec_then_patch(module: object) -> None:
            self._importing.add(name)
            try:
                exec_module(module)
            finally:
                self._importing.discard(name)
                del loader.exec_module
            if name == "torch" and "pagedoptim" in self._importing:
                return  # pagedoptim is importing torch: patch when pagedoptim is complete
            self._patch()

        loader.exec_module = exec_then_patch

    def _patch(self) -> None:
        from pagedoptim.integrations.patch import patch_from_environment

        patch_from_environment()
        # Only once the patch succeeded: after an error, importing torch again retries it.
        if self in sys.meta_path:
            sys.meta_path.remove(self)


# setting_text.OFF, repeated: this module cannot import pagedoptim (that imports torch).
_OFF = ("0", "false", "no", "off", "")


def install() -> None:
    """Patches torch.optim as soon as torch is imported (now, if it already is), unless
    PAGEDOPTIM says off: then pagedoptim is never imported, so a broken install cannot
    break `import torch`. A value that is neither on nor off goes on to the patch, whose
    error names it."""
    if os.environ.get("PAGEDOPTIM", "").strip().lower() in _OFF:
        return
    if any(isinstance(finder, _PatchAfterImport) for finder in sys.meta_path):
        return
    finder = _PatchAfterImport()
    if "torch" in sys.modules:
        finder._patch()
    else:
        sys.meta_path.insert(0, finder)
