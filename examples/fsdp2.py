"""FSDP2 with pagedoptim: shard a model with fully_shard, step it with po.AdamW, checkpoint
the sharded optimizer state with torch.distributed.checkpoint and resume from it.

    python examples/fsdp2.py                  # 2 processes: NCCL on the GPUs there are, else gloo
    python examples/fsdp2.py --nproc 1        # one GPU (or CPU process) is a mesh of one
    torchrun --nproc-per-node 2 examples/fsdp2.py --steps 20

Each rank steps only its shard of every parameter and keeps state for that shard alone;
memory_report() counts what this rank holds. Half-way the run saves a DCP checkpoint; at
the end a fresh model and optimizer load it, redo the second half and must end with the
same params and loss, bit for bit. Rank 0 prints one JSON line per rank.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard

import pagedoptim as po
from pagedoptim.cli.demo import BatchSampler, TinyCausalLM, load_stdlib_bytes


def build(args: argparse.Namespace, device: torch.device):
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyCausalLM(d_model=64, layers=2, heads=4, seq_len=args.seq_len).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    offload = None if args.offload == "none" else args.offload
    optimizer = po.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1,
                         state_bits=args.state_bits, offload=offload,
                         nvme_dir=args.nvme_dir if offload == "nvme" else None)
    return model, optimizer


def train(model, optimizer, sampler, steps: range, device: torch.device) -> float:
    """Trains on the sampler's batches of `steps`; the loss of the last one."""
    loss = torch.zeros(())
    for step in steps:
        inputs, targets = (t.to(device) for t in sampler(step))
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.item()


def run(args: argparse.Namespace) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = (torch.device("cuda", rank % torch.cuda.device_count())
              if torch.cuda.is_available() else torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    corpus = load_stdlib_bytes(1 << 20)
    # Each rank trains on its own batches: data parallelism.
    sampler = BatchSampler(corpus, steps=args.steps, batch=4, seq_len=args.seq_len, seed=rank)
    half = args.steps // 2

    model, optimizer = build(args, device)
    train(model, optimizer, sampler, range(half), device)
    dcp.save({"model": get_model_state_dict(model),
              "optimizer": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=args.checkpoint)
    final_loss = train(model, optimizer, sampler, range(half, args.steps), device)
    final_params = [p.full_tensor() for p in model.parameters()]
    report = optimizer.memory_report()

    resumed_model, resumed_optimizer = build(args, device)
    state = {"model": get_model_state_dict(resumed_model),
             "optimizer": get_optimizer_state_dict(resumed_model, resumed_optimizer)}
    dcp.load(state, checkpoint_id=args.checkpoint)
    set_model_state_dict(resumed_model, state["model"])
    set_optimizer_state_dict(resumed_model, resumed_optimizer, state["optimizer"])
    resumed_loss = train(resumed_model, resumed_optimizer, sampler, range(half, args.steps),
                         device)
    # The params after the last step: the loss above was computed before it.
    same_params = all(torch.equal(p.full_tensor(), q)
                      for p, q in zip(resumed_model.parameters(), final_params))
    return {"rank": rank, "world_size": world_size, "device": str(device),
            "backend": dist.get_backend(), "steps": args.steps, "final_loss": final_loss,
            "resumed_loss": resumed_loss,
            "resumed_matches": same_params and resumed_loss == final_loss,
            "local_elements": report["num_elements"], "state_bytes": report["state_bytes"],
            "state_bytes_per_param": report["state_bytes_per_param"],
            "state_placement": report["state_placement"]}


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    main(args)


def main(args: argparse.Namespace) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    try:
        result = run(args)
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        if dist.get_rank() == 0:
            for line in results:
                print(json.dumps(line), flush=True)
        if not result["resumed_matches"]:
            raise SystemExit(f"rank {result['rank']}: the resumed run ended with loss "
                             f"{result['resumed_loss']}, the uninterrupted one with "
                             f"{result['final_loss']}")
    finally:
        # The model's modules hold the device mesh, and through it the process group, in
        # reference cycles. Left to the interpreter's exit, gloo's worker threads outlive
        # destroy_process_group and drop their last finished work (whose tensors hold Python
        # objects) while the interpreter is being torn down: that takes the GIL from a
        # finalizing interpreter and aborts the rank ("terminate called without an active
        # exception", backtrace in ProcessGroupGloo::runLoop). Collected here, the group is
        # destroyed with the interpreter alive, and its threads join.
        gc.collect()
        dist.destroy_process_group()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="processes to start when not launched by torchrun (default 2)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--state-bits", type=int, default=8, choices=(8, 32))
    parser.add_argument("--offload", default="none", choices=("none", "host", "nvme"))
    parser.add_argument("--nvme-dir", default=None,
                        help="page files go here with --offload nvme (one per rank)")
    parser.add_argument("--checkpoint", default=None,
                        help="DCP checkpoint directory (default: a temporary one)")
    args = parser.parse_args()
    if args.steps < 4:
        parser.error(f"--steps must be at least 4 (the second half, redone after the resume, "
                     f"must step from loaded state more than once), got {args.steps}")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        arguments.checkpoint = arguments.checkpoint or os.path.join(scratch, "checkpoint")
        if "RANK" in os.environ:  # launched by torchrun
            main(arguments)
        else:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                free_port = probe.getsockname()[1]
            torch.multiprocessing.spawn(worker, args=(arguments.nproc, free_port, arguments),
                                        nprocs=arguments.nproc)
