"""Step throughput of 8-bit AdamW (companded state) against fp32 AdamW on the CPU.

For each workload -- one large fp32 tensor of 16M or 64M params, one 64M bf16 tensor, and the
LoRA-like set of step_throughput.py (448 adapter matrices, 66M params) -- times `step()` of

    ours_8bit        pagedoptim.AdamW(state_bits=8)           (fp32 params: no residual;
                                                               bf16 params: master_bits=24)
    ours_fp32        pagedoptim.AdamW(state_bits=32, master_bits=None on fp32 params,
                                      master_bits=24 on bf16 params)
    torch_fused      torch.optim.AdamW(fused=True) on fp32 params of the same size

in one process, with interleaved repetitions (benchmarks/utils.time_interleaved), and prints
one JSON line per (workload, optimizer): params/s, the ratio to torch_fused and to ours_fp32,
the bytes the step must move per param (8-bit on fp32 params: param 4+4, grad 4, m and v
codes 2x(1+1), scales 2x(2+2)/32: 16.25 B; on bf16 params with the 8-bit residual: param 2+2,
grad 2, residual 1+1, codes and scales as before: 12.25 B; fp32: 28 B) as GB/s and as a
fraction of the memory bandwidth measured at the start. The bf16 workload compares with torch
on fp32 params because that is what the residual replaces: an fp32 master copy.

The last line, {"benchmark": "compressed_targets", ...}, holds the speed targets: the 8-bit
step on 64M fp32 params and on 64M bf16 params (master_bits=24) each at least 0.8x
torch_fused on an AVX2 machine and 1.2x where the kernels run AVX-512 (`isa`).

    python benchmarks/compressed_throughput.py            # full run, a few minutes on 2 cores
    python benchmarks/compressed_throughput.py --quick    # smoke run: 1M tensors, 16 LoRA mats
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Sequence

import torch

import pagedoptim
from step_throughput import LORA_SHAPES, make_params
from utils import emit, measure_memory_bandwidth, significant, time_interleaved

HYPERPARAMETERS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
BYTES_PER_PARAM = {
    torch.float32: {"ours_8bit": 4 + 4 + 4 + 2 * (1 + 1) + 2 * (2 + 2) / 32,
                    "ours_fp32": 28, "torch_fused": 28},
    torch.bfloat16: {"ours_8bit": 2 + 2 + 2 + 1 + 1 + 2 * (1 + 1) + 2 * (2 + 2) / 32,
                     "ours_fp32": 2 + 2 + 2 + 1 + 1 + 16, "torch_fused": 28},
}
OPTIMIZERS = {
    "ours_8bit": lambda params: pagedoptim.AdamW(params, **HYPERPARAMETERS, state_bits=8),
    "ours_fp32": lambda params: pagedoptim.AdamW(
        params, **HYPERPARAMETERS, state_bits=32,
        master_bits=24 if params[0].dtype == torch.bfloat16 else None),
    "torch_fused": lambda params: torch.optim.AdamW(params, **HYPERPARAMETERS, fused=True),
}
SIZES = {"1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20}
TARGET_WORKLOADS = ("64M", "bf16_64M")


def target_ratio(isa: str) -> float:
    return 1.2 if isa == "avx512" else 0.8


def benchmark(label: str, shapes: Sequence[tuple[int, ...]], *, warmup: int, repeats: int,
              roofline_gbps: float, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Times the optimizers on `shapes`; ours get `dtype` params, torch fp32 ones."""
    def params_for(name: str) -> list[torch.nn.Parameter]:
        params = make_params(shapes, seed=0)
        if name == "torch_fused" or dtype == torch.float32:
            return params
        converted = []
        for p in params:
            q = torch.nn.Parameter(p.detach().to(dtype))
            q.grad = p.grad.to(dtype)
            converted.append(q)
        return converted

    optimizers = {name: make(params_for(name)) for name, make in OPTIMIZERS.items()}
    timings = time_interleaved({name: opt.step for name, opt in optimizers.items()},
                               warmup=warmup, repeats=repeats)
    del optimizers
    gc.collect()
    num_params = sum(torch.Size(s).numel() for s in shapes)
    rate = {name: num_params / t.median for name, t in timings.items()}
    for name, timing in timings.items():
        gbps = rate[name] * BYTES_PER_PARAM[dtype][name] / 1e9
        emit({
            "benchmark": "compressed_adamw_step",
            "workload": label,
            "optimizer": name,
            "param_dtype": str(dtype).removeprefix("torch."),
            "params": num_params,
            "tensors": len(shapes),
            "threads": torch.get_num_threads(),
            "median_s": significant(timing.median),
            "min_s": significant(timing.min),
            "repeats": repeats,
            "params_per_s": significant(rate[name]),
            "ratio_vs_torch_fused": significant(rate[name] / rate["torch_fused"]),
            "ratio_vs_ours_fp32": significant(rate[name] / rate["ours_fp32"]),
            "bytes_per_param": BYTES_PER_PARAM[dtype][name],
            "achieved_gbps": significant(gbps),
            "roofline_fraction": significant(gbps / roofline_gbps),
        })
    return {name: rate[name] / rate["torch_fused"] for name in rate}


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
    ratios = {}
    for label in sizes:
        ratios[label] = benchmark(label, [(SIZES[label],)], warmup=warmup, repeats=repeats,
                                  roofline_gbps=bandwidth.roofline_gbps)
    bf16_label = f"bf16_{sizes[-1]}"
    ratios[bf16_label] = benchmark(bf16_label, [(SIZES[sizes[-1]],)], warmup=warmup,
                                   repeats=repeats, roofline_gbps=bandwidth.roofline_gbps,
                                   dtype=torch.bfloat16)
    if not args.no_lora:
        shapes = [s for _ in range(lora_groups) for s in LORA_SHAPES]
        benchmark(f"lora{len(shapes)}", shapes, warmup=warmup, repeats=repeats,
                  roofline_gbps=bandwidth.roofline_gbps)
    isa = pagedoptim._C.cpu_isa()
    target = target_ratio(isa)
    targets = {label: {"value": significant(ratios[label]["ours_8bit"]), "target": target,
                       "met": ratios[label]["ours_8bit"] >= target}
               for label in TARGET_WORKLOADS if label in ratios}
    emit({"benchmark": "compressed_targets", "isa": isa, "load_average_1m": os.getloadavg()[0],
          "targets": targets})


if __name__ == "__main__":
    main()
