"""A plain PyTorch SkewAdam: the oracle of the native one (tests) and the bench's
experiments (the epsilon placement). Same formulas as include/pagedoptim/codec/
skewadam_rules.h, written with tensor ops on fp32 state, one parameter at a time.

`momentum_codec` emulates the 8-bit momentum: a pair (encode, decode) applied to the
momentum after every update (pagedoptim._C.encode_moment / decode_moment for the kernels'
companding; both take the row length its groups follow), for the params that keep 8-bit
moments (`min_8bit_size`, as the optimizer's). `factor_floor` switches the epsilon to the
alternative that docs/skewadam.md measures: no eps on g^2, and the row and column means (and
exact second moments) floored at `factor_floor` instead.
The master residual of bf16 parameters is not modelled: parameters are updated in fp32.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from pagedoptim.reference import DEFAULT_MIN_8BIT_SIZE, keeps_8bit_state, power_of
from pagedoptim.optim.skewadam_store import ParamLayout, layout_of
from pagedoptim.optim.tiers import check_tier


class SkewAdamReference:
    def __init__(self, params_and_tiers: list[tuple[torch.Tensor, str]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-30,
                 weight_decay: float = 0.0,
                 momentum_codec: Optional[tuple[Callable, Callable]] = None,
                 factor_floor: Optional[float] = None,
                 min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE) -> None:
        self.params = [(p, layout_of(p, check_tier(tier))) for p, tier in params_and_tiers]
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.momentum_codec = momentum_codec
        self.min_8bit_size = min_8bit_size
        self.factor_floor = factor_floor
        self.state: dict[torch.Tensor, dict[str, Any]] = {}

    @torch.no_grad()
    def step(self) -> None:
        for p, layout in self.params:
            if p.grad is not None:
                self._step_param(p, p.grad.detach().float(), layout)

    def _step_param(self, p: torch.Tensor, g: torch.Tensor, layout: ParamLayout) -> None:
        beta1, beta2 = self.betas
        state = self.state.setdefault(p, {"step": 0})
        state["step"] += 1
        t = state["step"]
        bias_correction1 = 1.0 - power_of(beta1, t)
        bias_correction2 = 1.0 - power_of(beta2, t)
        w = p.detach().float()
        w.mul_(_f32(1.0 - self.lr * self.weight_decay))
        if layout.factored:
            direction = self._factored_direction(g, layout, state, bias_correction2)
            if layout.momentum:
                m = self._momentum_update(state, direction, beta1)
                w.add_(m * -_f32(self.lr / bias_correction1))
            else:
                w.add_(direction * -_f32(self.lr))
        else:
            v = state.setdefault("exp_avg_sq", torch.zeros_like(g))
            v.mul_(_f32(beta2)).add_(self._squared(g), alpha=_f32(1.0 - beta2))
            v_used = v if self.factor_floor is None else v.clamp(min=self.factor_floor)
            denom = v_used.sqrt() / _f32(math.sqrt(bias_correction2))
            if layout.momentum:
                m = self._momentum_update(state, g, beta1)
                w.add_((m * -_f32(self.lr / bias_correction1)) / denom)
            else:
                w.add_((g * -_f32(self.lr)) / denom)
        p.copy_(w)

    def _squared(self, g: torch.Tensor) -> torch.Tensor:
        return g * g + (0.0 if self.factor_floor is not None else _f32(self.eps))

    def _factored_direction(self, g: torch.Tensor, layout: ParamLayout,
                            state: dict[str, Any], bias_correction2: float) -> torch.Tensor:
        beta2 = self.betas[1]
        matrices = g.reshape(layout.experts, layout.rows, layout.cols)
        squared = self._squared(matrices)
        row = state.setdefault("exp_avg_sq_row", torch.zeros(layout.experts, layout.rows))
        col = state.setdefault("exp_avg_sq_col", torch.zeros(layout.experts, layout.cols))
        row.mul_(_f32(beta2)).add_(squared.mean(dim=2), alpha=_f32(1.0 - beta2))
        col.mul_(_f32(beta2)).add_(squared.mean(dim=1), alpha=_f32(1.0 - beta2))
        row_used, col_used = row, col
        if self.factor_floor is not None:
            row_used, col_used = row.clamp(min=self.factor_floor), col.clamp(min=self.factor_floor)
        # 1 / (mean(R) * bc2) in double, as the kernels compute it.
        inverse_norm = (1.0 / (row_used.double().mean(dim=1) * bias_correction2)).float()
        row_coef = 1.0 / (row_used * inverse_norm[:, None]).sqrt()
        col_coef = 1.0 / col_used.sqrt()
        direction = matrices * row_coef[:, :, None] * col_coef[:, None, :]
        rms = direction.double().square().mean(dim=(1, 2)).sqrt()
        clip = torch.where(rms > 1.0, 1.0 / rms, torch.ones_like(rms)).float()
        row_coef = row_coef * clip[:, None]
        direction = matrices * row_coef[:, :, None] * col_coef[:, None, :]
        return direction.reshape(g.shape)

    def _momentum_update(self, state: dict[str, Any], value: torch.Tensor,
                         beta1: float) -> torch.Tensor:
        m = state.setdefault("exp_avg", torch.zeros_like(value))
        m.lerp_(value, _f32(1.0 - beta1))
        if self.momentum_codec is None or not keeps_8bit_state(m, self.min_8bit_size):
            return m
        # The update uses the momentum before it is re-encoded (the kernels hold it in
        # registers); the state keeps the decoded codes.
        used = m.clone()
        encode, decode = self.momentum_codec
        row_length = m.shape[-1] if m.dim() >= 2 else 0
        codes, scales = encode(m.reshape(-1).contiguous(), row_length)
        m.copy_(decode(codes, scales, row_length).reshape(m.shape))
        return used


def _f32(value: float) -> float:
    """A Python float rounded to fp32, as the native kernels receive their scalars."""
    return float(torch.tensor(value, dtype=torch.float32))
