"""Loss curves of a tiny byte-level language model under fp32 AdamW and 8-bit variants.

The model and data are those of tests/python/test_compressed_convergence.py: a 2-layer
pre-norm transformer (d=32, context 32, 43K params) over the bytes of the Python standard
library's functools.py, argparse.py and textwrap.py; seed 0, batch 16, lr 1e-2, weight decay
0.01, betas (0.9, 0.999). Curves (same initial weights, same batches):

    torch_fp32            torch.optim.AdamW: the baseline
    ours_8bit             pagedoptim.AdamW (companded 8-bit m and v, v floor on)
    ours_bf16_master24    pagedoptim.AdamW on bf16 params and grads, master_bits=24
    reference_floor_on    pagedoptim.reference.ReferenceAdamW: the plain PyTorch restatement
                          of the kernel math (must equal ours_8bit bit for bit)
    reference_floor_off   the same with code 0 of v decoded as 0 in the denominator (the
                          format's known failure, which the native kernel does not offer)
    naive_linear_8bit     NOT pagedoptim: a plain PyTorch AdamW whose m and v are stored as
                          linear absmax codes (int8 m = round(127 m / s), uint8 v =
                          round(255 v / s), groups of 32, fp16 scale rounded up): the same
                          bytes as ours without companding and without coding sqrt(v)

One JSON line per curve with the final loss (mean of the last 20 steps), its ratio to
torch_fp32 and the largest loss over the run (divergence shows there); docs/convergence.png
plots the curves (smoothed over 20 steps).

    python benchmarks/convergence.py                 # 500 steps, about 2 minutes on 2 cores
    python benchmarks/convergence.py --seeds 3       # seeds 0, 1, 2 and a summary line per curve
    python benchmarks/convergence.py --steps 100     # smoke run
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import pagedoptim
from pagedoptim import reference
from utils import emit, significant

BATCH, CONTEXT, WIDTH, LAYERS, HEADS = 16, 32, 32, 2, 4
LAST = 20
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
PLOT = Path(__file__).resolve().parent.parent / "docs" / "convergence.png"


def corpus() -> torch.Tensor:
    root = os.path.dirname(os.__file__)
    text = b"".join(open(os.path.join(root, name), "rb").read()
                    for name in ("functools.py", "argparse.py", "textwrap.py"))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


class TinyLM(nn.Module):
    """Pre-norm transformer over bytes; weights are cast to fp32 where they are used (so bf16
    params run fp32 matmuls). Same as the convergence test's model."""

    def __init__(self, generator: torch.Generator, dtype: torch.dtype) -> None:
        super().__init__()

        def param(*shape, std=0.02, value=None):
            t = torch.full(shape, value) if value is not None else \
                torch.randn(shape, generator=generator) * std
            return nn.Parameter(t.to(dtype))

        d = WIDTH
        self.embed = param(256, d)
        self.position = param(CONTEXT, d)
        self.blocks = nn.ModuleList()
        for _ in range(LAYERS):
            block = nn.Module()
            block.norm1, block.norm2 = param(d, value=1.0), param(d, value=1.0)
            block.qkv, block.qkv_bias = param(3 * d, d), param(3 * d, value=0.0)
            block.proj, block.proj_bias = param(d, d), param(d, value=0.0)
            block.up, block.up_bias = param(4 * d, d), param(4 * d, value=0.0)
            block.down, block.down_bias = param(d, 4 * d), param(d, value=0.0)
            self.blocks.append(block)
        self.norm = param(d, value=1.0)
        self.head = param(256, d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        d = WIDTH
        x = F.embedding(tokens, self.embed.float()) + self.position.float()[:t]
        for blk in self.blocks:
            h = F.layer_norm(x, (d,), blk.norm1.float())
            qkv = F.linear(h, blk.qkv.float(), blk.qkv_bias.float())
            q, k, v = qkv.view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
            attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + F.linear(attention.transpose(1, 2).reshape(b, t, d), blk.proj.float(),
                             blk.proj_bias.float())
            h = F.layer_norm(x, (d,), blk.norm2.float())
            h = F.gelu(F.linear(h, blk.up.float(), blk.up_bias.float()))
            x = x + F.linear(h, blk.down.float(), blk.down_bias.float())
        return F.linear(F.layer_norm(x, (d,), self.norm.float()), self.head.float())


class NaiveLinear8bitAdamW(torch.optim.Optimizer):
    """Baseline for comparison only, not part of pagedoptim: AdamW with m and v stored as
    *linear* absmax codes per group of 32 (int8 m, uint8 v -- v itself, not sqrt(v)), with an
    fp16 scale rounded up like ours. Same bytes as the companded format, none of its design."""

    def __init__(self, params, lr, betas, eps, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @staticmethod
    def _quantize(values: torch.Tensor, code_max: float) -> tuple[torch.Tensor, torch.Tensor]:
        groups = reference._to_groups(values)
        scale = reference.fp16_scale_at_least(groups.abs().amax(dim=1, keepdim=True))
        codes = torch.round(groups * reference.scale_reciprocal(scale) * code_max)
        return codes, scale

    @staticmethod
    def _dequantize(codes, scale, code_max, like):
        return reference._from_groups(codes / code_max * scale, like)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["m"] = self._quantize(torch.zeros_like(p), 127.0)
                    state["v"] = self._quantize(torch.zeros_like(p), 255.0)
                state["step"] += 1
                t = state["step"]
                m = self._dequantize(*state["m"], 127.0, p)
                v = self._dequantize(*state["v"], 255.0, p)
                g = p.grad.float()
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (v / (1 - beta2**t)).sqrt().add_(group["eps"])
                p.add_(m / (1 - beta1**t) / denom, alpha=-group["lr"])
                state["m"] = self._quantize(m, 127.0)
                state["v"] = self._quantize(v, 255.0)


# The tiny LM's matrices are all under the default min_8bit_size (4096 elements), which would
# keep them in fp32: every matrix keeps 8-bit moments here (its 1-D params fp32, as always),
# so the curves measure the 8-bit format.
EIGHT_BIT = dict(min_8bit_size=0)

CURVES = {
    "torch_fp32": (lambda ps: torch.optim.AdamW(ps, **HYPER), torch.float32),
    "ours_8bit": (lambda ps: pagedoptim.AdamW(ps, **HYPER, **EIGHT_BIT), torch.float32),
    "ours_bf16_master24": (lambda ps: pagedoptim.AdamW(ps, **HYPER, master_bits=24,
                                                       **EIGHT_BIT), torch.bfloat16),
    "reference_floor_on": (lambda ps: reference.ReferenceAdamW(ps, **HYPER, v_floor=True,
                                                               **EIGHT_BIT), torch.float32),
    "reference_floor_off": (lambda ps: reference.ReferenceAdamW(ps, **HYPER, v_floor=False,
                                                                **EIGHT_BIT), torch.float32),
    "naive_linear_8bit": (lambda ps: NaiveLinear8bitAdamW(ps, **HYPER), torch.float32),
}


def train(make_optimizer, dtype: torch.dtype, steps: int, seed: int = 0) -> list[float]:
    data = corpus()
    model = TinyLM(torch.Generator().manual_seed(seed), dtype)
    optimizer = make_optimizer(list(model.parameters()))
    batches = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        start = torch.randint(0, data.numel() - CONTEXT - 1, (BATCH,), generator=batches)
        window = torch.stack([data[i:i + CONTEXT + 1] for i in start.tolist()])
        loss = F.cross_entropy(model(window[:, :-1]).reshape(-1, 256),
                               window[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (full, tail) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, losses in curves.items():
        style = "--" if name.startswith("reference") else "-"
        for axis in (full, tail):
            axis.plot(smooth(losses, LAST), style, label=name, linewidth=1.2)
    full.set_title("tiny byte LM, training loss (20-step mean)")
    full.set_xlabel("step")
    full.set_ylabel("cross-entropy (nats)")
    full.set_ylim(top=min(6.0, full.get_ylim()[1]))
    start = len(next(iter(curves.values()))) // 2
    baseline = smooth(curves["torch_fp32"], LAST)[start:]
    tail.set_xlim(start, len(baseline) + start)
    tail.set_ylim(min(baseline) * 0.97, max(baseline) * 1.08)
    tail.set_title("second half, zoomed")
    tail.set_xlabel("step")
    full.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: small matmuls on 2 shared cores)")
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--seeds", type=int, default=1,
                        help="repeat with seeds 0..N-1 (init and batches); the plot shows seed 0")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ratios: dict[str, list[float]] = {name: [] for name in CURVES}
    for seed in range(args.seeds):
        curves = {name: train(make, dtype, args.steps, seed)
                  for name, (make, dtype) in CURVES.items()}
        baseline = sum(curves["torch_fp32"][-LAST:]) / len(curves["torch_fp32"][-LAST:])
        for name, losses in curves.items():
            final = sum(losses[-LAST:]) / len(losses[-LAST:])
            ratios[name].append(final / baseline)
            emit({"benchmark": "convergence", "curve": name, "seed": seed, "steps": args.steps,
                  "final_loss": significant(final),
                  "ratio_vs_torch_fp32": significant(final / baseline),
                  "max_loss": significant(max(losses)), "first_loss": significant(losses[0]),
                  "identical_to_ours_8bit": losses == curves["ours_8bit"]})
        if seed == 0 and not args.no_plot:
            plot(curves, args.plot)
    if args.seeds > 1:
        for name, values in ratios.items():
            emit({"benchmark": "convergence_summary", "curve": name, "seeds": args.seeds,
                  "steps": args.steps,
                  "ratio_vs_torch_fp32_mean": significant(sum(values) / len(values)),
                  "ratio_vs_torch_fp32_min": significant(min(values)),
                  "ratio_vs_torch_fp32_max": significant(max(values))})


if __name__ == "__main__":
    main()
