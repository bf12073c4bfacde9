"""`python -m pagedoptim demo`: pagedoptim.AdamW next to torch.optim.AdamW on a real training run.

Trains a tiny byte-level causal language model three times from the same initial weights on
the same batches: with torch.optim.AdamW (fp32 state), with pagedoptim.AdamW (8-bit state by
default) and with pagedoptim.AdamW paging that state to a file (offload="nvme") through a
cache too small to hold it. It prints the loss curves, a held-out loss, the optimizer-state
bytes by kind and the times side by side, checks that paging changed no loss in any bit, and
draws the curves and the bytes into a PNG. The text is the Python standard library's own
source code, so the demo needs no download and reads the same bytes on every machine with
the same Python version: its last 10% is held out, never trained on.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from pagedoptim.optim import AdamW
from pagedoptim.cli.demo_plot import save_demo_figure
from pagedoptim.paging.setting_text import byte_size_argument
from pagedoptim.paging.options import PAGE_ALIGNMENT
from pagedoptim.cli.progress import progress_bar

VOCAB_SIZE = 256  # bytes
TORCH_NAME = "torch.optim.AdamW"
BETAS = (0.9, 0.95)  # the usual choice for LM pretraining
HELD_OUT_FRACTION = 0.1  # of the corpus, at its end: other modules than the ones trained on


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

# Optimizer-state kinds shared by both libraries, in the order the tables and bars show them.
MOMENTS, SCALES, RESIDUALS, STEPS, SLACK = (
    "moments", "group scales", "master residuals", "step counters", "page slack")
STATE_KINDS = (MOMENTS, SCALES, RESIDUALS, STEPS, SLACK)
# memory_report() key -> kind
_REPORT_KINDS = {"moment_bytes": MOMENTS, "scale_bytes": SCALES, "residual_bytes": RESIDUALS,
                 "step_bytes": STEPS, "page_slack_bytes": SLACK}
# torch.optim.AdamW state key -> kind
_TORCH_KINDS = {"exp_avg": MOMENTS, "exp_avg_sq": MOMENTS, "max_exp_avg_sq": MOMENTS, "step": STEPS}


def state_bytes_by_kind(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of optimizer state by kind, from the optimizer's own accounting when it has one.

    torch's optimizers have none, so their state tensors are summed by state key; for
    pagedoptim the report is authoritative (it knows the compressed streams and the page space
    no stream uses).
    """
    by_kind = dict.fromkeys(STATE_KINDS, 0)
    memory_report = getattr(optimizer, "memory_report", None)
    if memory_report is not None:
        report = memory_report()
        for key, kind in _REPORT_KINDS.items():
            by_kind[kind] += int(report[key])
        return by_kind
    for param_state in optimizer.state.values():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                kind = _TORCH_KINDS.get(key, key)  # a key we do not know is a kind of its own
                by_kind[kind] = by_kind.get(kind, 0) + value.numel() * value.element_size()
    return by_kind


def held_out_windows(corpus: torch.Tensor, *, seq_len: int, windows: int) -> torch.Tensor:
    """Up to `windows` consecutive, non-overlapping windows of seq_len+1 bytes from the start
    of the held-out slice: the same bytes for every run, none of them trained on."""
    count = min(windows, (corpus.numel() - 1) // seq_len)
    if count < 1:
        raise ValueError(f"the held-out slice ({corpus.numel()} bytes) needs more than "
                         f"seq_len+1={seq_len + 1} bytes; raise --corpus-bytes")
    starts = torch.arange(count) * seq_len
    return corpus[starts.unsqueeze(1) + torch.arange(seq_len + 1)]  # [count, seq_len+1]


@torch.no_grad()
def mean_loss(model: nn.Module, windows: torch.Tensor, batch: int) -> float:
    """Mean next-byte cross-entropy over the windows, in batches of `batch`."""
    total, count = 0.0, 0
    for chunk in windows.split(batch):
        logits = model(chunk[:, :-1])
        total += F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), chunk[:, 1:].reshape(-1),
                                 reduction="sum").item()
        count += chunk[:, 1:].numel()
    return total / count


# --- training ------------------------------------------------------------------------------


@dataclass
class RunResult:
    losses: list[float]
    held_out_loss: float
    num_params: int
    state_by_kind: dict[str, int]
    wall_seconds: float  # the whole training loop: forward, backward and optimizer steps
    step_seconds: float  # the median optimizer.step(), the first (which allocates state) left out
    paging_stats: Optional[dict] = None  # for a paged pagedoptim run

    @property
    def state_bytes(self) -> int:
        return sum(self.state_by_kind.values())


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
    held_out: torch.Tensor,
) -> RunResult:
    # Re-seeding before construction gives every run bit-identical initial weights.
    torch.manual_seed(args.seed)
    model = TinyCausalLM(d_model=args.d_model, layers=args.layers, heads=args.heads, seq_len=args.seq_len)
    optimizer = make_optimizer(list(model.parameters()))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps))

    losses, step_seconds = [], []
    bar = progress_bar(args.steps, name)
    start = time.perf_counter()
    for step in range(args.steps):
        inputs, targets = batches(step)
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        step_start = time.perf_counter()
        optimizer.step()
        step_seconds.append(time.perf_counter() - step_start)
        scheduler.step()
        losses.append(loss.item())
        bar.set_postfix_str(f"loss {losses[-1]:.4f}")
        bar.update(1)
    wall_seconds = time.perf_counter() - start
    bar.close()
    # torch's optimizers have no paging_stats; an unpaged pagedoptim state says offload None.
    paging_stats = getattr(optimizer, "paging_stats", lambda: {"offload": None})()
    return RunResult(
        losses=losses,
        held_out_loss=mean_loss(model, held_out, args.batch),
        num_params=sum(p.numel() for p in model.parameters()),
        state_by_kind=state_bytes_by_kind(optimizer),
        wall_seconds=wall_seconds,
        step_seconds=statistics.median(step_seconds[1:] or step_seconds),
        paging_stats=paging_stats if paging_stats["offload"] else None,
    )


def default_cache_bytes(unpaged: RunResult) -> int:
    """A quarter of the unpaged state's pages, in whole 4 KiB pages: small enough that pages
    leave and come back every step."""
    page_space = unpaged.state_bytes - unpaged.state_by_kind[STEPS]
    return max(PAGE_ALIGNMENT, page_space // 4 // PAGE_ALIGNMENT * PAGE_ALIGNMENT)


# --- report --------------------------------------------------------------------------------


def logged_steps(steps: int, rows: int) -> list[int]:
    """1-based steps for the loss table: the first, the last and evenly spaced ones between."""
    interval = max(1, steps // max(1, rows - 1))
    return sorted({1, steps, *range(interval, steps, interval)})


def final_train_loss(losses: list[float]) -> float:
    """The mean loss of the last 10% of steps: one batch's loss is too noisy to compare."""
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """Columns right-aligned except the first, separated by ' | ', a rule under the header."""
    widths = [max(len(row[col]) for row in [header, *rows]) for col in range(len(header))]

    def line(cells: list[str]) -> str:
        first, *rest = cells
        return " | ".join([f"{first:<{widths[0]}}", *(f"{c:>{w}}" for c, w in zip(rest, widths[1:]))])

    print(line(header))
    print("-+-".join("-" * width for width in widths))
    for row in rows:
        print(line(row))


def mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


def paging_difference(paged: RunResult, unpaged: RunResult) -> Optional[str]:
    """Where the paged run's losses first differ from the unpaged run's in any bit, or None."""
    differs_at = next((step for step, (a, b) in enumerate(zip(paged.losses, unpaged.losses), start=1)
                       if a != b), None)
    if differs_at is not None:
        return f"step {differs_at}"
    return None if paged.held_out_loss == unpaged.held_out_loss else "the held-out loss"


def print_report(args: argparse.Namespace, corpus_bytes: int, held_out_bytes: int,
                 runs: dict[str, RunResult], paged_name: str, unpaged_name: str,
                 paged_settings: str, paging_differs_at: Optional[str]) -> None:
    num_params = next(iter(runs.values())).num_params
    print(
        f"tiny causal LM: {num_params:,} params, d_model={args.d_model}, layers={args.layers}, "
        f"heads={args.heads}; {corpus_bytes:,} bytes of Python stdlib source, the last "
        f"{held_out_bytes:,} held out; {args.steps} steps of batch {args.batch} x seq_len "
        f"{args.seq_len}; seed {args.seed}; {torch.get_num_threads()} intra-op thread(s)"
    )
    print(
        f"every run: same initial weights, same batches, peak lr {args.lr:g} (warmup, cosine "
        f"decay), betas {BETAS}, weight decay {args.weight_decay:g}, grad norm clipped at "
        f"{args.clip_grad_norm:g}"
    )
    print(f"{TORCH_NAME}: fp32 state; {unpaged_name}: state_bits={args.state_bits}, all state "
          f"in memory; {paged_name}: the same with {paged_settings}")
    print()

    names = list(runs)
    print("training loss at step (each step's own batch)")
    print_table(["step", *names], [
        [str(step), *(f"{runs[name].losses[step - 1]:.6f}" for name in names)]
        for step in logged_steps(args.steps, args.log_rows)
    ])
    print()

    if paging_differs_at is None:
        print(f"paging: {paged_name} and {unpaged_name} losses are identical at all {args.steps} "
              f"steps and held out (bit for bit: paging never changes results)")
    else:
        print(f"paging: {paged_name} and {unpaged_name} losses DIFFER, first at "
              f"{paging_differs_at}: paging must never change results, please report this")
    stats = runs[paged_name].paging_stats or {}
    print(f"paging: {stats.get('num_pages', 0)} pages of {stats.get('page_bytes', 0):,} B, "
          f"{stats.get('cache_bytes', 0):,} B of them resident; "
          f"{mib(sum(stats.get('bytes_read', {}).values()))} read from and "
          f"{mib(sum(stats.get('bytes_written', {}).values()))} written to the page file "
          f"({stats.get('io_backend', '?')}), cache hit rate {stats.get('hit_rate', 0.0):.0%}, "
          f"{stats.get('stall_seconds', 0.0):.2f} s waiting for I/O")
    print()

    print("optimizer-state bytes by kind")
    kinds = [kind for kind in dict.fromkeys(k for run in runs.values() for k in run.state_by_kind)]
    print_table(["kind", *names], [
        *([kind, *(f"{runs[name].state_by_kind.get(kind, 0):,}" for name in names)] for kind in kinds),
        ["total", *(f"{runs[name].state_bytes:,}" for name in names)],
    ])
    print()

    print("summary")
    print_table(
        ["optimizer", "train loss (last 10%)", "held-out loss", "state bytes", "bytes/param",
         "wall time (s)", "step time (ms)"],
        [[name, f"{final_train_loss(run.losses):.4f}", f"{run.held_out_loss:.4f}",
          f"{run.state_bytes:,}", f"{run.state_bytes / num_params:.2f}", f"{run.wall_seconds:.2f}",
          f"{1000 * run.step_seconds:.2f}"] for name, run in runs.items()],
    )
    print("(step time: the median optimizer.step(); wall time: the whole training loop)")


def save_figure(args: argparse.Namespace, runs: dict[str, RunResult], identical_runs: dict[str, str]) -> None:
    if args.no_png:
        return
    try:
        save_demo_figure(
            args.png,
            title=(f"tiny causal LM, {next(iter(runs.values())).num_params:,} params, "
                   f"{args.steps} steps of {args.batch} x {args.seq_len} bytes"),
            train_losses={name: run.losses for name, run in runs.items()},
            held_out_losses={name: run.held_out_loss for name, run in runs.items()},
            state_bytes_by_kind={name: run.state_by_kind for name, run in runs.items()},
            num_params=next(iter(runs.values())).num_params,
            identical_runs=identical_runs,
        )
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith("matplotlib"):
            raise
        print("figure: not drawn, matplotlib is not installed (pip install matplotlib)")
        return
    print(f"figure: {os.path.abspath(args.png)}")


# --- command line --------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=64, help="bytes per sequence (default: %(default)s)")
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
        help="bytes of standard-library source, the last 10%% held out (default: %(default)s)",
    )
    parser.add_argument("--held-out-windows", type=int, default=64,
                        help="held-out sequences the final loss is measured on (default: %(default)s)")
    parser.add_argument("--cache-bytes", type=byte_size_argument, default=None,
                        help="resident pages of the paged run (default: a quarter of its state)")
    parser.add_argument("--nvme-dir", default=None,
                        help="directory of the paged run's page file (default: $TMPDIR or /tmp)")
    parser.add_argument("--png", default=os.path.join(tempfile.gettempdir(), "pagedoptim_demo.png"),
                        help="where the figure goes (default: %(default)s)")
    parser.add_argument("--no-png", action="store_true", help="draw no figure")
    parser.add_argument("--log-rows", type=int, default=11, help="rows in the loss table (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and batches (default: %(default)s)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default: %(default)s: this model is too small for more to "
             "pay, and on a machine busy with other work each extra thread waits on the others, "
             "5-10x slower steps measured on 2 shared cores)",
    )


def _validate(args: argparse.Namespace) -> None:
    positive = ("steps", "batch", "seq_len", "d_model", "layers", "heads", "corpus_bytes",
                "held_out_windows", "log_rows", "threads")
    for name in positive:
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.d_model % args.heads:
        raise SystemExit(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    if args.cache_bytes is not None and args.cache_bytes < PAGE_ALIGNMENT:
        raise SystemExit(f"--cache-bytes must hold at least one {PAGE_ALIGNMENT}-byte page, "
                         f"got {args.cache_bytes}")
    if args.nvme_dir is not None and not os.path.isdir(args.nvme_dir):
        raise SystemExit(f"--nvme-dir {args.nvme_dir!r} is not a directory")


def run(args: argparse.Namespace) -> int:
    _validate(args)
    torch.set_num_threads(args.threads)
    hyperparameters = dict(lr=args.lr, betas=BETAS, eps=1e-8, weight_decay=args.weight_decay)
    if args.state_bits is None:
        # Resolved here rather than left to the constructor so the report names what ran.
        args.state_bits = inspect.signature(AdamW).parameters["state_bits"].default

    corpus = load_stdlib_bytes(args.corpus_bytes)
    held_out_start = corpus.numel() - int(corpus.numel() * HELD_OUT_FRACTION)
    try:
        held_out = held_out_windows(corpus[held_out_start:], seq_len=args.seq_len,
                                    windows=args.held_out_windows)
        batches = BatchSampler(corpus[:held_out_start], steps=args.steps, batch=args.batch,
                               seq_len=args.seq_len, seed=args.seed + 1)
    except ValueError as error:
        raise SystemExit(str(error)) from None

    unpaged_name = f"pagedoptim.AdamW {args.state_bits}-bit"
    paged_name = f"{unpaged_name} nvme"
    runs = {
        TORCH_NAME: train(TORCH_NAME, lambda p: torch.optim.AdamW(p, **hyperparameters), args,
                          batches, held_out),
        unpaged_name: train(unpaged_name, lambda p: AdamW(
            p, **hyperparameters, state_bits=args.state_bits), args, batches, held_out),
    }
    cache_bytes = args.cache_bytes if args.cache_bytes is not None else default_cache_bytes(runs[unpaged_name])
    runs[paged_name] = train(paged_name, lambda p: AdamW(
        p, **hyperparameters, state_bits=args.state_bits, offload="nvme", nvme_dir=args.nvme_dir,
        cache_bytes=cache_bytes), args, batches, held_out)

    paged_settings = (f'offload="nvme", cache_bytes={cache_bytes:,}, page file in '
                      f"{args.nvme_dir or os.environ.get('TMPDIR') or '/tmp'}")
    differs_at = paging_difference(runs[paged_name], runs[unpaged_name])
    print_report(args, corpus.numel(), corpus.numel() - held_out_start, runs, paged_name,
                 unpaged_name, paged_settings, differs_at)
    save_figure(args, runs, {} if differs_at else {paged_name: unpaged_name})
    return 0 if differs_at is None else 1  # a paged run that changed results is a bug
