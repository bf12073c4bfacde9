"""Optimizer-step throughput of pagedoptim.AdamW (exact fp32 mode) against torch's AdamW on CPU.

For each workload -- one large tensor of 1M/16M/64M/256M params, and a LoRA-like set of 448
small adapter matrices -- times `step()` of pagedoptim.AdamW, torch.optim.AdamW(fused=True)
and torch.optim.AdamW(foreach=True) in the same process with interleaved repetitions, and
prints one JSON line per (workload, optimizer): params/s, the ratio to both torch baselines,
the achieved memory bandwidth, and its fraction of the bandwidth a streaming kernel (an
in-place add over 512 MiB buffers) reached in the same interleaved rounds.

    python benchmarks/step_throughput.py             # full run, about 2 minutes on 2 cores
    python benchmarks/step_throughput.py --quick     # smoke run, a few seconds
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Callable, Sequence

import torch

import pagedoptim
from utils import StreamingProbe, emit, measure_memory_bandwidth, significant, time_interleaved

# fp32 AdamW reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq: 7 x 4 B.
# This is the least any implementation must move, so GB/s below is "useful" bandwidth.
BYTES_PER_PARAM = 28

LARGE_TENSOR_SIZES = {"1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20, "256M": 256 << 20}

# One LoRA adapter pair per attention (4096-wide) and MLP (14336-wide) projection of a
# 7-8B-class model at rank 16; 112 of each shape, 448 tensors, 66M params.
LORA_SHAPES = ((16, 4096), (4096, 16), (16, 14336), (14336, 16))
LORA_GROUPS = 112
QUICK_LORA_GROUPS = 4

HYPERPARAMETERS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)

PROBE_NAME = "memory_probe"

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, OptimizerFactory] = {
    "pagedoptim": lambda params: pagedoptim.AdamW(
        params, **HYPERPARAMETERS, state_bits=32, master_bits=None
    ),
    "torch_fused": lambda params: torch.optim.AdamW(params, **HYPERPARAMETERS, fused=True),
    "torch_foreach": lambda params: torch.optim.AdamW(params, **HYPERPARAMETERS, foreach=True),
}


def make_params(shapes: Sequence[tuple[int, ...]], seed: int) -> list[torch.nn.Parameter]:
    """Random fp32 params with random grads; every optimizer gets an identical copy."""
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, generator=generator))
        param.grad = torch.randn(shape, generator=generator)
        params.append(param)
    return params


def benchmark_workload(
    label: str,
    shapes: Sequence[tuple[int, ...]],
    *,
    warmup: int,
    repeats: int,
    probe: StreamingProbe,
) -> None:
    """Time all optimizers on one workload and emit one JSON line per optimizer.

    All three optimizers and their states stay alive together so their timed repetitions can
    interleave; at 256M params that is 3 x 16 B/param = 12 GiB. The bandwidth probe takes turns
    with them, so each roofline fraction compares medians taken under the same conditions.
    """
    optimizers = {name: factory(make_params(shapes, seed=0)) for name, factory in OPTIMIZERS.items()}
    candidates = {name: optimizer.step for name, optimizer in optimizers.items()}
    timings = time_interleaved({**candidates, PROBE_NAME: probe}, warmup=warmup, repeats=repeats)
    del optimizers, candidates
    gc.collect()
    roofline_gbps = probe.gbps(timings.pop(PROBE_NAME).median)

    num_params = sum(torch.Size(shape).numel() for shape in shapes)
    params_per_s = {name: num_params / timing.median for name, timing in timings.items()}
    for name, timing in timings.items():
        achieved_gbps = params_per_s[name] * BYTES_PER_PARAM / 1e9
        emit(
            {
                "benchmark": "adamw_step_throughput",
                "size": label,
                "optimizer": name,
                "params": num_params,
                "tensors": len(shapes),
                "threads": torch.get_num_threads(),
                "median_s": significant(timing.median),
                "min_s": significant(timing.min),
                "repeats": repeats,
                "params_per_s": significant(params_per_s[name]),
                "ratio_vs_torch_fused": significant(params_per_s[name] / params_per_s["torch_fused"]),
                "ratio_vs_foreach": significant(params_per_s[name] / params_per_s["torch_foreach"]),
                "achieved_gbps": significant(achieved_gbps),
                "roofline_gbps": significant(roofline_gbps),
                "roofline_fraction": significant(achieved_gbps / roofline_gbps),
            }
        )


def lora_shapes(groups: int) -> list[tuple[int, int]]:
    return [shape for _ in range(groups) for shape in LORA_SHAPES]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--max-size",
        choices=list(LARGE_TENSOR_SIZES),
        default="256M",
        help="largest single-tensor size to run (256M needs about 15 GB of RAM)",
    )
    parser.add_argument("--no-lora", action="store_true", help="skip the LoRA-like set")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per optimizer")
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per optimizer")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1M tensor, a 16-tensor LoRA-like set, 1 warmup, 3 repeats",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.quick:
        args.max_size, args.warmup, args.repeats = "1M", 1, 3
    lora_groups = QUICK_LORA_GROUPS if args.quick else LORA_GROUPS

    # Measured first and alone, as the record of what the machine can do; the per-workload
    # roofline comes from the probe interleaved with the optimizers (see benchmark_workload).
    bandwidth = measure_memory_bandwidth(repeats=5 if args.quick else 10)
    emit(
        {
            "benchmark": "memory_bandwidth",
            "buffer_bytes": bandwidth.buffer_bytes,
            "threads": torch.get_num_threads(),
            "copy_gbps": significant(bandwidth.copy_gbps),
            "inplace_add_gbps": significant(bandwidth.inplace_add_gbps),
            # Other processes on the cores skew every figure; this records whether there were any.
            "load_average_1m": significant(os.getloadavg()[0]),
        }
    )

    workloads: list[tuple[str, list[tuple[int, ...]]]] = []
    for label, numel in LARGE_TENSOR_SIZES.items():
        workloads.append((label, [(numel,)]))
        if label == args.max_size:
            break
    if not args.no_lora:
        workloads.append((f"lora{len(LORA_SHAPES) * lora_groups}", lora_shapes(lora_groups)))

    probe = StreamingProbe()
    for label, shapes in workloads:
        benchmark_workload(label, shapes, warmup=args.warmup, repeats=args.repeats, probe=probe)


if __name__ == "__main__":
    main()
