"""What gradient release costs and saves: a Llama-shaped model's training step (micro-batches,
backward, clip_grad_norm_, step) with release_grads=True against the same loop without it,
measured in the same run, taking turns (benchmarks/utils.time_interleaved).

For each offload setting and accumulation, one JSON line:

    python benchmarks/release.py [--device cuda] [--hidden 256 --layers 4 ...]
    {"offload": "nvme", "accumulation": 4, "step_seconds": ..., "baseline_step_seconds": ...,
     "ratio": ..., "grad_bytes": ..., "grad_stream_bytes_written_per_step": ...,
     "grad_stream_bytes_read_per_step": ..., "grad_peak_bytes": ..., "baseline_grad_peak_bytes": ...}

- step_seconds / baseline_step_seconds: median seconds of one optimizer step's whole loop
  (k forward+backward, clip, step, zero_grad), with and without release, same model, same
  state settings (8-bit AdamW, the given offload).
- grad_stream_bytes_*_per_step: what the gradient streams' pages moved per step between the
  cache and its tier (paging_stats()['grad_streams']): the price of release on a paged
  store. Without offload the pages stay in memory and move nothing.
- grad_peak_bytes: the largest gradient bytes in p.grad at any point of backward, with
  release (the gradient being released) and without (every gradient, at the end).
  On a GPU (--device cuda) the peak of torch.cuda.max_memory_allocated() over the loop is
  printed too, as peak_device_bytes / baseline_peak_device_bytes.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch

import pagedoptim as po
from utils import emit, significant, synchronize, time_interleaved

MAX_NORM = 1.0


def build(hidden: int, layers: int, device: str) -> torch.nn.Module:
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 8 * 8,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64), max_position_embeddings=1024)
    return transformers.LlamaForCausalLM(config).to(device)


class Loop:
    """One training step of k micro-batches, and what it saw of the gradients."""

    def __init__(self, release: bool, offload: str | None, accumulation: int,
                 args: argparse.Namespace, nvme_dir: str) -> None:
        self.model = build(args.hidden, args.layers, args.device)
        self.params = list(self.model.parameters())
        self.grad_peak = 0
        for p in self.params:  # before the optimizer's release hooks: they run after these
            p.register_post_accumulate_grad_hook(self._sample)
        kwargs = dict(state_bits=8, release_grads=release)
        if offload is not None:
            kwargs.update(offload=offload, cache_bytes=args.cache_bytes)
            if offload == "nvme":
                kwargs["nvme_dir"] = nvme_dir
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # offload="host" for CPU params saves nothing
            self.opt = po.AdamW(self.params, lr=1e-4, **kwargs)
        self.accumulation = accumulation
        generator = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, 256, (args.batch, args.seq),
                                    generator=generator).to(args.device)

    def _sample(self, _: torch.Tensor) -> None:
        live = sum(p.grad.numel() * p.grad.element_size() for p in self.params
                   if p.grad is not None)
        self.grad_peak = max(self.grad_peak, live)

    def __call__(self) -> None:
        for _ in range(self.accumulation):
            loss = self.model(input_ids=self.tokens, labels=self.tokens).loss
            (loss / self.accumulation).backward()
        torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM)
        self.opt.step()
        self.opt.zero_grad()

    def grad_stream_bytes(self) -> tuple[int, int]:
        stats = self.opt.paging_stats().get("grad_streams") or {}
        return (sum((stats.get("bytes_written") or {}).values()),
                sum((stats.get("bytes_read") or {}).values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--cache-bytes", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--offload", nargs="*", default=["none", "host", "nvme"])
    parser.add_argument("--accumulation", type=int, nargs="*", default=[1, 4])
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as nvme_dir:
        for name in args.offload:
            offload = None if name == "none" else name
            for accumulation in args.accumulation:
                loops = {release: Loop(release, offload, accumulation, args, nvme_dir)
                         for release in (False, True)}
                timings = time_interleaved({str(k): v for k, v in loops.items()}, warmup=1,
                                           repeats=args.repeats, device=args.device)
                released, baseline = loops[True], loops[False]
                steps = 1 + args.repeats
                written, read = released.grad_stream_bytes()
                record = {
                    "device": args.device, "offload": name, "accumulation": accumulation,
                    "params": sum(p.numel() for p in released.params),
                    "step_seconds": significant(timings["True"].median),
                    "baseline_step_seconds": significant(timings["False"].median),
                    "ratio": significant(timings["True"].median / timings["False"].median),
                    "grad_bytes": sum(p.numel() * p.element_size() for p in released.params),
                    "grad_stream_bytes_written_per_step": written // steps,
                    "grad_stream_bytes_read_per_step": read // steps,
                    "grad_stream_pages_bytes": released.opt.memory_report()["grad_stream_bytes"],
                    "grad_peak_bytes": released.grad_peak,
                    "baseline_grad_peak_bytes": baseline.grad_peak,
                }
                if cuda:
                    for release, loop in loops.items():
                        torch.cuda.reset_peak_memory_stats()
                        loop()
                        synchronize(args.device)
                        key = "peak_device_bytes" if release else "baseline_peak_device_bytes"
                        record[key] = torch.cuda.max_memory_allocated()
                emit(record)
                for loop in loops.values():
                    loop.opt.close()


if __name__ == "__main__":
    main()
