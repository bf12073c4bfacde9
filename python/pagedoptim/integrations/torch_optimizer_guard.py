"""Stops a torch.optim optimizer from stepping PagedOptim's compressed state.

`torch.optim.AdamW().load_state_dict(po_optimizer.state_dict())` succeeds: torch keeps
whatever per-param entries it is given. Its first step then fails far from the cause
(AdamW: `KeyError: 'exp_avg'`), or, worse, trains on without a word: torch's SGD reads
`state.get("momentum_buffer")`, finds none next to our `momentum_buffer_codes`, and starts a
fresh momentum. Importing pagedoptim registers a global step pre-hook (torch's
`register_optimizer_step_pre_hook`, run before every optimizer's step) that raises instead,
naming the conversion. It looks at every param with state, up to the first holding our
state: params of one state_dict differ in format (1-D and small params keep fp32 moments
beside 8-bit ones, docs/compression.md), so no one param speaks for its group. A step of a
torch optimizer pays a scan of each param's few state keys (about 0.1 us a key).

Without pagedoptim imported nothing can intercept torch's step; README and
docs/checkpoints.md name `python -m pagedoptim convert` beside the KeyError.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from pagedoptim.optim.optimizer import PagedOptimizer
from pagedoptim.state.format import RESIDUAL

# Keys only our formats put in a param's state: companded moments, master residuals and
# SkewAdam's factored second moments. A torch optimizer can step none of them.
_OUR_STATE_KEY_SUFFIXES = ("_codes", "_scales", "_factors")

_handle: Optional[RemovableHandle] = None


def is_pagedoptim_state_key(key: Any) -> bool:
    return isinstance(key, str) and (key == RESIDUAL or key.endswith(_OUR_STATE_KEY_SUFFIXES))


def _is_a_torch_algorithm(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` runs one of torch.optim's algorithms (torch.optim.AdamW, SGD, ...,
    or a subclass of one), which read fp32 moments. Not wrappers that step an optimizer of
    ours inside, whose state they mirror or forward: ZeroRedundancyOptimizer
    (torch.distributed.optim), accelerate's AcceleratedOptimizer; nor our own classes, whose
    steps run this hook too and leave at the first test. (No cache: Dynamo traces the hook
    under torch.compile and warns about functools caches.)"""
    if isinstance(optimizer, PagedOptimizer):
        return False
    return any(cls.__module__.startswith("torch.optim.") and cls is not torch.optim.Optimizer
               for cls in type(optimizer).__mro__)


def _refuse_pagedoptim_state(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _is_a_torch_algorithm(optimizer):
        return
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, p in enumerate(group["params"]):
            state = optimizer.state.get(p)
            if not state:
                continue
            ours = sorted(k for k in state if is_pagedoptim_state_key(k))
            if ours:
                name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
                raise ValueError(
                    f"{name} holds PagedOptim's compressed state (param {param_index} of group "
                    f"{group_index} has {', '.join(ours)}): torch's optimizers step fp32 "
                    "moments only, and would fail or restart them. Convert the state before "
                    "loading it: `po_optimizer.torch_state_dict()` in place of state_dict(), "
                    "or `python -m pagedoptim convert IN OUT --to torch` for a saved file (a "
                    "Trainer checkpoint's optimizer.pt converts in place); or keep stepping it "
                    "with pagedoptim, whose optimizers load it as it is")


def install() -> None:
    """Registers the guard once per process (importing pagedoptim does)."""
    global _handle
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_refuse_pagedoptim_state)


def uninstall() -> None:
    global _handle
    if _handle is not None:
        _handle.remove()
        _handle = None
