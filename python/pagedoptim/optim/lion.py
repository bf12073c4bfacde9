"""pagedoptim.Lion: the Lion optimizer (Chen et al., 2023) over paged state."""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch

from pagedoptim.optim import torch_flags

from pagedoptim.state import format as state_format
from pagedoptim._validation import as_flag, check_betas, check_non_negative
from pagedoptim.engine.step_batch import StepBatch
from pagedoptim.optim.optimizer import PagedOptimizer
from pagedoptim.paging.options import PagingOptions
from pagedoptim.state.format import Moment


class Lion(PagedOptimizer):
    """Lion: sign of an interpolated momentum, one state per parameter.

    p <- p * (1 - lr*wd) - lr * sign(beta1*m + (1-beta1)*g);  m <- beta2*m + (1-beta2)*g
    """

    _kind = "lion"
    _FIRST = state_format.EXP_AVG

    def __init__(
        self,
        params: Iterable[Any],
        lr: Union[float, torch.Tensor] = 1e-4,
        betas: tuple[Union[float, torch.Tensor], Union[float, torch.Tensor]] = (0.9, 0.99),
        weight_decay: float = 0.0,
        maximize: bool = False,
        *,
        state_bits: int = 8,
        master_bits: Optional[int] = 24,
        min_8bit_size: int = state_format.DEFAULT_MIN_8BIT_SIZE,
        offload: Optional[str] = None,
        nvme_dir: Optional[str] = None,
        cache_bytes: Optional[int] = None,
        page_bytes: Optional[int] = None,
        prefetch: int = 4,
        policy: str = "auto",
        release_grads: bool = False,
        max_grad_norm: Optional[float] = None,
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
        defaults.update(torch_flags.check_flags(
            type(self).__name__, foreach, fused, capturable, differentiable))
        self._check_group(defaults)
        options = PagingOptions(state_bits=state_bits, master_bits=master_bits,
                                min_8bit_size=min_8bit_size,
                                offload=offload, nvme_dir=nvme_dir, cache_bytes=cache_bytes,
                                page_bytes=page_bytes, prefetch=prefetch, policy=policy,
                                release_grads=release_grads,
                                max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, options)

    @staticmethod
    def _check_group(group: dict[str, Any]) -> tuple:
        lr = check_non_negative(group["lr"], "lr")
        beta1, beta2 = check_betas(group["betas"])
        weight_decay = check_non_negative(group["weight_decay"], "weight_decay")
        return (lr, beta1, beta2, weight_decay, as_flag(group.get("maximize", False), "maximize"))

    def _group_hyperparameters(self, group: dict[str, Any]) -> tuple:
        return self._check_group(group)

    def _moments(self) -> list[Moment]:
        return [self._FIRST]


    def _native_step(self, batch: StepBatch) -> None:
        self.state_store.engine.step_lion(*batch.native_args(), **batch.amp)
