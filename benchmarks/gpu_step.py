"""Optimizer-step throughput and training memory of pagedoptim on a CUDA device, against
torch.optim.AdamW(fused=True), with the device's copy bandwidth measured in the same run.

Workloads (one JSON line per result; every baseline is timed in the same rounds):

  copy    b.copy_(a) over two 1 GiB buffers: the bandwidth ceiling, bytes read + written.
  large   one tensor of --params elements (default 256M):
            torch_fused_fp32       torch.optim.AdamW(fused=True) on fp32 params: 28 B/param
            torch_fused_bf16       the same on bf16 params (bf16 state):         14 B/param
            pagedoptim_8bit_bf16   po.AdamW's default: bf16 params, 8-bit m and v,
                                   int8 master residual:                       12.25 B/param
            pagedoptim_fp32        po.AdamW(state_bits=32, master_bits=None):    28 B/param
  lora    benchmarks/step_throughput.py's LoRA-like set (448 fp32 adapters, 66M params):
            torch_fused_fp32 against pagedoptim_8bit (fp32 params, 8-bit m and v): 16.25 B/param
  memory  peak torch.cuda.max_memory_allocated() over a few training steps of a Llama-like
          model (transformers, random weights; a stack of Linear layers without transformers),
          torch.optim.AdamW(fused=True) against po.AdamW's default, fp32 and bf16 models.

Bytes per param are the fewest a step must move (bytes_per_param() below): read param, grad and
state, write param and state. 8-bit state is one code byte per element and one fp16 scale per
32 elements for each of m and v (2.125 B), read and written; the residual is read and written.
So bf16 + int8 residual: read 2 + 2 + 2.125 + 1 = 7.125, write 2 + 2.125 + 1 = 5.125, 12.25 B.

Timing: CUDA events; warmup calls first; then rounds in which every candidate of the workload,
and the copy probe, takes a turn in rotating order. Per call three figures: `median_s` (events
around one call made on an idle stream: host launch overhead plus device time, the primary
figure), `host_median_s` (time for the call to return) and `pipelined_s` (events around
--block back-to-back calls, divided by --block: throughput when the host runs ahead).
params/s comes from median_s; achieved_gbps = params/s x bytes/param; copy_fraction compares it
with the copy probe's median in the same rounds.

Targets, printed with the measured values in a final "gpu_targets" line; the script
exits 0 whether or not they are met (1 only when a workload failed to run):
  pagedoptim_8bit_bf16 reaches >= 0.70 of the copy bandwidth and >= 2x torch_fused_fp32 params/s;
  the LoRA-like set runs >= 1.5x torch_fused_fp32; po.AdamW's peak memory is below torch's for
  the same model.

    python benchmarks/gpu_step.py               # full run, well under a minute on an H200
    python benchmarks/gpu_step.py --quick       # smoke run: 16M params, 16 adapters, tiny model
    python benchmarks/gpu_step.py --plan        # the workloads and byte counts; needs no GPU
    python benchmarks/gpu_step.py --quick --device cpu --params 1M   # the harness on the CPU

Without a CUDA device (and without --device cpu) it prints {"skipped": "no CUDA device"} and
exits 0. --device cpu runs every workload's code on the CPU (host clock instead of CUDA events;
the memory workload, which needs CUDA's allocator statistics, is reported not measured), so
that the first GPU run does not fail on a typo (tests/python/test_demo_and_bench.py); its
numbers say nothing about a GPU, and each line carries "device": "cpu".
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import pagedoptim
from step_throughput import LORA_GROUPS, LORA_SHAPES
from utils import emit, significant

GROUP = 32
SIZES = {"1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20, "256M": 256 << 20, "1G": 1 << 30}
HYPERPARAMETERS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
PROBE = "copy_probe"
TARGETS = {"copy_fraction": 0.70, "ratio_vs_torch_fused": 2.0, "lora_ratio_vs_torch_fused": 1.5}


# Bytes per element of one moment (m or v) by storage: fp32, bf16 (torch's state for bf16
# params), and companded 8-bit (one code byte plus a 32nd of an fp16 scale).
MOMENT_BYTES = {"fp32": 4.0, "bf16": 2.0, "8bit": 1.0 + 2.0 / GROUP}


def bytes_per_param(param_bytes: int, moment: str, residual_bytes: int = 0) -> float:
    """Fewest bytes an AdamW step moves per param: the param read and written, the grad read
    (same dtype as the param), m, v and the master residual read and written."""
    state = 2 * MOMENT_BYTES[moment] + residual_bytes
    return 2 * param_bytes + param_bytes + 2 * state


@dataclass(frozen=True)
class Candidate:
    """One optimizer configuration of a workload."""

    name: str
    param_dtype: torch.dtype
    bytes_per_param: float
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def scalar_bodies(optimizer: Any) -> Any:
    """`optimizer` with its CUDA steps forced onto the one-element-per-lane kernel bodies."""
    optimizer.state_store.ensure_engine().set_vector_loads(False)
    return optimizer


def large_candidates(include_exact: bool) -> list[Candidate]:
    candidates = [
        Candidate("torch_fused_fp32", torch.float32, bytes_per_param(4, "fp32"),
                  lambda ps: torch.optim.AdamW(ps, **HYPERPARAMETERS, fused=True)),
        Candidate("torch_fused_bf16", torch.bfloat16, bytes_per_param(2, "bf16"),
                  lambda ps: torch.optim.AdamW(ps, **HYPERPARAMETERS, fused=True)),
        Candidate("pagedoptim_8bit_bf16", torch.bfloat16,
                  bytes_per_param(2, "8bit", residual_bytes=1),
                  lambda ps: pagedoptim.AdamW(ps, **HYPERPARAMETERS)),
    ]
    # The same state through the one-element-per-lane bodies: what the vector bodies gain.
    candidates.append(Candidate(
        "pagedoptim_8bit_bf16_scalar", torch.bfloat16,
        bytes_per_param(2, "8bit", residual_bytes=1),
        lambda ps: scalar_bodies(pagedoptim.AdamW(ps, **HYPERPARAMETERS))))
    if include_exact:
        candidates.append(Candidate(
            "pagedoptim_fp32", torch.float32, bytes_per_param(4, "fp32"),
            lambda ps: pagedoptim.AdamW(ps, **HYPERPARAMETERS, state_bits=32,
                                           master_bits=None)))
    return candidates


def lora_candidates() -> list[Candidate]:
    return [
        Candidate("torch_fused_fp32", torch.float32, bytes_per_param(4, "fp32"),
                  lambda ps: torch.optim.AdamW(ps, **HYPERPARAMETERS, fused=True)),
        Candidate("pagedoptim_8bit", torch.float32, bytes_per_param(4, "8bit"),
                  lambda ps: pagedoptim.AdamW(ps, **HYPERPARAMETERS)),
    ]


def lora_shapes(groups: int) -> list[tuple[int, int]]:
    return [shape for _ in range(groups) for shape in LORA_SHAPES]


# -- timing ----------------------------------------------------------------------------------


class HostEvent:
    """torch.cuda.Event's timing calls on the host clock, for the CPU harness run, where a call
    has done its work when it returns."""

    def __init__(self) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "HostEvent") -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA events give them


def _event(device: torch.device) -> Any:
    return torch.cuda.Event(enable_timing=True) if device.type == "cuda" else HostEvent()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class CudaTiming:
    latency_s: tuple[float, ...]    # one call on an idle stream, events around it
    host_s: tuple[float, ...]       # until the call returned
    pipelined_s: tuple[float, ...]  # per call, from blocks of back-to-back calls

    @property
    def median(self) -> float:
        return statistics.median(self.latency_s)


def time_cuda_interleaved(candidates: Mapping[str, Callable[[], Any]], *, warmup: int,
                          repeats: int, block: int,
                          device: torch.device = torch.device("cuda")) -> dict[str, CudaTiming]:
    """Times each callable `repeats` times, candidates taking turns in rotating order (so that
    clock and thermal drift reach all of them alike), after `warmup` untimed calls each."""
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    _synchronize(device)
    latency: dict[str, list[float]] = {name: [] for name in names}
    host: dict[str, list[float]] = {name: [] for name in names}
    pipelined: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            call = candidates[name]
            start, end = _event(device), _event(device)
            _synchronize(device)
            begin = time.perf_counter()
            start.record()
            call()
            end.record()
            host[name].append(time.perf_counter() - begin)
            end.synchronize()
            latency[name].append(start.elapsed_time(end) / 1e3)
            start.record()
            for _ in range(block):
                call()
            end.record()
            end.synchronize()
            pipelined[name].append(start.elapsed_time(end) / 1e3 / block)
    return {name: CudaTiming(tuple(latency[name]), tuple(host[name]), tuple(pipelined[name]))
            for name in names}


class CopyProbe:
    """b.copy_(a) over two fp32 buffers of `buffer_bytes` each (random values): the device's
    streaming bandwidth, counting the bytes read and the bytes written."""

    def __init__(self, device: torch.device, buffer_bytes: int):
        elements = buffer_bytes // 4
        gen = torch.Generator(device=device).manual_seed(0)
        self.source = torch.randn(elements, device=device, generator=gen)
        self.destination = torch.empty_like(self.source)
        self.bytes_moved = 2 * elements * 4

    def __call__(self) -> None:
        self.destination.copy_(self.source)

    def gbps(self, seconds: float) -> float:
        return self.bytes_moved / seconds / 1e9


# -- workloads -------------------------------------------------------------------------------


def make_params(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                seed: int) -> list[torch.nn.Parameter]:
    """Random params with random grads, made on the device (never zeros: they run faster)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, device=device, generator=gen).to(dtype))
        param.grad = (torch.randn(shape, device=device, generator=gen) * 1e-2).to(dtype)
        params.append(param)
    return params


def run_workload(label: str, shapes: Sequence[tuple[int, ...]], candidates: list[Candidate],
                 probe: CopyProbe, device: torch.device, args: argparse.Namespace
                 ) -> dict[str, dict[str, Any]]:
    optimizers = {c.name: c.make(make_params(shapes, c.param_dtype, device, seed=1))
                  for c in candidates}
    calls: dict[str, Callable[[], Any]] = {name: opt.step for name, opt in optimizers.items()}
    calls[PROBE] = probe
    timings = time_cuda_interleaved(calls, warmup=args.warmup, repeats=args.repeats,
                                    block=args.block, device=device)
    del optimizers, calls
    gc.collect()
    _empty_cache(device)
    probe_timing = timings.pop(PROBE)
    copy_gbps = probe.gbps(probe_timing.median)
    num_params = sum(torch.Size(shape).numel() for shape in shapes)
    baseline = timings["torch_fused_fp32"]
    results = {}
    for candidate in candidates:
        timing = timings[candidate.name]
        params_per_s = num_params / timing.median
        achieved_gbps = params_per_s * candidate.bytes_per_param / 1e9
        record = {
            "benchmark": "gpu_step_throughput",
            "device": device.type,
            "workload": label,
            "optimizer": candidate.name,
            "params": num_params,
            "tensors": len(shapes),
            "param_dtype": str(candidate.param_dtype).removeprefix("torch."),
            "bytes_per_param": candidate.bytes_per_param,
            "repeats": args.repeats,
            "median_s": significant(timing.median),
            "min_s": significant(min(timing.latency_s)),
            "host_median_s": significant(statistics.median(timing.host_s)),
            "pipelined_s": significant(statistics.median(timing.pipelined_s)),
            "params_per_s": significant(params_per_s),
            "ratio_vs_torch_fused": significant(baseline.median / timing.median),
            "pipelined_ratio_vs_torch_fused": significant(
                statistics.median(baseline.pipelined_s) / statistics.median(timing.pipelined_s)),
            "achieved_gbps": significant(achieved_gbps),
            "copy_gbps": significant(copy_gbps),
            "copy_fraction": significant(achieved_gbps / copy_gbps),
        }
        emit(record)
        results[candidate.name] = record
    return results


def llama_like(quick: bool):
    """A Llama-like model with random weights and a byte vocabulary, or (without transformers)
    a stack of Linear layers of about the same size. Returns (label, model, batch maker)."""
    try:
        import transformers
    except ImportError:
        transformers = None
    if transformers is not None:
        hidden, layers, mlp, heads = (256, 2, 704, 4) if quick else (1024, 8, 2816, 16)
        config = transformers.LlamaConfig(
            vocab_size=256, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512,
            tie_word_embeddings=False)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)

        def loss_of(model, gen, device):
            x = torch.randint(256, (4, 256), generator=gen).to(device)
            return model(input_ids=x, labels=x).loss

        return f"llama-h{hidden}-l{layers}", model, loss_of
    width, depth = (512, 4) if quick else (2048, 24)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width),
                                                      torch.nn.GELU()) for _ in range(depth)])

    def loss_of(model, gen, device):
        x = torch.randn(64, width, generator=gen).to(device)
        return model(x.to(next(model.parameters()).dtype)).float().pow(2).mean()

    return f"mlp-w{width}-d{depth}", model, loss_of


def measure_memory(device: torch.device, args: argparse.Namespace
                   ) -> dict[str, dict[str, Any]] | None:
    if device.type != "cuda":
        emit({"benchmark": "gpu_memory", "device": device.type,
              "not_measured": "needs torch.cuda's allocator statistics"})
        return None
    label, template, loss_of = llama_like(args.quick)
    num_params = sum(p.numel() for p in template.parameters())
    runs = [
        ("torch_fused_fp32", torch.float32,
         lambda ps: torch.optim.AdamW(ps, **HYPERPARAMETERS, fused=True)),
        ("pagedoptim_fp32", torch.float32, lambda ps: pagedoptim.AdamW(ps, **HYPERPARAMETERS)),
        ("torch_fused_bf16", torch.bfloat16,
         lambda ps: torch.optim.AdamW(ps, **HYPERPARAMETERS, fused=True)),
        ("pagedoptim_bf16", torch.bfloat16, lambda ps: pagedoptim.AdamW(ps, **HYPERPARAMETERS)),
    ]
    peaks: dict[str, int] = {}
    # Reserved beside allocated: the device cache's slots come from torch's caching allocator
    # a page at a time, so fragmentation there shows as reserved bytes no tensor holds.
    reserved: dict[str, int] = {}
    for name, dtype, make in runs:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        base_reserved = torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        model = copy.deepcopy(template).to(device=device, dtype=dtype)
        opt = make(list(model.parameters()))
        gen = torch.Generator().manual_seed(1)
        for _ in range(args.memory_steps):
            loss_of(model, gen, device).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated(device) - base
        reserved[name] = torch.cuda.max_memory_reserved(device) - base_reserved
        del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    results = {}
    for name, dtype, _ in runs:
        baseline = "torch_fused_fp32" if dtype == torch.float32 else "torch_fused_bf16"
        record = {
            "benchmark": "gpu_memory",
            "model": label,
            "params": num_params,
            "param_dtype": str(dtype).removeprefix("torch."),
            "optimizer": name,
            "steps": args.memory_steps,
            "max_memory_allocated": peaks[name],
            "max_memory_reserved": reserved[name],
            "bytes_per_param": significant(peaks[name] / num_params),
            "ratio_vs_torch_same_dtype": significant(peaks[name] / peaks[baseline]),
            "ratio_vs_torch_fused_fp32": significant(peaks[name] / peaks["torch_fused_fp32"]),
        }
        emit(record)
        results[name] = record
    return results


# -- the run ---------------------------------------------------------------------------------


def targets(large: dict | None, lora: dict | None, memory: dict | None) -> dict[str, Any]:
    rows = []

    def row(name, value, target, met):
        rows.append({"name": name, "value": value, "target": target, "met": bool(met)})

    if large is not None:
        ours = large["pagedoptim_8bit_bf16"]
        row("8bit_bf16_copy_fraction", ours["copy_fraction"], f">= {TARGETS['copy_fraction']}",
            ours["copy_fraction"] >= TARGETS["copy_fraction"])
        row("8bit_bf16_vs_torch_fused_fp32", ours["ratio_vs_torch_fused"],
            f">= {TARGETS['ratio_vs_torch_fused']}",
            ours["ratio_vs_torch_fused"] >= TARGETS["ratio_vs_torch_fused"])
    if lora is not None:
        ours = lora["pagedoptim_8bit"]
        row("lora_vs_torch_fused_fp32", ours["ratio_vs_torch_fused"],
            f">= {TARGETS['lora_ratio_vs_torch_fused']}",
            ours["ratio_vs_torch_fused"] >= TARGETS["lora_ratio_vs_torch_fused"])
    if memory is not None:
        for name in ("pagedoptim_fp32", "pagedoptim_bf16"):
            ratio = memory[name]["ratio_vs_torch_same_dtype"]
            row(f"memory_{name}_vs_torch_same_dtype", ratio, "< 1", ratio < 1)
    return {"benchmark": "gpu_targets", "targets": rows,
            "target_met": bool(rows) and all(r["met"] for r in rows)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", choices=list(SIZES), default="256M",
                        help="elements of the large workload's one tensor")
    parser.add_argument("--lora-groups", type=int, default=LORA_GROUPS,
                        help=f"groups of {len(LORA_SHAPES)} adapter tensors (default "
                             f"{LORA_GROUPS}: {LORA_GROUPS * len(LORA_SHAPES)} tensors)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per candidate")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds")
    parser.add_argument("--block", type=int, default=5,
                        help="back-to-back calls per round for the pipelined figure")
    parser.add_argument("--copy-mib", type=int, default=1024, help="copy probe buffer size")
    parser.add_argument("--memory-steps", type=int, default=3, help="training steps per run")
    parser.add_argument("--only", default="large,lora,memory",
                        help="comma-separated workloads to run (large, lora, memory)")
    parser.add_argument("--no-exact", action="store_true",
                        help="leave out pagedoptim_fp32 (exact mode) from the large workload")
    parser.add_argument("--device", default="cuda",
                        help="the CUDA device (default: current); cpu: the harness on the CPU")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 16M params, 16 adapters, a tiny model, 1 warmup, "
                             "5 repeats, 256 MiB copy buffers")
    parser.add_argument("--plan", action="store_true",
                        help="print the workloads and their byte counts; touch no device")
    args = parser.parse_args(argv)
    if args.quick:  # smaller defaults; options given explicitly still win
        quick = dict(params="16M", lora_groups=4, warmup=1, repeats=5, copy_mib=256)
        for name, value in quick.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    args.only = {w.strip() for w in args.only.split(",") if w.strip()}
    unknown = args.only - {"large", "lora", "memory"}
    if unknown:
        parser.error(f"unknown workloads in --only: {sorted(unknown)}")
    for name in ("warmup", "repeats", "block", "memory_steps", "lora_groups", "copy_mib"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')} is too small: {getattr(args, name)}")
    return args


def plan(args: argparse.Namespace) -> None:
    large = [(SIZES[args.params],)]
    lora = lora_shapes(args.lora_groups)
    for label, shapes, candidates in (("large", large, large_candidates(not args.no_exact)),
                                      ("lora", lora, lora_candidates())):
        if label not in args.only:
            continue
        numel = sum(torch.Size(s).numel() for s in shapes)
        for c in candidates:
            emit({"plan": "gpu_step_throughput", "workload": label, "optimizer": c.name,
                  "params": numel, "tensors": len(shapes),
                  "param_dtype": str(c.param_dtype).removeprefix("torch."),
                  "bytes_per_param": c.bytes_per_param,
                  "bytes_per_step": int(numel * c.bytes_per_param)})
    emit({"plan": "copy_probe", "buffer_bytes": args.copy_mib << 20,
          "bytes_per_call": 2 * (args.copy_mib << 20)})
    if "memory" in args.only:
        emit({"plan": "gpu_memory", "steps": args.memory_steps,
              "runs": ["torch_fused_fp32", "pagedoptim_fp32", "torch_fused_bf16",
                       "pagedoptim_bf16"]})
    emit({"plan": "targets", **TARGETS})


def why_not_runnable(device: torch.device) -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        from pagedoptim._native import native

        if not native.cuda_built():
            return "pagedoptim was built without its CUDA kernels"
    except (AttributeError, RuntimeError) as error:
        return f"pagedoptim's native extension could not be used: {error}"
    if device.type != "cuda":
        return f"--device {device} is not a CUDA device"
    return None


def describe_device(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"benchmark": "gpu_device", "name": "cpu (the harness run: no GPU number)",
                "torch": torch.__version__}
    from pagedoptim._native import native

    props = torch.cuda.get_device_properties(device)
    return {"benchmark": "gpu_device", "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count, "memory_bytes": props.total_memory,
            "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "pagedoptim_cuda_version": native.cuda_version()}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plan:
        plan(args)
        return 0
    device = torch.device(args.device)
    reason = None if device.type == "cpu" else why_not_runnable(device)
    if reason is not None:
        emit({"skipped": reason})
        return 0
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    emit(describe_device(device))

    probe = CopyProbe(device, args.copy_mib << 20)
    alone = time_cuda_interleaved({PROBE: probe}, warmup=2, repeats=max(args.repeats, 10),
                                  block=args.block, device=device)[PROBE]
    emit({"benchmark": "gpu_copy_bandwidth", "device": device.type,
          "buffer_bytes": args.copy_mib << 20,
          "best_gbps": significant(probe.gbps(min(alone.latency_s))),
          "median_gbps": significant(probe.gbps(alone.median)),
          "pipelined_gbps": significant(probe.gbps(statistics.median(alone.pipelined_s)))})

    failed = False
    results: dict[str, Any] = {"large": None, "lora": None, "memory": None}
    sections = (
        ("large", lambda: run_workload(args.params, [(SIZES[args.params],)],
                                       large_candidates(not args.no_exact), probe, device, args)),
        ("lora", lambda: run_workload(f"lora{args.lora_groups * len(LORA_SHAPES)}",
                                      lora_shapes(args.lora_groups), lora_candidates(), probe,
                                      device, args)),
        ("memory", lambda: measure_memory(device, args)),
    )
    for name, section in sections:
        if name not in args.only:
            continue
        try:
            results[name] = section()
        except Exception as error:  # report and go on: the other workloads still mean something
            failed = True
            emit({"benchmark": f"gpu_{name}", "error": f"{type(error).__name__}: {error}"})
            traceback.print_exc(file=sys.stderr)
        gc.collect()
        _empty_cache(device)
    emit({**targets(results["large"], results["lora"], results["memory"]), "device": device.type})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
