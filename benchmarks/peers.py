"""Ours side by side with torch's AdamW and the peers (bitsandbytes, torchao, DeepSpeed, FlashOptim).

Three parts, every candidate of benchmarks/peer_optimizers.py in each, in one process:

throughput  For each workload -- one 64M fp32 tensor, a LoRA-like set of 448 fp32 tensors (66M
            params), one 64M bf16 tensor -- every candidate gets its own copy of the same
            params (all share one read-only grad), takes its first step (state allocated,
            torch.compile run), then timed steps in interleaved rounds: one step of each
            candidate per round, order rotating. Slow candidates stop taking turns after
            --min-repeats once --budget seconds per candidate are spent, fast ones go on to
            --repeats. Median step time -> params/s -> ratio to torch_fused of the same
            workload (> 1: faster than torch).
memory      In the same pass (process_memory.py says how): state storage bytes per param, RSS
            growth across the first step per param, and the largest transient peak of a timed
            step above the RSS before it, per param. On CUDA: torch's allocated bytes instead
            of RSS (bitsandbytes' paged state lives in unified memory outside torch's
            allocator; its storage still counts).
quality     The tiny byte-level LM of benchmarks/convergence.py (43K params, fp32) trained
            --lm-steps steps per seed on the first 90% of its corpus; final loss (mean of the
            last 20 steps) and held-out loss (fixed batches from the last 10%) as ratios to
            torch_fused on fp32 params of the same seed. ours_8bit also trains bf16 params
            (workload lm_bf16, master_bits=24), next to torch_fused on bf16 params (bf16 state,
            no master copy: what plain bf16 training costs).

pressure    CUDA only: the fp32 workload again with the GPU filled but for
            --pressure-headroom-mib, for the candidates that page or offload state (ours with
            offload="host", bitsandbytes' PagedAdamW8bit, torchao's CPUOffloadOptimizer) and
            torch_fused, which is expected to run out of memory there (its skipped line says
            so); ratios are to torch_fused on the same workload without pressure.

One JSON line per result; every line has the 1-minute load average. A candidate that is not
installed, does not run on the device, or fails on a workload gets a "peers_skipped" line with
the reason. docs/comparison.md reads the lines (benchmarks/peers_report.py renders them).

    python benchmarks/peers.py | tee peers.jsonl     # full run (throughput: 33 min on 2 loaded cores)
    python benchmarks/peers.py --quick               # smoke run (the test suite runs this)
    python benchmarks/peers.py --device cuda         # CUDA params (scripts/gpu_check.sh --peers)
    python benchmarks/peers.py --parts throughput    # one part
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

import torch
import torch.nn.functional as F

from convergence import CONTEXT, HYPER as LM_HYPER, LAST, TinyLM, corpus, smooth
from peer_optimizers import BASELINE, CANDIDATES, PAGED, Candidate, availability, package_version
from process_memory import (peak_rss_bytes, pin_malloc_to_mmap, reset_peak_rss, rss_bytes,
                            state_storage_bytes)
from utils import Timing, emit, significant, synchronize

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
LORA_SHAPES = ((16, 4096), (4096, 16), (16, 14336), (14336, 16))
PARTS = ("throughput", "quality")
LM_BATCH, HELD_OUT_BATCHES, CURVE_EVERY = 16, 16, 10


@dataclass(frozen=True)
class Workload:
    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return sum(torch.Size(shape).numel() for shape in self.shapes)


def workloads(quick: bool) -> list[Workload]:
    large, groups = (1 << 20, 4) if quick else (64 << 20, 112)
    label = "1M" if quick else "64M"
    return [Workload(f"fp32_{label}", ((large,),), torch.float32),
            Workload(f"lora{4 * groups}", tuple(LORA_SHAPES) * groups, torch.float32),
            Workload(f"bf16_{label}", ((large,),), torch.bfloat16)]


# The JSON lines go to the stdout the caller gave; main() points file descriptor 1 itself at
# stderr, because peers print to it (DeepSpeed's logger writes its warnings to stdout), and a
# line of theirs among ours would break every reader of the lines.
RESULTS: TextIO = sys.stdout


def report(record: dict) -> None:
    emit(record, RESULTS)


def keep_stdout_for_results() -> None:
    global RESULTS
    sys.stdout.flush()
    RESULTS = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())


def load_average() -> float:
    return significant(os.getloadavg()[0], 3)


def skipped(name: str, part: str, reason: str, device: str, workload: str | None = None) -> None:
    report({"benchmark": "peers_skipped", "optimizer": name, "part": part, "workload": workload,
          "device": device, "reason": reason, "load_average_1m": load_average()})


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:300]


# -- memory readings that work on both devices -------------------------------------------------

def resident_bytes(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else rss_bytes()


def reset_peak(device: torch.device) -> bool:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    return reset_peak_rss()


def peak_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()


# -- throughput and memory ---------------------------------------------------------------------

@dataclass
class Running:
    """One candidate's optimizer on its copy of a workload, and what was measured of it."""

    optimizer: torch.optim.Optimizer
    first_step_s: float
    storage_bytes: int
    growth_bytes: int
    repeats: int = 0
    seconds: list[float] = field(default_factory=list)
    transient_bytes: int | None = None


def make_workload(workload: Workload, device: torch.device, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    values = [torch.randn(shape, generator=generator).to(device, workload.dtype)
              for shape in workload.shapes]
    grads = [torch.randn(shape, generator=generator).to(device, workload.dtype)
             for shape in workload.shapes]
    return values, grads


def copy_params(values, grads) -> list[torch.nn.Parameter]:
    params = []
    for value, grad in zip(values, grads):
        param = torch.nn.Parameter(value.clone())
        param.grad = grad  # shared and never written: every optimizer here only reads grads
        params.append(param)
    return params


def start(candidate: Candidate, params: list[torch.nn.Parameter], device: torch.device) -> Running:
    gc.collect()
    before = resident_bytes(device)
    optimizer = candidate.make(params, dict(HYPER))
    began = time.perf_counter()
    optimizer.step()
    synchronize(device)
    first_step_s = time.perf_counter() - began
    return Running(optimizer, first_step_s, state_storage_bytes(optimizer),
                   resident_bytes(device) - before)


def plan_repeats(running: dict[str, Running], args) -> None:
    """Fast candidates get --repeats timed steps; one whose first step says that many would
    overrun --budget seconds gets fewer, never below --min-repeats (the first step, which
    includes state allocation and compiling, overestimates later ones: a safe guess). The
    baseline always gets --repeats: it is the denominator of every ratio, and a first step
    slowed by allocating 448 tensors' state once cut it to 2 samples."""
    for name, run in running.items():
        affordable = int(args.budget / max(run.first_step_s, 1e-9))
        run.repeats = max(args.min_repeats, min(args.repeats, affordable))
        if name == BASELINE:
            run.repeats = args.repeats


def timed_rounds(running: dict[str, Running], device: torch.device, peak_ok: bool) -> None:
    names = list(running)
    for index in range(max(run.repeats for run in running.values())):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            run = running[name]
            if len(run.seconds) >= run.repeats:
                continue
            synchronize(device)
            before = resident_bytes(device)
            reset_peak(device)
            began = time.perf_counter()
            run.optimizer.step()
            synchronize(device)
            run.seconds.append(time.perf_counter() - began)
            if peak_ok:
                transient = max(0, peak_bytes(device) - before)
                run.transient_bytes = max(run.transient_bytes or 0, transient)


def fill_device(device: torch.device, headroom_bytes: int) -> torch.Tensor:
    """Hold all of the GPU's free memory but `headroom_bytes`: the memory pressure under which
    paged and offloaded states are meant to keep a step running."""
    free, _ = torch.cuda.mem_get_info(device)
    return torch.empty(max(0, free - headroom_bytes), dtype=torch.uint8, device=device)


def throughput(workload: Workload, candidates: list[Candidate], device: torch.device, args,
               peak_ok: bool, baseline_s: float | None = None) -> float | None:
    """Times `candidates` on `workload` and prints their lines; returns the baseline's median
    step time. Under memory pressure (a workload named *_pressure) the baseline is expected to
    fail and `baseline_s`, torch_fused's time on the same workload without pressure, is used."""
    values, grads = make_workload(workload, device)
    params = {candidate.name: copy_params(values, grads) for candidate in candidates}
    del values  # every candidate has its copy; only the shared grads stay
    filler = None
    if workload.name.endswith("_pressure"):
        filler = fill_device(device, args.pressure_headroom_mib << 20)
    running: dict[str, Running] = {}
    for candidate in candidates:
        try:
            running[candidate.name] = start(candidate, params.pop(candidate.name), device)
        except Exception as error:
            skipped(candidate.name, "throughput", first_line(error), device.type, workload.name)
    if BASELINE not in running and baseline_s is None:
        for name in running:
            skipped(name, "throughput", f"the baseline {BASELINE} did not run", device.type,
                    workload.name)
        return None
    plan_repeats(running, args)
    try:
        timed_rounds(running, device, peak_ok)
    except Exception as error:  # a peer failing mid-run must not lose the others' results
        failed = [name for name, run in running.items() if len(run.seconds) < run.repeats]
        for name in failed:
            skipped(name, "throughput", f"failed during timed steps: {first_line(error)}",
                    device.type, workload.name)
            running.pop(name)
        if BASELINE not in running and baseline_s is None:
            return None
    baseline = baseline_s if BASELINE not in running else Timing(tuple(running[BASELINE].seconds)).median
    n = workload.numel
    for name, run in running.items():
        timing = Timing(tuple(run.seconds))
        report({"benchmark": "peers_throughput", "optimizer": name, "workload": workload.name,
              "device": device.type, "dtype": str(workload.dtype).removeprefix("torch."),
              "params": n, "tensors": len(workload.shapes), "repeats": len(run.seconds),
              "step_s_median": significant(timing.median), "step_s_min": significant(timing.min),
              "step_s_max": significant(max(run.seconds)),
              "first_step_s": significant(run.first_step_s),
              "params_per_s": significant(n / timing.median),
              "ratio_vs_torch_fused": significant(baseline / timing.median),
              "load_average_1m": load_average()})
        report({"benchmark": "peers_memory", "optimizer": name, "workload": workload.name,
              "device": device.type, "dtype": str(workload.dtype).removeprefix("torch."),
              "params": n,
              "state_storage_bytes_per_param": significant(run.storage_bytes / n),
              ("device_growth_bytes_per_param" if device.type == "cuda"
               else "rss_growth_bytes_per_param"): significant(run.growth_bytes / n),
              "transient_peak_bytes_per_param": (None if run.transient_bytes is None
                                                 else significant(run.transient_bytes / n)),
              "load_average_1m": load_average()})
    running.clear()
    del filler
    gc.collect()
    return baseline


# -- quality -----------------------------------------------------------------------------------

def lm_batches(data: torch.Tensor, count: int, generator: torch.Generator) -> list[torch.Tensor]:
    starts = torch.randint(0, data.numel() - CONTEXT - 1, (count,), generator=generator)
    return torch.stack([data[i:i + CONTEXT + 1] for i in starts.tolist()])


def lm_loss(model: TinyLM, window: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(window[:, :-1]).reshape(-1, 256), window[:, 1:].reshape(-1))


def train_lm(make: Callable, dtype: torch.dtype, steps: int, seed: int,
             device: torch.device) -> tuple[list[float], float]:
    data = corpus()
    split = data.numel() * 9 // 10
    train_data, held_data = data[:split], data[split:]
    model = TinyLM(torch.Generator().manual_seed(seed), dtype).to(device)
    optimizer = make(list(model.parameters()), dict(LM_HYPER))
    batches = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        loss = lm_loss(model, lm_batches(train_data, LM_BATCH, batches).to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    held = torch.Generator().manual_seed(1234)  # the same held-out batches for every run
    with torch.no_grad():
        held_losses = [lm_loss(model, lm_batches(held_data, LM_BATCH, held).to(device)).item()
                       for _ in range(HELD_OUT_BATCHES)]
    return losses, sum(held_losses) / len(held_losses)


def quality(candidates: list[Candidate], device: torch.device, args) -> None:
    runs = [(c, "lm_fp32", torch.float32) for c in candidates]
    runs += [(c, "lm_bf16", torch.bfloat16) for c in candidates
             if c.name in (BASELINE, "ours_8bit")]
    threads = torch.get_num_threads()
    torch.set_num_threads(args.lm_threads)  # tiny matmuls: one thread beats two shared cores
    ratios: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        for seed in range(args.seeds):
            results: dict[tuple[str, str], tuple[list[float], float]] = {}
            for candidate, workload, dtype in runs:
                if seed > 0 and (candidate.name, workload) not in ratios:
                    continue  # failed on seed 0: already reported
                try:
                    results[candidate.name, workload] = train_lm(candidate.make, dtype,
                                                                 args.lm_steps, seed, device)
                except Exception as error:
                    skipped(candidate.name, "quality", first_line(error), device.type, workload)
                    ratios.pop((candidate.name, workload), None)
                    continue
                ratios.setdefault((candidate.name, workload), [])
            for (name, workload), (losses, held) in results.items():
                if (BASELINE, "lm_fp32") not in results:
                    skipped(name, "quality", f"the baseline {BASELINE} did not run", device.type,
                            workload)
                    continue
                base_losses, base_held = results[BASELINE, "lm_fp32"]  # torch fp32 AdamW
                final = statistics.fmean(losses[-LAST:])
                base_final = statistics.fmean(base_losses[-LAST:])
                ratios[name, workload].append((final / base_final, held / base_held))
                record = {"benchmark": "peers_quality", "optimizer": name, "workload": workload,
                          "device": device.type, "seed": seed, "steps": args.lm_steps,
                          "final_loss": significant(final), "held_out_loss": significant(held),
                          "final_ratio_vs_torch_fused": significant(final / base_final),
                          "held_out_ratio_vs_torch_fused": significant(held / base_held),
                          "max_loss": significant(max(losses)),
                          "load_average_1m": load_average()}
                if seed == 0:  # the curve to plot: 20-step means, every 10th step
                    record["curve"] = [significant(v) for v in
                                       smooth(losses, LAST)[CURVE_EVERY - 1::CURVE_EVERY]]
                report(record)
    finally:
        torch.set_num_threads(threads)
    for (name, workload), values in ratios.items():
        if not values:
            continue
        report({"benchmark": "peers_quality_summary", "optimizer": name, "workload": workload,
              "device": device.type, "seeds": len(values), "steps": args.lm_steps,
              "final_ratio_mean": significant(statistics.fmean(v[0] for v in values)),
              "final_ratio_max": significant(max(v[0] for v in values)),
              "held_out_ratio_mean": significant(statistics.fmean(v[1] for v in values)),
              "held_out_ratio_max": significant(max(v[1] for v in values)),
              "load_average_1m": load_average()})


# -- the run -----------------------------------------------------------------------------------

def cpu_description() -> tuple[str | None, str]:
    """The CPU's model name and its flags line, from /proc/cpuinfo."""
    model, flags = None, ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name") and model is None:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = line
                    break
    except OSError:
        pass
    return model, flags


def machine_record(device: torch.device, candidates: list[Candidate], peak_ok: bool) -> dict:
    cpu, flags = cpu_description()
    record = {"benchmark": "peers_machine", "device": device.type,
              "cpu": cpu, "cpus": os.cpu_count(),
              "avx2": " avx2" in flags, "avx512f": " avx512f" in flags,
              "memory_gib": significant(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                                        / 2**30, 3),
              "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
              "peak_rss_exact": peak_ok,
              "versions": {c.package: package_version(c.package) for c in candidates
                           if c.package is not None},
              "load_average": [significant(v, 3) for v in os.getloadavg()]}
    if device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(device)
    return record


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1M-param workloads, a 16-tensor LoRA set, 3 repeats, "
                             "a 30-step LM on one seed")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--only", default="", help="comma-separated candidate names")
    parser.add_argument("--workloads", default="",
                        help="comma-separated workload names (default: all)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps of a fast candidate")
    parser.add_argument("--min-repeats", type=int, default=3)
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds of timed steps per candidate and workload before a slow "
                             "candidate stops at --min-repeats")
    parser.add_argument("--lm-steps", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--lm-threads", type=int, default=1)
    parser.add_argument("--pressure-headroom-mib", type=int, default=256,
                        help="CUDA: GPU memory left free in the *_pressure workload")
    args = parser.parse_args(argv)
    defaults = dict(repeats=(3, 15), budget=(1.0, 20.0), lm_steps=(30, 300), seeds=(1, 3))
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.parts = [part for part in args.parts.split(",") if part]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}, expected a subset of {PARTS}")
    known = {c.name for c in CANDIDATES}
    args.only = [name for name in args.only.split(",") if name]
    args.workloads = [name for name in args.workloads.split(",") if name]
    names = {w.name for w in workloads(args.quick)}
    if set(args.workloads) - names:
        parser.error(f"--workloads: unknown {sorted(set(args.workloads) - names)}, "
                     f"expected of {sorted(names)}")
    if set(args.only) - known:
        parser.error(f"--only: unknown {sorted(set(args.only) - known)}, expected of {sorted(known)}")
    if args.min_repeats < 1 or args.repeats < args.min_repeats:
        parser.error("need 1 <= --min-repeats <= --repeats")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    keep_stdout_for_results()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        for candidate in CANDIDATES:
            skipped(candidate.name, "all", "no CUDA device", device.type)
        return
    pinned = pin_malloc_to_mmap()
    peak_ok = reset_peak(device)
    selected = [c for c in CANDIDATES if not args.only or c.name in args.only]
    if args.only and BASELINE not in args.only:
        selected.insert(0, next(c for c in CANDIDATES if c.name == BASELINE))
    runnable = []
    for candidate in selected:
        reason = availability(candidate, device.type)
        if reason is None:
            runnable.append(candidate)
        else:
            skipped(candidate.name, "all", reason, device.type)
    record = machine_record(device, runnable, peak_ok)
    record["malloc_pinned_to_mmap"] = pinned
    report(record)
    if "throughput" in args.parts:
        baselines = {}
        for workload in workloads(args.quick):
            if args.workloads and workload.name not in args.workloads:
                continue
            baselines[workload.name] = throughput(workload, runnable, device, args, peak_ok)
        if device.type == "cuda" and workloads(args.quick)[0].name in baselines:
            plain = workloads(args.quick)[0]
            pressured = Workload(f"{plain.name}_pressure", plain.shapes, plain.dtype)
            throughput(pressured, [c for c in runnable if c.name in PAGED], device, args,
                       peak_ok, baseline_s=baselines[plain.name])
    if "quality" in args.parts:
        quality(runnable, device, args)


if __name__ == "__main__":
    main()
