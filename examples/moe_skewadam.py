"""A Mixture-of-Experts model trained with po.SkewAdam, which keeps different state for the
backbone, the routed experts and the router, each parameter's tier read from its name: a
tiny Mixtral (random weights, a byte vocabulary) on the Python standard library's sources.

    pip install pagedoptim[hf]                    # transformers (for MixtralForCausalLM)
    python examples/moe_skewadam.py
    python examples/moe_skewadam.py --offload host --cache-bytes 65536
    python examples/moe_skewadam.py --steps 300 --hidden-size 256 --experts 16

The experts keep only a factored second moment (Adafactor's row and column means, per
expert), the router and the backbone a momentum as well (docs/skewadam.md), so the state is
a fraction of AdamW's 8 bytes per param. A script that builds torch.optim.AdamW gets the same
from `PAGEDOPTIM=1 PAGEDOPTIM_ALGORITHM=skewadam`; Trainer from optim="pagedoptim_skewadam".
The model runs on the GPU when there is one. The last line printed is one JSON object: the
losses and memory_report(), which counts elements and bytes per tier and per param.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import MixtralConfig, MixtralForCausalLM

import pagedoptim as po
from pagedoptim.cli.demo import BatchSampler, load_stdlib_bytes
from pagedoptim.paging.setting_text import byte_size_argument


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--offload", default="none", choices=("none", "host", "nvme"))
    parser.add_argument("--nvme-dir", default=None,
                        help="directory of the page file with --offload nvme (default: "
                             "$TMPDIR or /tmp)")
    parser.add_argument("--cache-bytes", type=byte_size_argument, default=None,
                        help="bytes of state kept resident with --offload, e.g. 64MiB (default 1 GiB)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.offload == "none" and (args.nvme_dir or args.cache_bytes is not None):
        parser.error("--nvme-dir and --cache-bytes need --offload host or nvme")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=256, hidden_size=args.hidden_size,
                           intermediate_size=2 * args.hidden_size, num_hidden_layers=args.layers,
                           num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=args.experts, num_experts_per_tok=2,
                           max_position_embeddings=args.seq_len)
    model = MixtralForCausalLM(config).to(device)
    offload = None if args.offload == "none" else args.offload
    optimizer = po.SkewAdam(model.named_parameters(), lr=args.lr, weight_decay=0.01,
                            offload=offload, nvme_dir=args.nvme_dir,
                            cache_bytes=args.cache_bytes)
    sampler = BatchSampler(load_stdlib_bytes(1 << 20), steps=args.steps, batch=args.batch_size,
                           seq_len=args.seq_len, seed=0)
    losses = []
    for step in range(args.steps):
        inputs, _ = (t.to(device) for t in sampler(step))
        loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    report = optimizer.memory_report()
    tiers = ", ".join(f"{tier} {entry['num_elements']:,} params {entry['state_bytes']:,} B"
                      for tier, entry in report["tiers"].items())
    print(f"SkewAdam on {device}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} "
          f"steps; by tier: {tiers}; optimizer state "
          f"{report['state_bytes'] / 2**20:.2f} MiB ({report['state_bytes_per_param']:.2f} "
          f"bytes per param; torch.optim.AdamW keeps 8)")
    print(json.dumps({"example": "moe_skewadam", "device": str(device), "steps": args.steps,
                      "losses": losses, "memory_report": report}))


if __name__ == "__main__":
    main()
