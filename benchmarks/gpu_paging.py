"""GPU paging: the offloaded step against the PCIe link, whole training steps with
paged state against resident state, and the 24 GB headline. One JSON line per result; every
baseline is measured in the same run.

Parts (--parts, default all):

  link      pinned host <-> device copy bandwidth (256 MiB, median of 7): the ceiling.
  step      the offloaded step alone: bf16 params (--step-params, default 512M) with 8-bit
            state and the int8 residual, offload="host", cache_bytes = 10% of the state,
            against the same params with resident state. Reported: bytes moved per step
            (both directions, from paging_stats), step time, and bytes/step_time as a
            fraction of the host-to-device bandwidth measured in `link`.
            Target: >= 0.80.
  train     a Llama-architecture model of about 1B params from a config, random bf16 weights,
            activation checkpointing, 8-bit state, release_grads=True with clip_grad_norm_
            (max_norm 1.0) over 2 micro-batches of accumulation, under
            torch.cuda.set_per_process_memory_fraction(24 GiB): offload="host" with a cache of
            10% of the state against resident state. Reported: tokens/s, peak memory, the
            ratio of step times. Target: paged <= 1.15x resident.
  headline  a Llama-3-8B-shaped model under the same 24 GiB cap: a few steps of full
            fine-tuning with paged 8-bit state, gradient release (clipped, 2 micro-batches:
            its bf16 gradients alone, 16 GB, would not fit beside its weights) and activation
            checkpointing (sequence --seq, batch 1). Reported: peak GPU memory (goal <= 17
            GiB) and tokens/s, next to the memory plan of torch AdamW and of 8-bit state
            without paging for the same model, computed here.

    python benchmarks/gpu_paging.py                     # everything, a few minutes on an H200
    python benchmarks/gpu_paging.py --quick             # small sizes, a smoke run
    python benchmarks/gpu_paging.py --quick --device cpu  # the harness on the CPU (tests)

Without a CUDA device (and without --device cpu) it prints {"skipped": ...} and exits 0. The
last line, "gpu_paging_targets", lists each target with its measured value; the exit status
is 1 only when a part failed to run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import pagedoptim as po

sys.path.insert(0, str(Path(__file__).resolve().parent))
from utils import emit, synchronize  # noqa: E402

GIB = 1 << 30
CAP_BYTES = 24 * GIB
# 8-bit m and v (a code byte per element, an fp16 scale per 32) and the int8 residual.
STATE_BYTES_PER_BF16_PARAM = 2 * (1 + 2 / 32) + 1


# -- link ----------------------------------------------------------------------------------


def link_bandwidth(device: torch.device, nbytes: int) -> dict[str, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result = {}
    for name, dst, src in (("host_to_device", dev, host), ("device_to_host", host, dev)):
        times = []
        for _ in range(7):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        result[f"{name}_gbps"] = nbytes / statistics.median(times) / 1e9
    return result


# -- the offloaded step alone --------------------------------------------------------------


def step_params(total: int, device: torch.device) -> list[torch.nn.Parameter]:
    chunk = 64 << 20
    sizes = [chunk] * (total // chunk) + ([total % chunk] if total % chunk else [])
    gen = torch.Generator(device=device).manual_seed(0)
    # One row each: 2-D, as a model's weights (1-D params keep fp32 moments).
    return [torch.nn.Parameter(torch.randn(1, n, generator=gen, device=device,
                                           dtype=torch.bfloat16) * 0.02) for n in sizes]


def time_steps(opt: Any, params: list, device: torch.device, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        opt.step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def moved_bytes(stats: dict[str, Any]) -> int:
    return int(stats["bytes_read"].get("host", 0) + stats["bytes_written"].get("host", 0))


def offloaded_step(device: torch.device, total: int, h2d_gbps: float | None) -> dict[str, Any]:
    params = step_params(total, device)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    state_bytes = int(total * STATE_BYTES_PER_BF16_PARAM)
    cache = max(2 << 20, state_bytes // 10)
    resident = po.AdamW(params, lr=1e-4)
    offload = "host" if device.type == "cuda" else "nvme"
    paged = po.AdamW([p for p in params], lr=1e-4, offload=offload, cache_bytes=cache)
    for opt in (resident, paged):  # warmup: state created, pages written home once
        time_steps(opt, params, device, 2)
    before = moved_bytes(paged.paging_stats())
    rounds, resident_times, paged_times = 5, [], []
    for _ in range(rounds):
        resident_times += time_steps(resident, params, device, 1)
        paged_times += time_steps(paged, params, device, 1)
    per_step = (moved_bytes(paged.paging_stats()) - before) / rounds
    paged_s, resident_s = statistics.median(paged_times), statistics.median(resident_times)
    stats = paged.paging_stats()
    record = {
        "bench": "gpu_paging", "part": "step", "device": str(device), "params": total,
        "state_bytes": state_bytes, "cache_bytes": cache, "offload": offload,
        "resident_step_s": resident_s, "paged_step_s": paged_s,
        "paged_over_resident": paged_s / resident_s,
        "bytes_moved_per_step": per_step, "moved_gbps": per_step / paged_s / 1e9,
        "links": stats.get("links"), "compute_wait_seconds": stats.get("compute_wait_seconds"),
    }
    if h2d_gbps:
        record["fraction_of_h2d"] = record["moved_gbps"] / h2d_gbps
    del resident, paged, params
    gc.collect()
    return record


# -- training ------------------------------------------------------------------------------


def llama_config(size: str):
    import transformers
    common = dict(hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False,
                  use_cache=False, attn_implementation="sdpa")
    if size == "8b":  # Llama-3-8B's shape
        return transformers.LlamaConfig(vocab_size=128256, hidden_size=4096,
                                        intermediate_size=14336, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=8,
                                        max_position_embeddings=8192, **common)
    if size == "1b":  # about 1.1B
        return transformers.LlamaConfig(vocab_size=32000, hidden_size=2048,
                                        intermediate_size=5632, num_hidden_layers=22,
                                        num_attention_heads=32, num_key_value_heads=4,
                                        max_position_embeddings=4096, **common)
    return transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=512, **common)


def build_model(size: str, device: torch.device):
    import transformers
    config = llama_config(size)
    # Built in bf16 on the device directly: an 8B model never exists in fp32 anywhere.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    # Activation checkpointing: transformers renamed it; take whichever this version has.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def memory_plan(num_params: int) -> dict[str, float]:
    """GiB of weights + grads + optimizer state for bf16 params, before activations. torch
    AdamW keeps bf16 moments beside bf16 params; 8-bit state keeps codes, scales and the
    residual; paged keeps only its cache on the GPU (and releases each grad in backward)."""
    weights = grads = 2 * num_params
    return {
        "torch_adamw_gib": (weights + grads + 4 * num_params) / GIB,
        "pagedoptim_8bit_resident_gib": (weights + grads
                                         + STATE_BYTES_PER_BF16_PARAM * num_params) / GIB,
        "pagedoptim_8bit_resident_release_gib": (weights
                                                 + STATE_BYTES_PER_BF16_PARAM * num_params) / GIB,
    }


def plan_against_measurement(model, opt, settings: dict[str, Any], *, seq: int, batch: int,
                              device: torch.device) -> dict[str, Any]:
    """What `python -m pagedoptim plan` says for this run next to what it measured: the
    optimizer-state bytes must be equal, the peak within 10%. On a GPU the peak
    is torch.cuda.max_memory_allocated, so plan's stated CUDA context overhead is left out."""
    from pagedoptim.cli import memory_plan as planner, model_shapes
    spec = model_shapes.from_module(model, "gpu_paging", dims=model_shapes.dims_from_config(
        model.config))
    dtype = next(model.parameters()).dtype
    params = planner.trainable_params(spec, planner.Method(), dtype)
    shape = planner.TrainingShape(seq, batch, activation_checkpointing=True)
    column = planner.build_column(
        "run", params, settings=settings, device=device, algorithm="adamw",
        activations=planner.activation_bytes(spec.dims, shape, dtype),
        loss_transient=planner.loss_transient_bytes(spec.dims, shape, dtype))
    record = {"state_bytes": column.exact_state.state_bytes,
              "measured_state_bytes": opt.memory_report()["state_bytes"]}
    record["state_exact"] = record["state_bytes"] == record["measured_state_bytes"]
    if device.type == "cuda":
        peak = column.device_peak - planner.CUDA_OVERHEAD_BYTES
        measured = torch.cuda.max_memory_allocated(device)
        record.update(peak_bytes=peak, measured_peak_bytes=measured,
                      peak_ratio=peak / measured)
    return record


def train_run(size: str, device: torch.device, *, paged: bool, seq: int, batch: int,
              steps: int, warmup: int, cache_fraction: float | None = 0.1,
              cache_bytes: int | None = None, accumulation: int = 2,
              max_norm: float = 1.0) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build_model(size, device)
    params = [p for p in model.parameters() if p.requires_grad]
    num_params = sum(p.numel() for p in params)
    state_bytes = int(num_params * STATE_BYTES_PER_BF16_PARAM)
    kw: dict[str, Any] = {}
    if paged:
        cache = cache_bytes if cache_bytes is not None else int(state_bytes * cache_fraction)
        kw = dict(offload="host" if device.type == "cuda" else "nvme",
                  cache_bytes=max(cache, 2 << 20))
    opt = po.AdamW(params, lr=1e-5, release_grads=True, **kw)
    vocab = model.config.vocab_size
    gen = torch.Generator(device=device).manual_seed(1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step in range(warmup + steps):
        ids = [torch.randint(0, vocab, (batch, seq), generator=gen, device=device)
               for _ in range(accumulation)]
        synchronize(device)
        start = time.perf_counter()
        for micro in ids:
            loss = model(input_ids=micro, labels=micro).loss / accumulation
            loss.backward()  # each grad goes to its gradient stream and is freed in here
        # Clipped exactly, from the norms taken as the gradients were released.
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    record = {
        "size": size, "params": num_params, "paged": paged, "seq": seq, "batch": batch,
        "accumulation": accumulation, "max_norm": max_norm, "grad_norm": float(grad_norm),
        "step_s": step_s, "tokens_per_s": accumulation * batch * seq / step_s,
        "loss": float(loss.detach()) * accumulation,
        "state_bytes": state_bytes, "cache_bytes": kw.get("cache_bytes"),
    }
    if device.type == "cuda":
        record["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        # The allocator's own view: slots are allocated a page at a time.
        record["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    record["plan"] = plan_against_measurement(model, opt, {"release_grads": True, **kw},
                                              seq=seq, batch=batch, device=device)
    if paged:
        stats = opt.paging_stats()
        record.update(links=stats.get("links"), compute_wait_seconds=stats.get(
            "compute_wait_seconds"), learned_order_pages=stats.get("learned_order_pages"),
            prefetch_hits=stats["prefetch_hits"], misses=stats["misses"])
    del opt, model, params, loss
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def cap_memory(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, CAP_BYTES / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


# -- main ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="link,step,train,headline")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--step-params", type=int, default=512 << 20)
    parser.add_argument("--seq", type=int, default=None, help="sequence length of the runs")
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        emit({"bench": "gpu_paging", "skipped": "no CUDA device"})
        return 0
    targets: dict[str, Any] = {}
    failed = False
    h2d = None
    fraction = cap_memory(device) if {"train", "headline"} & set(args.parts) else None

    def run(part: str, body) -> None:
        nonlocal failed
        if part not in args.parts:
            return
        try:
            body()
        except Exception as error:  # one part failing must not hide the others
            failed = True
            traceback.print_exc()
            emit({"bench": "gpu_paging", "part": part, "error": f"{type(error).__name__}: "
                  f"{error}"})

    def link() -> None:
        nonlocal h2d
        if device.type != "cuda":
            return
        result = link_bandwidth(device, (64 if args.quick else 256) << 20)
        h2d = result["host_to_device_gbps"]
        emit({"bench": "gpu_paging", "part": "link", **result})

    def step() -> None:
        total = (16 << 20) if args.quick else args.step_params
        record = offloaded_step(device, total, h2d)
        emit(record)
        if "fraction_of_h2d" in record:
            targets["offloaded_step_fraction_of_h2d"] = {
                "value": record["fraction_of_h2d"], "target": 0.80,
                "met": record["fraction_of_h2d"] >= 0.80}

    def train() -> None:
        size = "tiny" if args.quick else "1b"
        seq = args.seq or (128 if args.quick else 1024)
        batch = 2 if args.quick else 8
        runs = {}
        for paged in (False, True):
            runs[paged] = train_run(size, device, paged=paged, seq=seq, batch=batch,
                                    steps=3, warmup=2)
            emit({"bench": "gpu_paging", "part": "train", "memory_fraction": fraction,
                  **runs[paged]})
        ratio = runs[True]["step_s"] / runs[False]["step_s"]
        emit({"bench": "gpu_paging", "part": "train_ratio", "paged_over_resident": ratio})
        targets["train_1b_paged_over_resident"] = {"value": ratio, "target": 1.15,
                                                   "met": ratio <= 1.15}
        for paged, record in runs.items():
            plan = record["plan"]
            name = f"plan_{'paged' if paged else 'resident'}_1b"
            targets[f"{name}_state_exact"] = {"value": plan["state_bytes"],
                                              "measured": plan["measured_state_bytes"],
                                              "met": plan["state_exact"]}
            if "peak_ratio" in plan:
                targets[f"{name}_peak_ratio"] = {"value": plan["peak_ratio"], "target": "0.9-1.1",
                                                 "met": abs(plan["peak_ratio"] - 1) <= 0.10}

    def headline() -> None:
        size = "tiny" if args.quick else "8b"
        seq = args.seq or (128 if args.quick else 2048)
        record = train_run(size, device, paged=True, seq=seq, batch=1, steps=3, warmup=1,
                           cache_bytes=256 << 20)
        record["memory_plan"] = memory_plan(record["params"])
        emit({"bench": "gpu_paging", "part": "headline", "memory_fraction": fraction, **record})
        if "peak_gib" in record:
            targets["headline_8b_peak_gib"] = {"value": record["peak_gib"], "target": 17.0,
                                               "met": record["peak_gib"] <= 17.0,
                                               "tokens_per_s": record["tokens_per_s"]}

    run("link", link)
    run("step", step)
    run("train", train)
    run("headline", headline)
    emit({"bench": "gpu_paging_targets", "device": str(device), "quick": args.quick,
          "targets": targets})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
