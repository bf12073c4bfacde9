"""pagedoptim.AdamW: torch.optim.AdamW's algorithm over paged state."""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch

from pagedoptim._validation import check_betas, check_non_negative
from pagedoptim.optimizer import PagedOptimizer
from pagedoptim.options import PagingOptions


class AdamW(PagedOptimizer):
    """AdamW with decoupled weight decay (Loshchilov & Hutter), a drop-in for
    torch.optim.AdamW: same arguments, same state_dict format.

    With state_bits=32 (exact mode) the result matches torch.optim.AdamW to fp32 rounding;
    the state is fp32 also for bf16/fp16 params (torch keeps it in the param's dtype).
    """

    _kind = "adamw"
    _possible_streams = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

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
        state_bits: int = 32,
        master_bits: Optional[int] = None,
        offload: Optional[str] = None,
        nvme_dir: Optional[str] = None,
        cache_bytes: Optional[int] = None,
        page_bytes: int = 2 << 20,
        prefetch: int = 4,
        policy: str = "auto",
        release_grads: bool = False,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize)
        self._check_group(defaults)
        options = PagingOptions(state_bits=state_bits, master_bits=master_bits,
                                offload=offload, nvme_dir=nvme_dir, cache_bytes=cache_bytes,
                                page_bytes=page_bytes, prefetch=prefetch, policy=policy,
                                release_grads=release_grads)
        super().__init__(params, defaults, options)

    @staticmethod
    def _check_group(group: dict[str, Any]) -> tuple:
        lr = check_non_negative(group["lr"], "lr")
        beta1, beta2 = check_betas(group["betas"])
        eps = check_non_negative(group["eps"], "eps")
        weight_decay = check_non_negative(group["weight_decay"], "weight_decay")
        return (lr, beta1, beta2, eps, weight_decay, bool(group["amsgrad"]),
                bool(group.get("maximize", False)))

    def _group_hyperparameters(self, group: dict[str, Any]) -> tuple:
        return self._check_group(group)

    def _stream_names(self) -> list[str]:
        names = ["exp_avg", "exp_avg_sq"]
        if any(group["amsgrad"] for group in self.param_groups):
            names.append("max_exp_avg_sq")
        return names

    def _native_step(self, *args: Any) -> None:
        self._engine.step_adamw(*args)
