"""The optimizers: `PagedOptimizer` (construction, lifecycle, step orchestration, the
torch.optim contract) and its algorithms AdamW, SGD, Lion and SkewAdam (with SkewAdam's
tiers). Imports every layer below (state, paging, engine, checkpoint), none above."""

from pagedoptim.optim.optimizer import PagedOptimizer
from pagedoptim.optim.adamw import AdamW
from pagedoptim.optim.lion import Lion
from pagedoptim.optim.sgd import SGD
from pagedoptim.optim.skewadam import SkewAdam

__all__ = ["AdamW", "Lion", "PagedOptimizer", "SGD", "SkewAdam"]
