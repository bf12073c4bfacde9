"""SkewAdam against torch.optim.AdamW and 8-bit AdamW (pagedoptim.AdamW, state_bits=8), all
measured in the same run. One JSON line per result:

  state_bytes   optimizer state of an expert-heavy Mixtral (transformers, random weights):
                bytes, bytes per parameter and the ratio to torch AdamW; SkewAdam per tier
  step_time     seconds per optimizer step on that model (random gradients, fp32): the median
                of rounds in which every optimizer steps once, in turn; the ratio to torch
                AdamW (default foreach and fused=True), and what phase 1 (the row and column
                statistics) would cost as plain torch ops, for scale
  skewadam_target  SkewAdam's speed against torch's fused AdamW (target: at least 1.0)
  loss          the tiny MoE language model of tests/python/test_skewadam_lm.py (byte
                vocabulary, Python stdlib sources as text), final loss per optimizer; the
                curves go to docs/skewadam_loss.png
  eps_update    the epsilon placement: first-step update RMS of a [256, 256] matrix (units
                of lr) for gradient scales 1 .. 1e-6, eps=1e-30 on g^2 against a 1e-8 floor
                on the row and column means (plain PyTorch reference, same formulas)
  eps_loss      the same two placements training the tiny MoE with its loss scaled by 1e-4
                (gradients of ~1e-6, as with a small loss scale or a long, flat run)

    python benchmarks/skewadam.py                 # everything (a few minutes on 2 cores)
    python benchmarks/skewadam.py --quick         # smoke run
    python benchmarks/skewadam.py --only state    # or loss, eps
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

import pagedoptim as po
from pagedoptim.reference.skewadam import SkewAdamReference

sys.path.insert(0, str(Path(__file__).resolve().parent))
from utils import emit, time_interleaved  # noqa: E402

DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs")
STDLIB_FILES = ("textwrap.py", "argparse.py", "functools.py", "inspect.py")


def mixtral(hidden, intermediate, experts, layers, seq):
    import transformers
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=seq,
        tie_word_embeddings=False)
    return transformers.MixtralForCausalLM(config)


def torch_state_bytes(opt):
    return sum(t.numel() * t.element_size() for state in opt.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))


def random_grads(model, seed):
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3


def optimizers(model):
    named = list(model.named_parameters())
    return {
        "torch_adamw": lambda: torch.optim.AdamW(model.parameters(), lr=1e-4),
        "torch_adamw_fused": lambda: torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True),
        "pagedoptim_adamw_8bit": lambda: po.AdamW(model.parameters(), lr=1e-4, state_bits=8),
        "skewadam": lambda: po.SkewAdam(named, lr=1e-4, state_bits=8),
    }


def bench_state_and_time(quick):
    hidden, intermediate, experts = (64, 256, 8) if quick else (256, 1024, 16)
    model = mixtral(hidden, intermediate, experts, layers=2, seq=64)
    num_params = sum(p.numel() for p in model.parameters())
    config = dict(hidden=hidden, intermediate=intermediate, experts=experts, layers=2,
                  num_params=num_params)
    random_grads(model, 0)
    snapshot = [p.detach().clone() for p in model.parameters()]
    baseline_bytes = None
    live = {}
    for name, make in optimizers(model).items():
        with torch.no_grad():
            for p, saved in zip(model.parameters(), snapshot):
                p.copy_(saved)
        opt = make()
        opt.step()  # state exists from here on
        if name.startswith("torch"):
            state_bytes = payload_bytes = torch_state_bytes(opt)
            tiers = None
        else:
            report = opt.memory_report()
            state_bytes = report["state_bytes"]
            # Without the unused end of the last page of each page kind.
            payload_bytes = state_bytes - report["page_slack_bytes"]
            tiers = report.get("tiers")
        if name == "torch_adamw":
            baseline_bytes = state_bytes
        if name != "torch_adamw_fused":
            emit(dict(bench="state_bytes", optimizer=name, **config, state_bytes=state_bytes,
                 bytes_per_param=state_bytes / num_params,
                 ratio_to_torch_adamw=state_bytes / baseline_bytes,
                 payload_bytes=payload_bytes,
                 payload_ratio_to_torch_adamw=payload_bytes / baseline_bytes, tiers=tiers))
        live[name] = opt

    # The optimizers take their steps in turn (time_interleaved: one step each per round, the
    # order rotated every round) and each is timed by its median step: timed one after another,
    # a shared VM's speed changes between them and single runs moved the ratios by 10-15%. They
    # share the model's parameters, which changes nothing in what a step costs.
    factored = [p.grad for n, p in model.named_parameters() if p.dim() >= 2 and "gate." not in n]

    def torch_ops_statistics():
        for g in factored:
            squared = g.square()
            squared.mean(dim=-1)
            squared.mean(dim=-2)

    timed = {name: opt.step for name, opt in live.items()}
    timed["torch_ops_factor_statistics_only"] = torch_ops_statistics
    rounds = 3 if quick else 21
    timings = time_interleaved(timed, warmup=1, repeats=rounds)
    seconds = {name: timing.median for name, timing in timings.items()}
    for name in live:
        emit(dict(bench="step_time", optimizer=name, **config, seconds=seconds[name],
             min_seconds=timings[name].min, rounds=rounds,
             params_per_second=num_params / seconds[name],
             ratio_to_torch_adamw=seconds[name] / seconds["torch_adamw"],
             ratio_to_torch_adamw_fused=seconds[name] / seconds["torch_adamw_fused"],
             speed_vs_torch_adamw_fused=seconds["torch_adamw_fused"] / seconds[name],
             threads=torch.get_num_threads()))
    stats_seconds = seconds["torch_ops_factor_statistics_only"]
    emit(dict(bench="step_time", optimizer="torch_ops_factor_statistics_only", **config,
         seconds=stats_seconds, rounds=rounds,
         ratio_to_torch_adamw=stats_seconds / seconds["torch_adamw"]))
    emit(dict(bench="skewadam_target", threads=torch.get_num_threads(),
         speed_vs_torch_adamw_fused=seconds["torch_adamw_fused"] / seconds["skewadam"],
         target=1.0, met=seconds["skewadam"] <= seconds["torch_adamw_fused"]))


def corpus():
    root = os.path.dirname(os.__file__)
    data = b"".join(open(os.path.join(root, name), "rb").read() for name in STDLIB_FILES)
    return torch.tensor(list(data), dtype=torch.long)


def train_tiny(make_optimizer, data, steps, loss_scale=1.0):
    model = mixtral(32, 128, 8, layers=2, seq=32)
    opt = make_optimizer(model)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - 32, (8,), generator=generator)
        batch = torch.stack([data[s:s + 32] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        (loss * loss_scale).backward()
        opt.step()
        for p in model.parameters():
            p.grad = None
        losses.append(loss.item())
    return losses


class ReferenceOptimizer:
    """SkewAdamReference over a model's named parameters, tiers from the default patterns."""

    def __init__(self, model, **kwargs):
        probe = po.SkewAdam(list(model.named_parameters()))
        tiers = probe.param_tiers()
        self.inner = SkewAdamReference([(p, tiers[n]) for n, p in model.named_parameters()],
                                       **kwargs)

    def step(self):
        self.inner.step()


def bench_loss(quick):
    data = corpus()
    steps = 30 if quick else 300
    lr = 3e-3
    runs = {
        "torch_adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0),
        "pagedoptim_adamw_8bit": lambda m: po.AdamW(m.parameters(), lr=lr, weight_decay=0.0,
                                                    state_bits=8),
        "skewadam": lambda m: po.SkewAdam(list(m.named_parameters()), lr=lr, state_bits=8),
    }
    curves = {}
    for name, make in runs.items():
        start = time.perf_counter()
        curves[name] = train_tiny(make, data, steps)
        tail = curves[name][-20:]
        emit(dict(bench="loss", optimizer=name, steps=steps, lr=lr,
             final_loss=sum(tail) / len(tail), seconds=time.perf_counter() - start))
    final = {name: sum(c[-20:]) / len(c[-20:]) for name, c in curves.items()}
    emit(dict(bench="loss", optimizer="skewadam", relative_to_torch_adamw=(
        final["skewadam"] / final["torch_adamw"] - 1.0)))
    plot(curves, os.path.join(DOCS, "skewadam_loss.png"))


def plot(curves, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(values, window=10):
        return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
                for i in range(len(values))]

    figure, axes = plt.subplots(figsize=(7, 4))
    labels = {"torch_adamw": "torch.optim.AdamW (fp32 state)",
              "pagedoptim_adamw_8bit": "pagedoptim.AdamW, 8-bit state",
              "skewadam": "pagedoptim.SkewAdam"}
    for name, values in curves.items():
        axes.plot(smooth(values), label=labels[name])
    axes.set_xlabel("step")
    axes.set_ylabel("training loss (10-step mean)")
    axes.set_title("Tiny Mixtral (8 experts, byte vocabulary, stdlib text)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def bench_eps(quick):
    torch.manual_seed(0)
    base = torch.randn(256, 256)
    for scale in (1.0, 1e-2, 1e-4, 1e-5, 1e-6):
        results = {}
        for name, kwargs in (("eps_on_g2", dict(eps=1e-30)), ("floor_1e-8", dict(factor_floor=1e-8))):
            p = torch.nn.Parameter(torch.zeros(256, 256))
            opt = SkewAdamReference([(p, "experts")], lr=1.0, **kwargs)
            for step in range(10):
                p.grad = base * scale
                before = p.detach().clone()
                opt.step()
                if step in (0, 9):
                    results[f"{name}_step{step + 1}"] = (p.detach() - before).square().mean().sqrt().item()
        emit(dict(bench="eps_update", grad_scale=scale, **results))
    data = corpus()
    steps = 30 if quick else 300
    for name, kwargs in (("eps_on_g2", dict(eps=1e-30)), ("floor_1e-8", dict(factor_floor=1e-8))):
        for loss_scale in (1.0, 1e-4):
            losses = train_tiny(lambda m: ReferenceOptimizer(m, lr=3e-3, **kwargs), data, steps,
                                loss_scale=loss_scale)
            emit(dict(bench="eps_loss", placement=name, loss_scale=loss_scale, steps=steps,
                 final_loss=sum(losses[-20:]) / 20))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few steps")
    parser.add_argument("--only", choices=("state", "loss", "eps"), default=None)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a shared 2-core machine more threads "
                             "spin-wait for each other and measure the neighbours)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.only in (None, "state"):
        bench_state_and_time(args.quick)
    if args.only in (None, "loss"):
        bench_loss(args.quick)
    if args.only in (None, "eps"):
        bench_eps(args.quick)


if __name__ == "__main__":
    main()
