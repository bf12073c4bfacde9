"""Optimizer step throughput of each pagedoptim mode against torch.optim.AdamW, timed in the
same rounds (interleaved, medians), as bench reports it and plan reads it back.

The mode names are the keys plan looks step throughput up by; keep them stable.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pagedoptim import optim
from pagedoptim.paging import MIN_CACHE_PAGES
from pagedoptim.paging.options import PAGE_ALIGNMENT
from pagedoptim.cli.timing import time_interleaved

TORCH_MODE = "torch_adamw"
MODES = (TORCH_MODE, "exact", "8bit", "bf16_master24", "8bit_nvme")

HYPERPARAMETERS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)

# The params are split over a few tensors, as in a model, so that the per-tensor work of
# every implementation (torch's foreach lists, our page packing) is part of what is timed.
TENSORS = 8

# 8-bit AdamW state: one int8 m and one uint8 v code per param, plus one fp16 scale per
# group of 32 for each (docs: companded 8-bit states).
EIGHT_BIT_STATE_BYTES_PER_PARAM = 2 + 2 * 2 / 32
# The paged mode keeps this share of its state resident, so most of every step's state
# really comes from the page file and goes back to it.
NVME_CACHE_FRACTION = 0.25


def nvme_page_file_bytes(num_params: int) -> int:
    """A generous estimate of the paged mode's page file (state plus page rounding), for the
    free-space check made before anything is written."""
    return int(num_params * EIGHT_BIT_STATE_BYTES_PER_PARAM * 1.25) + (8 << 20)


def nvme_cache_bytes(num_params: int) -> int:
    state_bytes = int(num_params * EIGHT_BIT_STATE_BYTES_PER_PARAM)
    return max(MIN_CACHE_PAGES * PAGE_ALIGNMENT, int(state_bytes * NVME_CACHE_FRACTION))


@dataclass(frozen=True)
class StepResult:
    mode: str
    params_per_s: float
    median_s: float
    what: str  # the optimizer and settings, for a person reading the table


def _tensor_sizes(num_params: int) -> list[int]:
    count = min(TENSORS, num_params)
    return [num_params // count + (1 if i < num_params % count else 0) for i in range(count)]


def _make_params(num_params: int, dtype: torch.dtype, device: torch.device) -> list[torch.nn.Parameter]:
    """Random params with random grads; every mode gets its own copy of the same values."""
    generator = torch.Generator().manual_seed(0)
    params = []
    for size in _tensor_sizes(num_params):
        # One row each: 2-D, as a model's weights (1-D params keep fp32 moments), with the
        # groups of a flat tensor.
        values = torch.randn(1, size, generator=generator)
        param = torch.nn.Parameter(values.to(device=device, dtype=dtype))
        param.grad = torch.randn(1, size, generator=generator).to(device=device, dtype=dtype)
        params.append(param)
    return params


def _torch_adamw(params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, str]:
    """torch's fastest AdamW here: fused where this torch has it for the device, else foreach."""
    try:
        return torch.optim.AdamW(params, **HYPERPARAMETERS, fused=True), "torch.optim.AdamW(fused=True)"
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, **HYPERPARAMETERS, foreach=True), "torch.optim.AdamW(foreach=True)"


def _build(mode: str, num_params: int, device: torch.device,
           nvme_dir: str) -> tuple[torch.optim.Optimizer, str]:
    if mode == TORCH_MODE:
        return _torch_adamw(_make_params(num_params, torch.float32, device))
    if mode == "exact":
        params = _make_params(num_params, torch.float32, device)
        return optim.AdamW(params, **HYPERPARAMETERS, state_bits=32), "state_bits=32, fp32 params"
    if mode == "8bit":
        params = _make_params(num_params, torch.float32, device)
        return optim.AdamW(params, **HYPERPARAMETERS), "state_bits=8 (default), fp32 params"
    if mode == "bf16_master24":
        params = _make_params(num_params, torch.bfloat16, device)
        return (optim.AdamW(params, **HYPERPARAMETERS, master_bits=24),
                "state_bits=8, bf16 params, master_bits=24")
    if mode == "8bit_nvme":
        params = _make_params(num_params, torch.float32, device)
        cache_bytes = nvme_cache_bytes(num_params)
        optimizer = optim.AdamW(params, **HYPERPARAMETERS, offload="nvme", nvme_dir=nvme_dir,
                                     cache_bytes=cache_bytes)
        return optimizer, f"state_bits=8, offload='nvme', cache_bytes={cache_bytes}"
    raise ValueError(f"unknown step mode {mode!r}; the modes are {', '.join(MODES)}")


def measure_steps(num_params: int, device: torch.device, nvme_dir: str, *, warmup: int,
                  repeats: int, on_round: Optional[Callable[[], None]] = None) -> list[StepResult]:
    """Every mode's step on `num_params` params, all alive at once so their repetitions can
    take turns; params/s from the median step time."""
    built = {mode: _build(mode, num_params, device, nvme_dir) for mode in MODES}
    try:
        timings = time_interleaved({mode: optimizer.step for mode, (optimizer, _) in built.items()},
                                   warmup=warmup, repeats=repeats, device=device,
                                   on_round=on_round)
        return [StepResult(mode, num_params / timings[mode].median, timings[mode].median, what)
                for mode, (_, what) in built.items()]
    finally:
        # The paged mode's page file goes with its optimizer; free it before the caller
        # goes on (writing the record), not at interpreter exit.
        built.clear()
        gc.collect()
