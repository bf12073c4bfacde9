"""AdamW with companded 8-bit moments against exact fp32 AdamW, with and without the v floor.

The known failure of the companded format: when magnitudes inside a group of
32 differ by 100x and more, a small element's sqrt(v) falls below half a code of the group's
scale and decodes to 0 while its first moment keeps a nonzero code, so m / (sqrt(v) + eps)
explodes. The fix decodes code 0 as the top of its interval, (0.5/255 * s)^2, in AdamW's
denominator only (include/pagedoptim/codec/companding.h, decode_second_moment_for_denominator).

This script runs the codec of pagedoptim.reference (the plain PyTorch restatement of that
header's math, bit-identical to the native codec: fp32 throughout, fp16 scales rounded up,
round half to even) side by side with exact fp32 AdamW on the same gradient stream. Every group's per-element gradient magnitudes are log-uniform over 1e-8..1e2.
Scenarios: `dense` (zero-mean noise), `signal` (half the elements have a consistent sign),
`sparse` (as signal, but each element gets a gradient on 30% of the steps only, like embedding
rows), and `sparse_100x` (as sparse, magnitudes over 1e-2..1e0 only: the spread where the
failure starts). Modes, i.e. what code 0 of v decodes to in the denominator:
    off             0 (the plain decode)
    floor           the top of its interval, 0.5/255 * s in sqrt(v): the fix
and, for comparison, the alternatives that were measured and not chosen:
    floor_in_state  the same floor, also fed into the stored moving average
    bin_center      the middle of the interval, 0.25/255 * s
    m_proxy         min(|m|, 0.5/255 * s): the element's own first moment as a guess of sqrt(v)

The quantity compared is the normalized update u = m_hat / (sqrt(v_hat) + eps), the step in
units of lr. One JSON line per (scenario, mode):
    update_max_ratio   max |u_8bit| / max |u_exact|   over all elements and steps
    update_p99_ratio   p99 |u_8bit| / p99 |u_exact|
    abs_error_max/p99  of |u_8bit - u_exact|           (in units of lr)
    abs_error_median_large  median of that error where |u_exact| >= 0.1
    exploded           share of (element, step) with |u_8bit| > 10 * max |u_exact|
    frozen             share of (element, step) with |u_exact| >= 0.1 and |u_8bit| < 0.1 |u_exact|:
                       elements too small for their group's scale, whose update vanishes

    python benchmarks/codec_v_floor.py            # 1024 groups x 500 steps per scenario
    python benchmarks/codec_v_floor.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from pagedoptim.reference import (
    GROUP_SIZE,
    SECOND_MOMENT_CODE_MAX,
    decode_moment_groups as decode_moment,
    decode_second_moment_groups as decode_second_moment,
    encode_moment_groups as encode_moment,
    encode_second_moment_groups as encode_second_moment,
)
from utils import emit, significant

BETA1, BETA2, EPS = 0.9, 0.999, 1e-8
SPARSE_DENSITY = 0.3
MODES = ("off", "floor", "floor_in_state", "bin_center", "m_proxy")
# scenario -> ((log10 of the smallest, of the largest gradient magnitude in a group),
#              some elements have a steady sign, gradients present on SPARSE_DENSITY of steps)
SCENARIOS = {
    "dense": ((-8.0, 2.0), False, False),
    "signal": ((-8.0, 2.0), True, False),
    "sparse": ((-8.0, 2.0), True, True),
    "sparse_100x": ((-2.0, 0.0), True, True),
}


@dataclass
class ExactAdamW:
    m: torch.Tensor
    v: torch.Tensor

    def step(self, grad: torch.Tensor, step: int) -> torch.Tensor:
        self.m.lerp_(grad, 1.0 - BETA1)
        self.v.mul_(BETA2).addcmul_(grad, grad, value=1.0 - BETA2)
        bias_correction1 = 1.0 - BETA1**step
        bias_correction2_sqrt = (1.0 - BETA2**step) ** 0.5
        denom = self.v.sqrt() / bias_correction2_sqrt + EPS
        return self.m / bias_correction1 / denom


@dataclass
class CompandedAdamW:
    mode: str
    m_code: torch.Tensor
    m_scale: torch.Tensor
    v_code: torch.Tensor
    v_scale: torch.Tensor

    def step(self, grad: torch.Tensor, step: int) -> torch.Tensor:
        m_old = decode_moment(self.m_code, self.m_scale)
        m = m_old.lerp(grad, 1.0 - BETA1)
        grad_term = (1.0 - BETA2) * grad * grad
        in_state = 0.5 if self.mode == "floor_in_state" else 0.0
        v_state = decode_second_moment(self.v_code, self.v_scale, in_state) * BETA2 + grad_term
        if self.mode == "floor":
            v_denom = decode_second_moment(self.v_code, self.v_scale, 0.5) * BETA2 + grad_term
        elif self.mode == "bin_center":
            v_denom = decode_second_moment(self.v_code, self.v_scale, 0.25) * BETA2 + grad_term
        elif self.mode == "m_proxy":
            top = (self.v_scale * (0.5 / SECOND_MOMENT_CODE_MAX)).expand_as(m_old)
            guess = torch.minimum(m_old.abs(), top)
            plain = decode_second_moment(self.v_code, self.v_scale)
            v_old = torch.where(self.v_code == 0, guess * guess, plain)
            v_denom = v_old * BETA2 + grad_term
        else:
            v_denom = v_state
        bias_correction1 = 1.0 - BETA1**step
        bias_correction2_sqrt = (1.0 - BETA2**step) ** 0.5
        update = m / bias_correction1 / (v_denom.sqrt() / bias_correction2_sqrt + EPS)
        self.m_code, self.m_scale = encode_moment(m)
        self.v_code, self.v_scale = encode_second_moment(v_state)
        return update


def make_gradient_source(scenario: str, groups: int, generator: torch.Generator):
    (low, high), has_signal_elements, sparse = SCENARIOS[scenario]
    magnitude = 10.0 ** (low + (high - low) * torch.rand(groups, GROUP_SIZE, generator=generator))
    signal = torch.zeros(groups, GROUP_SIZE)
    if has_signal_elements:
        has_signal = torch.rand(groups, GROUP_SIZE, generator=generator) < 0.5
        sign = torch.where(torch.rand(groups, GROUP_SIZE, generator=generator) < 0.5, -1.0, 1.0)
        signal = torch.where(has_signal, sign, signal)

    def next_gradient() -> torch.Tensor:
        noise = torch.randn(groups, GROUP_SIZE, generator=generator)
        grad = magnitude * (signal + noise)
        if sparse:
            present = torch.rand(groups, GROUP_SIZE, generator=generator) < SPARSE_DENSITY
            grad = torch.where(present, grad, torch.zeros_like(grad))
        return grad

    return next_gradient


def percentile(values: torch.Tensor, q: float) -> float:
    flat = values.flatten()
    k = max(1, min(flat.numel(), int(round(q * flat.numel()))))
    return flat.kthvalue(k).values.item()


def run_scenario(scenario: str, groups: int, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    next_gradient = make_gradient_source(scenario, groups, generator)
    shape = (groups, GROUP_SIZE)
    exact = ExactAdamW(torch.zeros(shape), torch.zeros(shape))
    companded = {
        mode: CompandedAdamW(
            mode,
            m_code=torch.zeros(shape),
            m_scale=torch.zeros(groups, 1),
            v_code=torch.zeros(shape),
            v_scale=torch.zeros(groups, 1),
        )
        for mode in MODES
    }
    exact_updates = torch.empty(steps, groups * GROUP_SIZE)
    updates = {mode: torch.empty(steps, groups * GROUP_SIZE) for mode in MODES}
    for step in range(1, steps + 1):
        grad = next_gradient()
        exact_updates[step - 1] = exact.step(grad, step).flatten()
        for mode in MODES:
            updates[mode][step - 1] = companded[mode].step(grad, step).flatten()

    exact_abs = exact_updates.abs()
    exact_max = exact_abs.max().item()
    exact_p99 = percentile(exact_abs, 0.99)
    for mode in MODES:
        quantized_abs = updates[mode].abs()
        error = (updates[mode] - exact_updates).abs()
        quantized_max = quantized_abs.max().item()
        quantized_p99 = percentile(quantized_abs, 0.99)
        frozen = (exact_abs >= 0.1) & (quantized_abs < 0.1 * exact_abs)
        emit(
            {
                "bench": "codec_v_floor",
                "scenario": scenario,
                "mode": mode,
                "groups": groups,
                "steps": steps,
                "update_max": significant(quantized_max),
                "update_p99": significant(quantized_p99),
                "exact_update_max": significant(exact_max),
                "exact_update_p99": significant(exact_p99),
                "update_max_ratio": significant(quantized_max / exact_max),
                "update_p99_ratio": significant(quantized_p99 / exact_p99),
                "abs_error_max": significant(error.max().item()),
                "abs_error_p99": significant(percentile(error, 0.99)),
                "abs_error_median_large": significant(error[exact_abs >= 0.1].median().item()),
                "exploded": significant((quantized_abs > 10.0 * exact_max).double().mean().item()),
                "frozen": significant(frozen.double().mean().item()),
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="128 groups x 100 steps")
    parser.add_argument("--groups", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    groups, steps = (128, 100) if args.quick else (args.groups, args.steps)
    torch.set_num_threads(1)
    for index, scenario in enumerate(SCENARIOS):
        run_scenario(scenario, groups, steps, args.seed + index)


if __name__ == "__main__":
    main()
