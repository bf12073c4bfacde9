"""The optimizers benchmarks/peers.py compares: ours, torch's, and the peers users choose between.

Each candidate names the package it needs and the devices it runs on. A candidate whose
package is missing, or that does not run on the device, is not dropped: `availability` gives
the reason, and peers.py prints it as a "skipped" line, so a reader sees what was not measured
and why. Factories import their package lazily, so this module imports with no peer installed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import pagedoptim

# Our paged candidate's GPU cache: small enough to fit the memory-pressure workload's headroom.
PAGED_CACHE_BYTES = 32 << 20

Factory = Callable[[list[torch.nn.Parameter], dict[str, Any]], torch.optim.Optimizer]


@dataclass(frozen=True)
class Candidate:
    name: str
    package: str | None  # the distribution that must be importable; None: torch or ours
    devices: tuple[str, ...]
    make: Factory
    note: str


def _bnb_adamw8bit(params, hyper):
    import bitsandbytes

    return bitsandbytes.optim.AdamW8bit(params, **hyper)


def _bnb_paged_adamw8bit(params, hyper):
    import bitsandbytes

    return bitsandbytes.optim.PagedAdamW8bit(params, **hyper)


def _torchao(class_name: str) -> Factory:
    def make(params, hyper):
        optim = importlib.import_module("torchao.optim")
        return getattr(optim, class_name)(params, **hyper)

    return make


def _torchao_cpu_offload(params, hyper):
    from torchao.optim import CPUOffloadOptimizer

    return CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True, **hyper)


def _deepspeed_cpu_adam(params, hyper):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, **hyper, adamw_mode=True)


def _flashoptim_adamw(params, hyper):
    from flashoptim import FlashAdamW

    return FlashAdamW(params, **hyper)


CANDIDATES: tuple[Candidate, ...] = (
    Candidate("torch_fused", None, ("cpu", "cuda"),
              lambda ps, h: torch.optim.AdamW(ps, **h, fused=True),
              "torch.optim.AdamW(fused=True): the baseline every ratio is relative to"),
    Candidate("torch_foreach", None, ("cpu", "cuda"),
              lambda ps, h: torch.optim.AdamW(ps, **h, foreach=True),
              "torch.optim.AdamW(foreach=True)"),
    Candidate("ours_exact", None, ("cpu", "cuda"),
              lambda ps, h: pagedoptim.AdamW(ps, **h, state_bits=32, master_bits=None),
              "pagedoptim.AdamW(state_bits=32, master_bits=None): fp32 states, torch's numerics"),
    Candidate("ours_8bit", None, ("cpu", "cuda"),
              lambda ps, h: pagedoptim.AdamW(ps, **h),
              "pagedoptim.AdamW() defaults: companded 8-bit m and v; on bf16 params also the "
              "int8 master residual (master_bits=24)"),
    Candidate("bnb_adamw8bit", "bitsandbytes", ("cpu", "cuda"), _bnb_adamw8bit,
              "bitsandbytes.optim.AdamW8bit (blockwise dynamic 8-bit; tensors under 4096 "
              "elements keep fp32 state)"),
    Candidate("torchao_adamw8bit", "torchao", ("cpu", "cuda"), _torchao("AdamW8bit"),
              "torchao.optim.AdamW8bit through torch.compile (tensors under 4096 elements keep "
              "fp32 state)"),
    Candidate("torchao_adamw4bit", "torchao", ("cpu", "cuda"), _torchao("AdamW4bit"),
              "torchao.optim.AdamW4bit through torch.compile"),
    Candidate("deepspeed_cpu_adam", "deepspeed", ("cpu",), _deepspeed_cpu_adam,
              "deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True): fp32 states, its own "
              "SIMD kernel (built with ninja on first use)"),
    Candidate("ours_8bit_paged", None, ("cuda",),
              lambda ps, h: pagedoptim.AdamW(ps, **h, offload="host", cache_bytes=PAGED_CACHE_BYTES),
              "pagedoptim.AdamW(offload='host', cache_bytes=32 MiB): 8-bit state paged between "
              "a small GPU cache and pinned host memory"),
    Candidate("bnb_paged_adamw8bit", "bitsandbytes", ("cuda",), _bnb_paged_adamw8bit,
              "bitsandbytes.optim.PagedAdamW8bit: 8-bit state in CUDA unified memory"),
    Candidate("torchao_cpu_offload", "torchao", ("cuda",), _torchao_cpu_offload,
              "torchao.optim.CPUOffloadOptimizer(torch.optim.AdamW, fused=True): fp32 state "
              "and the step on the host"),
    Candidate("flashoptim_adamw", "flashoptim", ("cuda",), _flashoptim_adamw,
              "flashoptim.FlashAdamW (defaults: quantized states, 24-bit master weights)"),
)

BASELINE = "torch_fused"
# The candidates that keep (part of) their state off the GPU: the memory-pressure workload on
# CUDA runs these with the GPU filled but for a little headroom (torch_fused there shows the
# out-of-memory error the others avoid).
PAGED = ("ours_8bit_paged", "bnb_paged_adamw8bit", "torchao_cpu_offload", BASELINE)


def package_version(package: str | None) -> str:
    if package is None:
        return torch.__version__
    from importlib import metadata

    return metadata.version(package)


def availability(candidate: Candidate, device: str) -> str | None:
    """None when `candidate` can run on `device`, else the reason it cannot."""
    if device not in candidate.devices:
        return f"runs on {' or '.join(candidate.devices)} only, not on {device}"
    if candidate.package is None:
        return None
    module = {"bitsandbytes": "bitsandbytes", "torchao": "torchao.optim",
              "deepspeed": "deepspeed.ops.adam", "flashoptim": "flashoptim"}[candidate.package]
    try:
        importlib.import_module(module)
    except Exception as error:  # a peer's import can fail in many ways; report, never crash
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"import {module} failed: {type(error).__name__}: {first_line}"[:300]
    return None
