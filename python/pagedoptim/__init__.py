"""PagedOptim: drop-in PyTorch optimizers with compressed, paged optimizer state."""

from pagedoptim.adamw import AdamW
from pagedoptim.checkpoint_format import CheckpointError
from pagedoptim.interrupted_step import InterruptedStepError
from pagedoptim.lion import Lion
from pagedoptim.optimizer import PagedOptimizer
from pagedoptim.paging import PageCorruptionError, PageIOError
from pagedoptim.patch import patch, unpatch
from pagedoptim.sgd import SGD
from pagedoptim.skewadam import SkewAdam
from pagedoptim.wrap import wrap
from pagedoptim import torch_optimizer_guard

# torch.optim optimizers given our compressed state raise at their step, naming `convert`.
torch_optimizer_guard.install()

__all__ = ["AdamW", "CheckpointError", "InterruptedStepError", "Lion", "PageCorruptionError",
           "PageIOError", "PagedOptimizer", "SGD", "SkewAdam", "patch", "unpatch", "wrap"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # pagedoptim.dcp imports torch.distributed.checkpoint: only for those who use it.
    if name == "dcp":
        import importlib
        return importlib.import_module("pagedoptim.dcp")
    raise AttributeError(f"module 'pagedoptim' has no attribute {name!r}")
