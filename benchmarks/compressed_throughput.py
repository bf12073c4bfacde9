"""Step throughput of 8-bit AdamW (companded state) against fp32 AdamW on the CPU.

For each workload -- one large fp32 tensor of 16M or 64M params, and the LoRA-like set of
step_throughput.py (448 adapter matrices, 66M params) -- times `step()` of

    ours_8bit        pagedoptim.AdamW(state_bits=8)           (fp32 params: no residual)
    ours_fp32        pagedoptim.AdamW(state_bits=32, master_bits=None)
    torch_fused      torch.optim.AdamW(fused=True)

in one process, with interleaved repetitions (benchmarks/utils.time_interleaved), and prints
one JSON line per (workload, optimizer): params/s, the ratio to torch_fused and to ours_fp32,
the bytes the step must move per param (8-bit: param 4+4, grad 4, m and v codes 2x(1+1),
scales 2x(2+2)/32: 16.25 B; fp32: 28 B) as GB/s and as a fraction of the memory bandwidth
measured at the start. The 8-bit step does three divisions and a square root per element on
top (DESIGN.md section 6), so it need not reach the roofline.

    python benchmarks/compressed_throughput.py            # full run, a few minutes on 2 cores
    python benchmarks/compressed_throughput.py --quick    # smoke run: 1M tensor, 16 LoRA mats
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Sequence

import torch

import pagedoptim
from step_throughput import LORA_SHAPES, make_params
from utils import emit, measure_memory_bandwidth, significant, time_interleaved

HYPERPARAMETERS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
BYTES_PER_PARAM = {"ours_8bit": 4 + 4 + 4 + 2 * (1 + 1) + 2 * (2 + 2) / 32,
                   "ours_fp32": 28, "torch_fused": 28}
OPTIMIZERS = {
    "ours_8bit": lambda params: pagedoptim.AdamW(params, **HYPERPARAMETERS, state_bits=8),
    "ours_fp32": lambda params: pagedoptim.AdamW(params, **HYPERPARAMETERS, state_bits=32,
                                                 master_bits=None),
    "torch_fused": lambda params: torch.optim.AdamW(params, **HYPERPARAMETERS, fused=True),
}
SIZES = {"1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20}


def benchmark(label: str, shapes: Sequence[tuple[int, ...]], *, warmup: int, repeats: int,
              roofline_gbps: float) -> None:
    optimizers = {name: make(make_params(shapes, seed=0)) for name, make in OPTIMIZERS.items()}
    timings = time_interleaved({name: opt.step for name, opt in optimizers.items()},
                               warmup=warmup, repeats=repeats)
    del optimizers
    gc.collect()
    num_params = sum(torch.Size(s).numel() for s in shapes)
    rate = {name: num_params / t.median for name, t in timings.items()}
    for name, timing in timings.items():
        gbps = rate[name] * BYTES_PER_PARAM[name] / 1e9
        emit({
            "benchmark": "compressed_adamw_step",
            "workload": label,
            "optimizer": name,
            "params": num_params,
            "tensors": len(shapes),
            "threads": torch.get_num_threads(),
            "median_s": significant(timing.median),
            "min_s": significant(timing.min),
            "repeats": repeats,
            "params_per_s": significant(rate[name]),
            "ratio_vs_torch_fused": significant(rate[name] / rate["torch_fused"]),
            "ratio_vs_ours_fp32": significant(rate[name] / rate["ours_fp32"]),
            "bytes_per_param": BYTES_PER_PARAM[name],
            "achieved_gbps": significant(gbps),
            "roofline_fraction": significant(gbps / roofline_gbps),
        })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--no-lora", action="store_true")
    args = parser.parse_args()
    sizes = ["1M"] if args.quick else ["16M", "64M"]
    lora_groups = 4 if args.quick else 112
    warmup, repeats = (1, 3) if args.quick else (args.warmup, args.repeats)

    bandwidth = measure_memory_bandwidth(repeats=3 if args.quick else 8)
    emit({"benchmark": "memory_bandwidth", "threads": torch.get_num_threads(),
          "copy_gbps": significant(bandwidth.copy_gbps),
          "inplace_add_gbps": significant(bandwidth.inplace_add_gbps)})
    for label in sizes:
        benchmark(label, [(SIZES[label],)], warmup=warmup, repeats=repeats,
                  roofline_gbps=bandwidth.roofline_gbps)
    if not args.no_lora:
        shapes = [s for _ in range(lora_groups) for s in LORA_SHAPES]
        benchmark(f"lora{len(shapes)}", shapes, warmup=warmup, repeats=repeats,
                  roofline_gbps=bandwidth.roofline_gbps)


if __name__ == "__main__":
    main()
