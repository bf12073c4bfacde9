"""`python -m pagedoptim demo`: pagedoptim.AdamW next to torch.optim.AdamW on a real training run.

Trains a tiny byte-level causal language model twice -- once with pagedoptim.AdamW, once with
torch.optim.AdamW -- from the same initial weights on the same batches, then prints both loss
curves, the optimizer-state memory and the wall time side by side. The text is the Python
standard library's own source code, so the demo needs no download and reads the same bytes on
every machine with the same Python version.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import pagedoptim

VOCAB_SIZE = 256  # bytes
PAGEDOPTIM_NAME = "pagedoptim.AdamW"
TORCH_NAME = "torch.optim.AdamW"
BETAS = (0.9, 0.95)  # the usual choice for LM pretraining


# --- data ----------------------------------------------------------------------------------


def load_stdlib_bytes(byte_budget: int) -> torch.Tensor:
    """The first `byte_budget` bytes of the standard library's top-level .py files, by name.

    Only the top level of the `os` module's directory is read: its subdirectories include
    site-packages, whose contents differ from machine to machine.
    """
    stdlib_dir = pathlib.Path(os.__file__).resolve().parent
    corpus = bytearray()
    for path in sorted(stdlib_dir.glob("*.py"), key=lambda p: p.name):
        corpus += path.read_bytes()
        if len(corpus) >= byte_budget:
            break
    del corpus[byte_budget:]
    return torch.frombuffer(corpus, dtype=torch.uint8).long()


class BatchSampler:
    """Random windows of the corpus; the window starts for every step are drawn up front
    from a seeded generator so both training runs see identical batches."""

    def __init__(self, corpus: torch.Tensor, *, steps: int, batch: int, seq_len: int, seed: int):
        if corpus.numel() <= seq_len + 1:
            raise ValueError(
                f"seq_len={seq_len} needs a corpus longer than {seq_len + 1} bytes, "
                f"got {corpus.numel()}; raise --corpus-bytes"
            )
        generator = torch.Generator().manual_seed(seed)
        self._corpus = corpus
        self._starts = torch.randint(0, corpus.numel() - seq_len - 1, (steps, batch), generator=generator)
        self._offsets = torch.arange(seq_len + 1)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self._corpus[self._starts[step].unsqueeze(1) + self._offsets]  # [batch, seq_len+1]
        return windows[:, :-1], windows[:, 1:]


# --- model ---------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, d_model = x.shape
        # [batch, seq, 3*d] -> 3 x [batch, heads, seq, d/heads]
        q, k, v = (
            self.qkv(x).view(batch, seq_len, 3, self.heads, d_model // self.heads).permute(2, 0, 3, 1, 4)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq_len, d_model))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyCausalLM(nn.Module):
    def __init__(self, *, d_model: int, layers: int, heads: int, seq_len: int):
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB_SIZE, d_model)
        self.position_embedding = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.final_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE, bias=False)
        self.head.weight = self.token_embedding.weight  # tied, as in GPT-2
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


# --- measurement ---------------------------------------------------------------------------


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state, from the optimizer's own accounting when it has one.

    torch's optimizers have none, so their state tensors are summed; for pagedoptim the report
    is authoritative (it knows about page padding and compressed streams).
    """
    memory_report = getattr(optimizer, "memory_report", None)
    if memory_report is not None:
        return int(memory_report()["state_bytes"])
    return sum(
        value.numel() * value.element_size()
        for param_state in optimizer.state_dict()["state"].values()
        for value in param_state.values()
        if isinstance(value, torch.Tensor)
    )


class _SimpleProgressBar:
    """The subset of tqdm's interface used below, drawn with carriage returns on stderr."""

    _WIDTH = 30

    def __init__(self, total: int, desc: str):
        self._total, self._desc, self._done, self._postfix = total, desc, 0, ""
        self._drawn_fraction = -1.0

    def set_postfix_str(self, postfix: str) -> None:
        self._postfix = postfix

    def update(self, count: int) -> None:
        self._done += count
        fraction = self._done / self._total
        # Redraw on each visible change only, so a long run does not flood a logged stderr.
        if fraction - self._drawn_fraction >= 1 / self._WIDTH or self._done == self._total:
            self._drawn_fraction = fraction
            filled = int(fraction * self._WIDTH)
            bar = "#" * filled + "." * (self._WIDTH - filled)
            sys.stderr.write(f"\r{self._desc} [{bar}] {self._done}/{self._total} {self._postfix}")
            sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def progress_bar(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return _SimpleProgressBar(total, desc)
    return tqdm(total=total, desc=desc, file=sys.stderr)


# --- training ------------------------------------------------------------------------------


@dataclass
class RunResult:
    losses: list[float]
    num_params: int
    state_bytes: int
    wall_seconds: float


def warmup_cosine(steps: int) -> Callable[[int], float]:
    """LR multiplier: linear warmup over the first 10% of steps, cosine decay to 10% after."""
    warmup_steps = max(1, steps // 10)

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, steps - warmup_steps)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return multiplier


def train(
    name: str,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    args: argparse.Namespace,
    batches: BatchSampler,
) -> RunResult:
    # Re-seeding before construction gives both runs bit-identical initial weights.
    torch.manual_seed(args.seed)
    model = TinyCausalLM(d_model=args.d_model, layers=args.layers, heads=args.heads, seq_len=args.seq_len)
    optimizer = make_optimizer(list(model.parameters()))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps))

    losses = []
    bar = progress_bar(args.steps, name)
    start = time.perf_counter()
    for step in range(args.steps):
        inputs, targets = batches(step)
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        bar.set_postfix_str(f"loss {losses[-1]:.4f}")
        bar.update(1)
    wall_seconds = time.perf_counter() - start
    bar.close()
    num_params = sum(p.numel() for p in model.parameters())
    return RunResult(losses, num_params, optimizer_state_bytes(optimizer), wall_seconds)


# --- report --------------------------------------------------------------------------------


def logged_steps(steps: int, rows: int) -> list[int]:
    """1-based steps for the loss table: the first, the last and evenly spaced ones between."""
    interval = max(1, steps // max(1, rows - 1))
    return sorted({1, steps, *range(interval, steps, interval)})


def print_report(args: argparse.Namespace, corpus_bytes: int, paged: RunResult, reference: RunResult) -> None:
    num_params = reference.num_params
    print(
        f"tiny causal LM: {num_params:,} params, d_model={args.d_model}, layers={args.layers}, "
        f"heads={args.heads}; {corpus_bytes:,} bytes of Python stdlib source; "
        f"{args.steps} steps of batch {args.batch} x seq_len {args.seq_len}; seed {args.seed}; "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"{PAGEDOPTIM_NAME}(state_bits={args.state_bits}) vs {TORCH_NAME}: peak lr {args.lr:g} "
        f"(warmup, cosine decay), betas {BETAS}, weight decay {args.weight_decay:g}, "
        f"grad norm clipped at {args.clip_grad_norm:g}"
    )
    print()
    print(f"{'step':>6} | {'loss ' + PAGEDOPTIM_NAME:>24} | {'loss ' + TORCH_NAME:>24} | {'abs diff':>9}")
    print(f"{'-' * 6}-+-{'-' * 24}-+-{'-' * 24}-+-{'-' * 9}")
    for step in logged_steps(args.steps, args.log_rows):
        paged_loss, reference_loss = paged.losses[step - 1], reference.losses[step - 1]
        print(
            f"{step:>6} | {paged_loss:>24.6f} | {reference_loss:>24.6f} | "
            f"{abs(paged_loss - reference_loss):>9.2e}"
        )
    print()
    metric_width = 28
    print(f"{'':<{metric_width}} | {PAGEDOPTIM_NAME:>17} | {TORCH_NAME:>17}")
    print(f"{'-' * metric_width}-+-{'-' * 17}-+-{'-' * 17}")
    print(f"{'optimizer-state bytes':<{metric_width}} | {paged.state_bytes:>17,} | {reference.state_bytes:>17,}")
    print(
        f"{'optimizer-state bytes/param':<{metric_width}} | {paged.state_bytes / num_params:>17.2f} | "
        f"{reference.state_bytes / num_params:>17.2f}"
    )
    print(f"{'wall time (s)':<{metric_width}} | {paged.wall_seconds:>17.2f} | {reference.wall_seconds:>17.2f}")


# --- command line --------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per batch (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=128, help="bytes per sequence (default: %(default)s)")
    parser.add_argument("--d-model", type=int, default=128, help="model width (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default: %(default)s)")
    parser.add_argument("--clip-grad-norm", type=float, default=1.0, help="gradient clipping norm (default: %(default)s)")
    parser.add_argument(
        "--state-bits",
        type=int,
        default=None,
        help="pagedoptim.AdamW state_bits, e.g. 32 (exact) or 8 (default: the library's default)",
    )
    parser.add_argument(
        "--corpus-bytes",
        type=int,
        default=2 << 20,
        help="bytes of standard-library source to train on (default: %(default)s)",
    )
    parser.add_argument("--log-rows", type=int, default=11, help="rows in the loss table (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and batches (default: %(default)s)")


def _validate(args: argparse.Namespace) -> None:
    positive = ("steps", "batch", "seq_len", "d_model", "layers", "heads", "corpus_bytes", "log_rows")
    for name in positive:
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.d_model % args.heads:
        raise SystemExit(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")


def run(args: argparse.Namespace) -> int:
    _validate(args)
    hyperparameters = dict(lr=args.lr, betas=BETAS, eps=1e-8, weight_decay=args.weight_decay)
    if args.state_bits is None:
        # Resolved here rather than left to the constructor so the report names what ran.
        args.state_bits = inspect.signature(pagedoptim.AdamW).parameters["state_bits"].default

    corpus = load_stdlib_bytes(args.corpus_bytes)
    batches = BatchSampler(corpus, steps=args.steps, batch=args.batch, seq_len=args.seq_len, seed=args.seed + 1)

    paged = train(PAGEDOPTIM_NAME, lambda p: pagedoptim.AdamW(p, **hyperparameters, state_bits=args.state_bits), args, batches)
    reference = train(TORCH_NAME, lambda p: torch.optim.AdamW(p, **hyperparameters), args, batches)

    print_report(args, corpus.numel(), paged, reference)
    return 0
