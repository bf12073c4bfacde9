"""pagedoptim.SGD: torch.optim.SGD's algorithm over paged state."""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch

from pagedoptim.optim import torch_flags

from pagedoptim.state import format as state_format
from pagedoptim._validation import as_flag, check_non_negative
from pagedoptim.engine.state_store import StateStore
from pagedoptim.engine.step_batch import StepBatch
from pagedoptim.optim.optimizer import PagedOptimizer
from pagedoptim.paging.options import PagingOptions
from pagedoptim.state.format import Moment


class _SGDStore(StateStore):
    def write(self, p: torch.Tensor, values: dict[str, torch.Tensor], where: str) -> None:
        """A momentum buffer written through optimizer.state is stepped from, as torch's
        SGD steps from any buffer it finds: the hidden count leaves 'first step'."""
        super().write(p, values, where)
        param_state = self.optimizer.state[p]
        if (param_state.hidden_step() or 0.0) < 1.0:
            param_state.set_hidden_step(1.0)


class SGD(PagedOptimizer):
    """Stochastic gradient descent with momentum, dampening, Nesterov and weight decay, a
    drop-in for torch.optim.SGD. With momentum=0 it keeps no state at all."""

    _kind = "sgd"
    _MOMENTUM = state_format.MOMENTUM_BUFFER
    # torch.optim.SGD's state holds only momentum_buffer; the step count that tells a first
    # step (the buffer starts as the gradient) from later ones is kept out of sight.
    _step_in_state = False
    _store_class = _SGDStore

    def __init__(
        self,
        params: Iterable[Any],
        lr: Union[float, torch.Tensor] = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
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
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)
        defaults.update(torch_flags.check_flags(
            type(self).__name__, foreach, fused, capturable, differentiable, with_capturable=False))
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
        momentum = check_non_negative(group["momentum"], "momentum")
        dampening = check_non_negative(group["dampening"], "dampening")
        weight_decay = check_non_negative(group["weight_decay"], "weight_decay")
        nesterov = as_flag(group["nesterov"], "nesterov")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening "
                             f"(got momentum={momentum}, dampening={dampening})")
        return (lr, momentum, dampening, weight_decay, nesterov,
                as_flag(group.get("maximize", False), "maximize"))

    def _group_hyperparameters(self, group: dict[str, Any]) -> tuple:
        return self._check_group(group)

    def _moments(self) -> list[Moment]:
        if any(float(group["momentum"]) != 0.0 for group in self.param_groups):
            return [self._MOMENTUM]
        return []


    def _dense_grad(self, p: torch.Tensor, grad: torch.Tensor,
                    group: dict[str, Any]) -> torch.Tensor:
        """torch.optim.SGD takes sparse gradients (nn.Embedding(sparse=True)): stepping their
        dense form gives its result exactly, since absent rows add zero. Like torch, not
        with weight decay, which would make a sparse gradient dense."""
        if not grad.is_sparse:
            return grad
        if float(group["weight_decay"]) != 0.0:
            raise RuntimeError("SGD with weight_decay does not support sparse gradients (as "
                               "torch.optim.SGD: weight decay adds the dense param to the "
                               f"gradient); param of shape {tuple(p.shape)} has one")
        return grad.to_dense()

    def _native_step(self, batch: StepBatch) -> None:
        self.state_store.engine.step_sgd(*batch.native_args(), **batch.amp)

    def _default_step(self, has_streams: bool) -> float:
        # torch.optim.SGD keeps no step; a parameter that has a momentum buffer has been
        # stepped, so its buffer must not be re-initialized from the next gradient.
        return 1.0 if has_streams else 0.0
