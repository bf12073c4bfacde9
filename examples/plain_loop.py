"""A plain PyTorch training loop that builds torch.optim.AdamW and never names pagedoptim;
PAGEDOPTIM=1 makes that same line build pagedoptim's AdamW, without editing the script.

    python examples/plain_loop.py                     # torch.optim.AdamW: fp32 moments
    PAGEDOPTIM=1 python examples/plain_loop.py        # pagedoptim's AdamW: 8-bit moments
    PAGEDOPTIM=1 PAGEDOPTIM_OFFLOAD=nvme PAGEDOPTIM_NVME_DIR=/tmp python examples/plain_loop.py
    PAGEDOPTIM=1 PAGEDOPTIM_STATE_BITS=32 PAGEDOPTIM_MASTER_BITS=none python examples/plain_loop.py
    python examples/plain_loop.py --steps 300 --hidden 512

The model predicts the next byte of the Python standard library's sources from the bytes
before it (nothing is downloaded), on the GPU when there is one. The script prints the
optimizer class it got, the loss, and last one JSON line with the state's bytes:
memory_report() when the optimizer has one (pagedoptim's), else counted from
optimizer.state (torch's).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import torch
import torch.nn.functional as F
from torch import nn


def stdlib_bytes(count: int) -> torch.Tensor:
    """The first `count` bytes of the standard library's top-level .py files, by name."""
    corpus = bytearray()
    for path in sorted(pathlib.Path(os.__file__).parent.glob("*.py")):
        corpus += path.read_bytes()
        if len(corpus) >= count:
            break
    return torch.tensor(list(corpus[:count]), dtype=torch.long)


class NextByte(nn.Module):
    """Next-byte logits from the `context` bytes before it: [batch, context] -> [batch, 256]."""

    def __init__(self, context: int, width: int, hidden: int):
        super().__init__()
        self.embedding = nn.Embedding(256, width)
        self.mlp = nn.Sequential(nn.Linear(context * width, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 256))

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embedding(context).flatten(1))


def state_report(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    if hasattr(optimizer, "memory_report"):
        return optimizer.memory_report()
    # torch.optim keeps plain tensors in optimizer.state: count them the same way.
    state_bytes = sum(value.numel() * value.element_size() for state in optimizer.state.values()
                      for value in state.values() if torch.is_tensor(value))
    elements = sum(p.numel() for p in model.parameters())
    return {"state_bytes": state_bytes, "num_elements": elements,
            "state_bytes_per_param": state_bytes / elements}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=16, help="bytes the model sees")
    parser.add_argument("--width", type=int, default=16, help="embedding size of a byte")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    corpus = stdlib_bytes(1 << 20).to(device)
    model = NextByte(args.context, args.width, args.hidden).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    optimizer_class = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    print(f"optimizer: {optimizer_class}", flush=True)

    offsets = torch.arange(args.context + 1, device=device)
    losses = []
    for step in range(args.steps):
        starts = torch.randint(0, corpus.numel() - args.context - 1, (args.batch, 1),
                               device=device)
        windows = corpus[starts + offsets]  # [batch, context + 1]
        loss = F.cross_entropy(model(windows[:, :-1]), windows[:, -1])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    report = state_report(optimizer, model)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps on {device}; "
          f"optimizer state {report['state_bytes'] / 2**20:.2f} MiB, "
          f"{report['state_bytes_per_param']:.2f} bytes per param")
    print(json.dumps({"example": "plain_loop", "optimizer": optimizer_class,
                      "device": str(device), "steps": args.steps, "losses": losses,
                      "memory_report": report}))


if __name__ == "__main__":
    main()
