"""PagedOptim: drop-in PyTorch optimizers with compressed, paged optimizer state.

The package is layered, each layer importing only those before it (CONTRIBUTING.md has the
map; tests/python/test_package_layers.py checks it): state/ < paging/ < engine/ <
checkpoint/ < optim/ < integrations/, reference/ < cli/. This module is the face above them.
"""

from pagedoptim import _moved_modules

# Old module names (pagedoptim.adamw, ...) resolve to their new homes: old pickles load.
_moved_modules.install()

from pagedoptim.checkpoint.format import CheckpointError  # noqa: E402
from pagedoptim.engine.interrupted_step import InterruptedStepError  # noqa: E402
from pagedoptim.integrations import torch_optimizer_guard  # noqa: E402
from pagedoptim.integrations.patch import patch, unpatch  # noqa: E402
from pagedoptim.integrations.wrap import wrap  # noqa: E402
from pagedoptim.optim import AdamW, Lion, PagedOptimizer, SGD, SkewAdam  # noqa: E402
from pagedoptim.paging import PageCorruptionError, PageIOError  # noqa: E402

# torch.optim optimizers given our compressed state raise at their step, naming `convert`.
torch_optimizer_guard.install()

__all__ = ["AdamW", "CheckpointError", "InterruptedStepError", "Lion", "PageCorruptionError",
           "PageIOError", "PagedOptimizer", "SGD", "SkewAdam", "patch", "unpatch", "wrap"]
__version__ = "0.2.0"


def __getattr__(name: str):
    # pagedoptim.dcp imports torch.distributed.checkpoint: only for those who use it.
    if name == "dcp":
        import importlib
        return importlib.import_module("pagedoptim.integrations.dcp")
    raise AttributeError(f"module 'pagedoptim' has no attribute {name!r}")
