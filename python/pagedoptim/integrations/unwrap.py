"""Find pagedoptim's optimizer inside the wrappers frameworks put around it."""

from __future__ import annotations

from typing import Any

from pagedoptim.optim.optimizer import PagedOptimizer


def unwrap_optimizer(optimizer: Any) -> PagedOptimizer:
    """The pagedoptim optimizer that `optimizer` is or wraps.

    accelerate's AcceleratedOptimizer (what `trainer.optimizer` is once training started,
    and what Accelerator.prepare returns) forwards step(), zero_grad(), state and
    param_groups but no other attribute, so `trainer.optimizer.memory_report()` raises
    AttributeError there. `unwrap_optimizer(trainer.optimizer).memory_report()` works
    before, during and after training. Wrappers are followed through their `.optimizer`
    attribute, the convention accelerate, DeepSpeed and SageMaker share.
    """
    current = optimizer
    while not isinstance(current, PagedOptimizer):
        inner = getattr(current, "optimizer", None)
        if inner is None or inner is current:
            raise TypeError(f"optimizer must be a pagedoptim optimizer or wrap one (through "
                            f"an .optimizer attribute), got {type(optimizer).__name__} "
                            f"holding {type(current).__name__}")
        current = inner
    return current
