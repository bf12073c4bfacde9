"""Bytes per parameter of training state: torch.optim.AdamW against pagedoptim's compressed
AdamW, from tensor storage and from the process's peak RSS, on a 100M+ parameter model.

Every configuration runs in a fresh subprocess (so peak RSS belongs to it alone): build the
model (the parameters of an MLP stack of 12 Linear(2048, 4096)/(4096, 2048) pairs, 201M params
with biases in the default `--layers 12`), record RSS, then run 3 steps (backward, optimizer
step, zero_grad(set_to_none=True)) and read ru_maxrss. The loss is sum(p * p) over the params:
each param gets a full, param-shaped gradient from autograd (so release_grads' hooks fire as in
training) while the forward holds no activations and no matmul workspace. That is deliberate:
activations and the CPU matmul's packed weight copies depend on the model, the batch and the
BLAS backend, not on the optimizer (in a trial, the first forward of a batch of 4 rows
through bf16 nn.Linear layers on this CPU added 76 MiB for 16.8M params, 4.7 B/param, that
stayed allocated), and they would blur the optimizer's share.
Figures per configuration:

    storage_bytes_per_param  (params + grads + optimizer state) / params, from the tensors
                             themselves: memory_report() for pagedoptim; for torch the
                             params', grads' and state tensors' storage
    rss_bytes_per_param      (peak RSS - RSS before the model was built) / params: what the
                             process really paid, allocator slack and temporaries included
    rss_delta_bytes_per_param (peak RSS - RSS after the model was built) / params: the same
                             without the params themselves

Configurations (bf16 = bf16 params and grads):
    torch_adamw_fp32         torch.optim.AdamW(fused=True), fp32 params: the 16 B/param baseline
    ours_8bit_master24       pagedoptim.AdamW, bf16, state_bits=8, master_bits=24 (goal <= 7.2)
    ours_8bit_master24_release   the same with release_grads=True (goal <= 5.2)
    ours_8bit_master32       bf16, int16 residual
    ours_32bit_fp32          pagedoptim.AdamW(state_bits=32, master_bits=None), fp32 params

    python benchmarks/memory.py                  # all configurations, about 3 minutes on 2 cores
    python benchmarks/memory.py --layers 2       # smoke run (34M params)
    python benchmarks/memory.py --config ours_8bit_master24   # one configuration
    python benchmarks/memory.py --mmap-threshold 1048576      # without glibc's heap caching
"""

from __future__ import annotations

import argparse
import json
import os

from pagedoptim.cli.process_memory import peak_rss_bytes, rss_bytes
from utils import emit, run_child

CONFIGS = {
    "torch_adamw_fp32": dict(optimizer="torch", dtype="float32"),
    "ours_8bit_master24": dict(optimizer="ours", dtype="bfloat16", state_bits=8, master_bits=24),
    "ours_8bit_master24_release": dict(optimizer="ours", dtype="bfloat16", state_bits=8,
                                       master_bits=24, release_grads=True),
    "ours_8bit_master32": dict(optimizer="ours", dtype="bfloat16", state_bits=8, master_bits=32),
    "ours_32bit_fp32": dict(optimizer="ours", dtype="float32", state_bits=32, master_bits=None),
}
WIDTH, HIDDEN, STEPS = 2048, 4096, 3


def tensor_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def measure(name: str, layers: int) -> dict:
    """Runs in the child process."""
    import torch

    import pagedoptim

    config = CONFIGS[name]
    torch.manual_seed(0)
    rss_before = rss_bytes()
    dtype = getattr(torch, config["dtype"])
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(WIDTH, HIDDEN, dtype=dtype), torch.nn.GELU(),
                   torch.nn.Linear(HIDDEN, WIDTH, dtype=dtype)]
    model = torch.nn.Sequential(*blocks)
    params = list(model.parameters())
    num_params = sum(p.numel() for p in params)
    rss_model = rss_bytes()

    hyper = dict(lr=1e-4, weight_decay=0.01)
    if config["optimizer"] == "torch":
        optimizer = torch.optim.AdamW(params, **hyper, fused=True)
    else:
        optimizer = pagedoptim.AdamW(params, **hyper, state_bits=config["state_bits"],
                                     master_bits=config["master_bits"],
                                     release_grads=config.get("release_grads", False))
    for step in range(STEPS):
        # One param-sized temporary at a time (p * p), freed by the sum.
        sum(torch.sum(p * p, dtype=torch.float32) for p in params).backward()
        if step == STEPS - 1:  # storage while grads exist (none with release_grads)
            if config["optimizer"] == "torch":
                state = [t for s in optimizer.state.values() for t in s.values()
                         if torch.is_tensor(t)]
                param_bytes = tensor_bytes(params)
                grad_bytes = tensor_bytes(p.grad for p in params if p.grad is not None)
                state_bytes = tensor_bytes(state)
            else:
                report = optimizer.memory_report()
                param_bytes, grad_bytes = report["param_bytes"], report["grad_bytes"]
                state_bytes = report["state_bytes"]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = peak_rss_bytes()

    storage = param_bytes + grad_bytes + state_bytes
    return {
        "benchmark": "memory",
        "config": name,
        "params": num_params,
        "param_dtype": config["dtype"],
        "param_bytes_per_param": round(param_bytes / num_params, 4),
        "grad_bytes_per_param": round(grad_bytes / num_params, 4),
        "state_bytes_per_param": round(state_bytes / num_params, 4),
        "storage_bytes_per_param": round(storage / num_params, 4),
        "rss_bytes_per_param": round((peak - rss_before) / num_params, 3),
        "rss_delta_bytes_per_param": round((peak - rss_model) / num_params, 3),
        "peak_rss_mib": round(peak / 2**20, 1),
        "rss_before_model_mib": round(rss_before / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12, help="Linear pairs (16.8M params each)")
    parser.add_argument("--config", choices=list(CONFIGS), action="append",
                        help="run only these configurations (repeatable)")
    parser.add_argument("--mmap-threshold", type=int,
                        help="run the children with MALLOC_MMAP_THRESHOLD_=BYTES: glibc then "
                             "maps every allocation above BYTES on its own and returns it on "
                             "free, instead of raising the threshold to the largest freed "
                             "block (up to 32 MiB) and keeping such blocks in its heap")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.layers)), flush=True)
        return
    env = dict(os.environ)
    if args.mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    for name in args.config or list(CONFIGS):
        record = run_child(__file__, ["--child", name, "--layers", str(args.layers)], env=env)
        record["malloc_mmap_threshold"] = args.mmap_threshold
        emit(record)


if __name__ == "__main__":
    main()
