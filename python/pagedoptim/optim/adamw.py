"""pagedoptim.AdamW: torch.optim.AdamW's algorithm over paged state."""

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


class AdamW(PagedOptimizer):
    """AdamW with decoupled weight decay (Loshchilov & Hutter), a drop-in for
    torch.optim.AdamW: same arguments, same state_dict format.

    state_bits=8 (the default) keeps m and v companded in 8 bits with one fp16 scale per 32
    elements; state_bits=32 keeps them in fp32 and, with master_bits=None, matches
    torch.optim.AdamW to fp32 rounding (the state is fp32 also for bf16/fp16 params, where
    torch keeps it in the param's dtype). master_bits=24|32 keeps an int8|int16 residual
    beside each bf16/fp16 weight so that small updates are not rounded away.
    """

    _kind = "adamw"
    _FIRST = state_format.EXP_AVG
    _SECOND = state_format.EXP_AVG_SQ
    _SECOND_MAX = state_format.MAX_EXP_AVG_SQ
    _sparse_gradient_hint = ", please consider SparseAdam instead"  # torch's words

    def __init__(
        self,
        params: Iterable[Any],
        lr: Union[float, torch.Tensor] = 1e-3,
        betas: tuple[Union[float, torch.Tensor], Union[float, torch.Tensor]] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
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
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize,
                        decoupled_weight_decay=self._decoupled_weight_decay_default())
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

    def _decoupled_weight_decay_default(self) -> bool:
        """torch 2.x's AdamW groups say decoupled_weight_decay=True; the Adam stand-in of
        pagedoptim.patch() says what its constructor was given."""
        return True

    @staticmethod
    def _check_group(group: dict[str, Any]) -> tuple:
        lr = check_non_negative(group["lr"], "lr")
        beta1, beta2 = check_betas(group["betas"])
        eps = check_non_negative(group["eps"], "eps")
        weight_decay = check_non_negative(group["weight_decay"], "weight_decay")
        decoupled = as_flag(group.get("decoupled_weight_decay", True), "decoupled_weight_decay")
        if weight_decay and not decoupled:
            # torch.optim.Adam's groups: its weight decay is an L2 term added to the gradient,
            # which AdamW's decoupled decay does not reproduce.
            raise ValueError("decoupled_weight_decay=False (torch.optim.Adam's L2 weight decay, "
                             f"weight_decay={weight_decay}) is not AdamW's algorithm: "
                             "pagedoptim.AdamW decouples weight decay from the gradient")
        return (lr, beta1, beta2, eps, weight_decay, as_flag(group["amsgrad"], "amsgrad"),
                as_flag(group.get("maximize", False), "maximize"))

    def _group_hyperparameters(self, group: dict[str, Any]) -> tuple:
        return self._check_group(group)

    def _moments(self) -> list[Moment]:
        moments = [self._FIRST, self._SECOND]
        if any(group["amsgrad"] for group in self.param_groups):
            moments.append(self._SECOND_MAX)
        return moments


    def _native_step(self, batch: StepBatch) -> None:
        self.state_store.engine.step_adamw(*batch.native_args(), **batch.amp)
