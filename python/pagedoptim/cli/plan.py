"""`python -m pagedoptim plan`: will this training run fit, with which settings, and how fast
will its optimizer step be?

Give the model (a HF config.json, a parameter count, or named shapes), the memory you have
(GPU, host, free NVMe) and the training shape. plan prints the memory each component needs
for torch.optim.AdamW, a generic 8-bit optimizer without paging, and pagedoptim with
offload=None|host|nvme; recommends the settings that fit; and estimates the optimizer
step's time and paging traffic from the link bandwidths `python -m pagedoptim bench`
measured on this machine (or stated defaults, which it names).

Optimizer-state bytes are exact: plan runs pagedoptim's own page layout. Activations are an
estimate, and are marked as one.

Sizes take decimal (GB) or binary (GiB, or a bare G) suffixes: 24GiB, 80G, 1.5TB.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

import torch

from pagedoptim import paging

from pagedoptim.cli import machine_profile, memory_plan, model_shapes
from pagedoptim.cli.memory_plan import Column, Method, Params, TrainingShape
from pagedoptim.paging.options import PagingOptions
from pagedoptim.paging.setting_text import parse_byte_size

# The smallest page cache plan recommends: MIN_CACHE_PAGES pages of 4 KiB would page too
# often to be worth it; 64 MiB keeps steps from stalling on every page.
_MIN_RECOMMENDED_CACHE = 64 << 20
# GPU memory a plan leaves free: torch's caching allocator rounds and fragments, so a peak
# of exactly the GPU's size would not run. 3% of the GPU, at least 256 MiB.
_HEADROOM_FRACTION = 0.03
_MIN_HEADROOM = 256 << 20
_CACHE_ROUNDING = 2 << 20
# The CPU pager's reads from the page file are as deep as its prefetch window: the default 4
# pages of 2 MiB keep 8 MiB in flight. On the disk of docs/paging.md, a step of 1e9 bf16
# params (cache 1/8 of the state) moved 1.09-1.44x the bytes per second 32 pages ahead, in
# every pair of runs in turn, with the same traffic. The window's slots come out of
# the cache's budget, so plan asks for at most an eighth of it.
_NVME_PREFETCH = 32
_PEER_NAME = "8-bit, no paging"
_MIXED_NAME = "torch AdamW, fp32 master"
_CLASS_NAMES = {"adamw": "AdamW", "lion": "Lion", "sgd": "SGD"}
# torch has no Lion: its column is a plain implementation's state (one moment per param).
_TORCH_NAMES = {"adamw": "torch.optim.AdamW", "sgd": "torch.optim.SGD", "lion": "plain Lion"}


def parse_size(text: str, flag: str) -> int:
    try:
        size = parse_byte_size(str(text))
    except ValueError as error:
        raise ValueError(f"{flag}: {error}, got {text!r}") from None
    if size <= 0 or size > 2**60:
        raise ValueError(f"{flag}: expected a size above 0 and below 1 EiB, got {text!r}")
    return size


def human(size: Optional[float]) -> str:
    if size is None:
        return "-"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"


# --- building the plan ----------------------------------------------------------------------


def _model_spec(args: argparse.Namespace) -> model_shapes.ModelSpec:
    given = [name for name in ("model", "params", "shapes") if getattr(args, name)]
    if len(given) != 1:
        raise ValueError("name the model with exactly one of --model CONFIG.json, --params "
                         f"COUNT or --shapes NAME=DxD,...; got {len(given) or 'none'}")
    if args.model:
        return model_shapes.from_hf_config(args.model)
    if args.params:
        return model_shapes.from_param_count(args.params)
    return model_shapes.from_named_shapes(args.shapes)


def _dtype(args: argparse.Namespace, spec: model_shapes.ModelSpec, on_gpu: bool) -> torch.dtype:
    if args.dtype is not None:
        return memory_plan.DTYPES[args.dtype]
    if spec.dtype in memory_plan.DTYPES.values():
        return spec.dtype
    return torch.bfloat16 if on_gpu else torch.float32


def _base_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"state_bits": args.state_bits, "master_bits": args.master_bits}


def _pagedoptim_column(name: str, params: Params, settings: dict[str, Any],
                       context: dict[str, Any]) -> Column:
    return memory_plan.build_column(name, params, settings=settings, **context)


def headroom_bytes(gpu_memory: Optional[int]) -> int:
    """GPU memory a plan keeps free for the allocator (0 without a GPU)."""
    if gpu_memory is None:
        return 0
    return max(_MIN_HEADROOM, int(gpu_memory * _HEADROOM_FRACTION))


def _fits(column: Column, budget: dict[str, Optional[int]], on_gpu: bool) -> dict[str, int]:
    """Bytes missing per resource (empty: it fits), the GPU's headroom kept free."""
    missing = {}
    if on_gpu:
        usable = budget["gpu"] - headroom_bytes(budget["gpu"])
        if column.device_peak > usable:
            missing["gpu_memory"] = column.device_peak - usable
        host = column.host_needed + memory_plan.HOST_OVERHEAD_BYTES
    else:
        host = column.device_peak + column.host_needed + memory_plan.HOST_OVERHEAD_BYTES
    if budget["host"] is not None and host > budget["host"]:
        missing["host_memory"] = host - budget["host"]
    if column.nvme and budget["nvme"] is not None and column.nvme > budget["nvme"]:
        missing["nvme"] = column.nvme - budget["nvme"]
    return missing


def _cache_that_fits(params: Params, settings: dict[str, Any], context: dict[str, Any],
                     budget: dict[str, Optional[int]], on_gpu: bool) -> int:
    """The largest page cache (a 2 MiB multiple) the training device has room for."""
    probe = _pagedoptim_column("probe", params, {**settings, "cache_bytes": _CACHE_ROUNDING},
                               context)
    room = budget["gpu"] if on_gpu else budget["host"]
    if room is None:
        return 0
    if on_gpu:
        room -= headroom_bytes(room)
    else:
        room -= memory_plan.HOST_OVERHEAD_BYTES
    spare = room - (probe.device_peak - probe.page_cache)
    return max(0, spare // _CACHE_ROUNDING * _CACHE_ROUNDING)


def _candidates(params: Params, args: argparse.Namespace, context: dict[str, Any],
                budget: dict[str, Optional[int]], on_gpu: bool) -> list[tuple[str, dict]]:
    """pagedoptim settings from fastest to slowest: unpaged, paged to host memory (GPU
    only), paged to NVMe; then each again with release_grads (which rules out gradient
    clipping and accumulation, so it comes after paging, which changes nothing)."""
    base = _base_settings(args)
    out = []
    for release in (False, True):
        extra = {"release_grads": True} if release else {}
        out.append(("unpaged", {**base, **extra}))
        for tier in (("host", "nvme") if on_gpu else ("nvme",)):
            settings = {**base, **extra, "offload": tier}
            if tier == "nvme" and args.nvme_dir:
                settings["nvme_dir"] = args.nvme_dir
            # Where even the smallest cache does not fit, it stays a candidate: the
            # shortfall is then reported for it.
            cache = args.cache_bytes or max(_MIN_RECOMMENDED_CACHE, _cache_that_fits(
                params, settings, context, budget, on_gpu))
            out.append((f"offload={tier}", _with_cache(settings, cache, on_gpu)))
    return out


def _with_cache(settings: dict[str, Any], cache_bytes: int, on_gpu: bool) -> dict[str, Any]:
    """Paged settings with their cache, and on the CPU with the page file's prefetch."""
    settings = {**settings, "cache_bytes": cache_bytes}
    if settings["offload"] == "nvme" and not on_gpu:
        settings["prefetch"] = nvme_prefetch(cache_bytes)
    return settings


def nvme_prefetch(cache_bytes: int) -> int:
    """The prefetch depth plan recommends for a CPU optimizer paged to NVMe: 32 pages, or an
    eighth of the cache's pages where that is fewer, never below the default. Pages are at
    most paging.DEFAULT_PAGE_BYTES (choose_page_bytes), so the count is never too high."""
    pages = cache_bytes // paging.DEFAULT_PAGE_BYTES
    return max(PagingOptions.prefetch, min(_NVME_PREFETCH, pages // 8))


def _step_mode(column: Column, params: Params) -> Optional[str]:
    """The bench mode whose kernels step like this column's (machine_profile names; None:
    bench measures no such step). A paged column's kernels are its unpaged mode's: its
    page traffic is estimated apart, from the link it crosses."""
    settings = column.settings
    if column.name == _PEER_NAME:
        return None
    if not settings:
        return "torch_adamw"
    if settings.get("state_bits") == 32:
        return "exact"
    half = any(dtype != torch.float32 for _, _, dtype in params.trainable)
    return "bf16_master24" if half and settings.get("master_bits") == 24 else "8bit"


def estimate_step(column: Column, params: Params, profile: machine_profile.MachineProfile,
                  device: torch.device) -> dict[str, Any]:
    """Seconds per optimizer step and paging traffic, with where each number came from."""
    on_gpu = device.type == "cuda"
    touched = memory_plan.step_bytes_touched(params, column)
    measured = None if on_gpu else profile.step_params_per_s.get(
        (_step_mode(column, params), "cpu"))
    if measured is not None:
        kernel, kernel_source = params.trainable_elements / measured, \
            f"{_step_mode(column, params)} step measured by bench ({profile.path})"
    else:
        link = profile.link("device_memory" if on_gpu else "memory")
        kernel, kernel_source = touched / link.bytes_per_s, \
            f"{human(touched)} touched at {link.bytes_per_s / 1e9:.0f} GB/s ({link.source})"
    read, written = memory_plan.paging_traffic_bytes(column)
    io, io_source = 0.0, None
    offload = column.settings.get("offload")
    if offload == "host":
        h2d, d2h = profile.link("host_to_device"), profile.link("device_to_host")
        io = max(read / h2d.bytes_per_s, written / d2h.bytes_per_s)
        io_source = f"pinned copies at {h2d.bytes_per_s / 1e9:.0f} GB/s ({h2d.source})"
    elif offload == "nvme":
        disk = profile.link("disk_mixed")
        io = (read + written) / disk.bytes_per_s
        io_source = f"disk at {disk.bytes_per_s / 1e9:.1f} GB/s mixed ({disk.source})"
    # Both pagers prefetch while kernels run. On the CPU the pager's threads read and write
    # pages while the kernel steps resident ones: measured on 1e9 bf16 params paged to NVMe
    # with a cache of 1/8 of the state, the step took 1.03x max(kernel, io) at the median
    # disk probe of the run, against 0.89x their sum (docs/paging.md).
    step = max(kernel, io)
    return {"step_seconds": step, "kernel_seconds": kernel, "io_seconds": io,
            "paging_read_bytes": read, "paging_written_bytes": written,
            "kernel_source": kernel_source, "io_source": io_source}


def _context(spec: model_shapes.ModelSpec, training: TrainingShape, dtype: torch.dtype,
             device: torch.device, algorithm: str) -> dict[str, Any]:
    """build_column's arguments for a training shape: activations are known only with the
    model's dimensions."""
    if spec.dims is not None:
        activations = memory_plan.activation_bytes(spec.dims, training, dtype)
        loss_transient = memory_plan.loss_transient_bytes(spec.dims, training, dtype)
    else:
        activations, loss_transient = None, 0
    return dict(device=device, algorithm=algorithm, activations=activations,
                loss_transient=loss_transient)


def _recommend(params: Params, args: argparse.Namespace, context: dict[str, Any],
               budget: dict[str, Optional[int]], on_gpu: bool
               ) -> tuple[Optional[Column], list[tuple[Column, dict[str, int]]]]:
    """The first candidate that fits (None: none does), and every one tried with what it
    misses."""
    tried = []
    for label, settings in _candidates(params, args, context, budget, on_gpu):
        column = _pagedoptim_column(label, params, settings, context)
        missing = _fits(column, budget, on_gpu)
        tried.append((column, missing))
        if not missing:
            return column, tried
    return None, tried


def _training_changes(training: TrainingShape) -> list[tuple[str, TrainingShape]]:
    """Smaller training shapes, each change on top of the ones before: activation
    checkpointing, a micro-batch of 1, half and a quarter of the sequence."""
    changes, flags = [], []
    shape = training
    if not shape.activation_checkpointing:
        shape = TrainingShape(shape.seq_len, shape.micro_batch, True)
        flags.append("--activation-checkpointing")
        changes.append((" ".join(flags), shape))
    if shape.micro_batch > 1:
        shape = TrainingShape(shape.seq_len, 1, shape.activation_checkpointing)
        flags.append("--micro-batch 1")
        changes.append((" ".join(flags), shape))
    for _ in range(2):
        if shape.seq_len < 256:
            break
        shape = TrainingShape(shape.seq_len // 2, shape.micro_batch, True)
        changes.append((" ".join(flags + [f"--seq-len {shape.seq_len}"]), shape))
    return changes


def _what_would_fit(spec: model_shapes.ModelSpec, params: Params, args: argparse.Namespace,
                    training: TrainingShape, dtype: torch.dtype, device: torch.device,
                    budget: dict[str, Optional[int]], on_gpu: bool) -> Optional[dict[str, Any]]:
    """Where nothing fits: the first smaller training shape under which a setting does."""
    if spec.dims is None:  # activations unknown: a shape change cannot be judged
        return None
    for flags, shape in _training_changes(training):
        context = _context(spec, shape, dtype, device, args.optimizer)
        column, _ = _recommend(params, args, context, budget, on_gpu)
        if column is not None:
            return {"flags": flags, "settings": column.settings,
                    "device_peak": column.device_peak}
    return None


def _mixed_precision_column(params: Params, algorithm: str, context: dict[str, Any]
                            ) -> Optional[Column]:
    """torch's optimizer as mixed-precision training runs it (torch.autocast): fp32 params
    that are their own master copy, fp32 grads and moments, 16-bit compute. None for fp32
    params, where the plain torch column is that already."""
    if all(dtype == torch.float32 for _, _, dtype in params.trainable):
        return None
    fp32 = Params([(name, shape, torch.float32) for name, shape, _ in params.trainable],
                  params.frozen_bytes)
    state, transient = memory_plan.torch_state_bytes(fp32, algorithm)
    return memory_plan.build_column(f"{_TORCH_NAMES[algorithm]} (autocast)", fp32, state=state,
                                    step_transient=transient, **context)


def build_plan(args: argparse.Namespace) -> dict[str, Any]:
    spec = _model_spec(args)
    on_gpu = args.gpu_memory is not None
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = _dtype(args, spec, on_gpu)
    method = Method(args.lora_rank, tuple(args.lora_modules.split(",")))
    training = TrainingShape(args.seq_len, args.micro_batch, args.activation_checkpointing)
    params = memory_plan.trainable_params(spec, method, dtype)
    nvme_free = args.nvme_free
    if nvme_free is None and args.nvme_dir:
        stats = os.statvfs(args.nvme_dir)
        nvme_free = stats.f_bavail * stats.f_frsize
    budget = {"gpu": args.gpu_memory, "host": args.host_memory, "nvme": nvme_free}
    context = _context(spec, training, dtype, device, args.optimizer)

    torch_state, torch_transient = memory_plan.torch_state_bytes(params, args.optimizer)
    mixed = _mixed_precision_column(params, args.optimizer, context)
    columns = ([mixed] if mixed is not None else []) + [
        memory_plan.build_column(_TORCH_NAMES[args.optimizer], params,
                                 state=torch_state, step_transient=torch_transient, **context),
        memory_plan.build_column(
            _PEER_NAME, params,
            state=memory_plan.blockwise_8bit_state_bytes(params, args.optimizer), **context),
    ]
    recommendation, tried = _recommend(params, args, context, budget, on_gpu)
    base = _base_settings(args)
    columns.append(_pagedoptim_column("pagedoptim offload=None", params, base, context))
    # The paged columns show the recommended cache where paging is recommended, else the
    # cache that fits beside full gradients.
    if recommendation is not None and recommendation.settings.get("offload"):
        shown_cache = recommendation.settings["cache_bytes"]
    else:
        shown_cache = args.cache_bytes or max(_MIN_RECOMMENDED_CACHE, _cache_that_fits(
            params, {**base, "offload": "nvme"}, context, budget, on_gpu))
    for tier in (("host", "nvme") if on_gpu else ("nvme",)):
        columns.append(_pagedoptim_column(
            f"pagedoptim offload={tier}", params,
            _with_cache({**base, "offload": tier}, shown_cache, on_gpu), context))
    # The recommended settings as a column of their own where no column above has them
    # (gradient release, say).
    if recommendation is not None and all(column.settings != recommendation.settings
                                          for column in columns):
        recommendation.name = "recommended"
        columns.append(recommendation)
    profile = machine_profile.load_profile(args.bench_file)
    for column in columns + [column for column, _ in tried]:
        column.estimates = estimate_step(column, params, profile, device)
    closest = min(tried, key=lambda item: sum(item[1].values()))
    return {
        "model": spec.description,
        "num_params": spec.num_params,
        "trainable_params": params.trainable_elements,
        "dtype": str(dtype).replace("torch.", ""),
        "device": device.type,
        "optimizer": args.optimizer,
        "method": "full fine-tune" if not method.is_lora else
                  f"LoRA r={method.lora_rank} on {','.join(method.lora_modules)}",
        "training": {"seq_len": training.seq_len, "micro_batch": training.micro_batch,
                     "activation_checkpointing": training.activation_checkpointing},
        "budget": budget,
        "headroom_bytes": headroom_bytes(budget["gpu"]),
        "activations_are_estimate": True,
        "columns": [column.as_dict() for column in columns],
        "recommendation": recommendation.as_dict() if recommendation else None,
        "trainer_optim_args": (trainer_optim_args(args.optimizer, recommendation.settings)
                               if recommendation else None),
        "missing": None if recommendation else {"settings": closest[0].settings,
                                                "bytes": closest[1]},
        "fits_with": None if recommendation else _what_would_fit(
            spec, params, args, training, dtype, device, budget, on_gpu),
        "overheads": {"cuda_context": memory_plan.CUDA_OVERHEAD_BYTES if on_gpu else 0,
                      "host_process": memory_plan.HOST_OVERHEAD_BYTES},
        "bench_file": str(profile.path) if profile.path else None,
    }


def _size_text(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def trainer_optim_args(algorithm: str, settings: dict[str, Any]) -> dict[str, str]:
    """The recommendation as HF Trainer takes it: optim and optim_args (docs/integrations)."""
    def text(key: str, value: Any) -> str:
        if value is None:
            return "none"
        if isinstance(value, bool):
            return "true" if value else "false"
        if key in ("cache_bytes", "page_bytes"):
            return _size_text(int(value))
        return str(value)

    return {"optim": f"pagedoptim_{algorithm}",
            "optim_args": ",".join(f"{key}={text(key, value)}"
                                   for key, value in settings.items())}


# --- printing -------------------------------------------------------------------------------

_ROWS = [
    ("weights", "weights"),
    ("gradients", "grads"),
    ("activations (estimate)", "activations"),
    ("optimizer state", "optimizer_state"),
    ("master residual", "master_residual"),
    ("page cache", "page_cache"),
    ("pinned host", "pinned_host"),
    ("host tier", "host"),
    ("NVMe page file", "nvme"),
    ("step transient", "step_transient"),
]


def _settings_text(settings: dict[str, Any]) -> str:
    shown = {key: value for key, value in settings.items() if value is not None}
    return ", ".join(f"{key}={value!r}" for key, value in shown.items())


def print_plan(plan: dict[str, Any], out=None) -> None:
    out = out if out is not None else sys.stdout
    gpu = plan["device"] == "cuda"
    print(f"model: {plan['model']}; {plan['num_params']:,} params, "
          f"{plan['trainable_params']:,} trainable ({plan['method']}), {plan['dtype']}", file=out)
    t = plan["training"]
    print(f"training: seq_len {t['seq_len']} x micro-batch {t['micro_batch']}, activation "
          f"checkpointing {'on' if t['activation_checkpointing'] else 'off'}, on "
          f"{'the GPU' if gpu else 'the CPU'}", file=out)
    budget = plan["budget"]
    print("have: " + ", ".join(f"{name} {human(value)}" for name, value in
                                (("GPU", budget["gpu"]), ("host", budget["host"]),
                                 ("NVMe free", budget["nvme"])) if value is not None)
          + (f" (the plan keeps {human(plan['headroom_bytes'])} of the GPU free for the "
             "allocator)" if gpu else ""), file=out)
    print(file=out)
    columns = plan["columns"]
    width = max(26, *(len(c["name"]) + 2 for c in columns))
    label_width = 24
    print(f"{'':<{label_width}}" + "".join(f"{c['name']:>{width}}" for c in columns), file=out)
    for label, key in _ROWS:
        print(f"{label:<{label_width}}" + "".join(f"{human(c[key]):>{width}}" for c in columns),
              file=out)
    peak_label = "peak on GPU (+ CUDA ctx)" if gpu else "peak in host memory"
    print(f"{peak_label:<{label_width}}" + "".join(f"{human(c['device_peak']):>{width}}"
                                                    for c in columns), file=out)
    print(f"{'step time (estimate)':<{label_width}}" + "".join(
        f"{c['estimates']['step_seconds'] * 1e3:>{width - 3}.1f} ms" for c in columns), file=out)
    print(f"{'paging traffic / step':<{label_width}}" + "".join(
        f"{human(c['estimates']['paging_read_bytes'] + c['estimates']['paging_written_bytes']):>{width}}"
        for c in columns), file=out)
    print(file=out)
    print("Activations are an estimate (a pre-norm decoder with SDPA attention); optimizer "
          "state is exact.", file=out)
    torch_name = _TORCH_NAMES[plan["optimizer"]]
    mixed = next((c for c in columns if c["name"] == f"{torch_name} (autocast)"), None)
    if mixed is not None:
        print(f"{torch_name} (autocast) is mixed-precision training as torch.autocast runs it: "
              f"fp32 params (the master copy), fp32 grads and moments, {plan['dtype']} compute; "
              f"{torch_name} keeps params, grads and moments in {plan['dtype']}, with no master "
              "copy.", file=out)
    recommendation = plan["recommendation"]
    if recommendation is not None and mixed is not None:
        saving = 1 - recommendation["device_peak"] / mixed["device_peak"]
        plain = next(c for c in columns if c["name"] == torch_name)
        print(f"The recommendation needs {human(recommendation['device_peak'])} "
              f"{'on the GPU' if gpu else 'in host memory'}: {saving:.0%} less than "
              f"{torch_name} (autocast), {1 - recommendation['device_peak'] / plain['device_peak']:.0%} "
              f"less than {torch_name} in {plan['dtype']}.", file=out)
    if recommendation is not None:
        e = recommendation["estimates"]
        cache = recommendation["settings"].get("cache_bytes")
        print(f"recommended: po.{_CLASS_NAMES[plan['optimizer']]}(model.parameters(), "
              f"{_settings_text(recommendation['settings'])})"
              + (f"  # cache_bytes = {human(cache)}" if cache else ""), file=out)
        print(f"  peak {human(recommendation['device_peak'])} "
              f"{'on the GPU' if gpu else 'in host memory'}, "
              f"{human(recommendation['host_needed'])} pinned/host state, "
              f"{human(recommendation['nvme'])} on NVMe; step ~{e['step_seconds'] * 1e3:.1f} ms "
              f"({e['kernel_source']}" + (f"; {e['io_source']}" if e["io_source"] else "") + ")",
              file=out)
        if recommendation["settings"].get("release_grads"):
            print("  release_grads=True: no gradient clipping or accumulation (the grads are "
                  "applied and freed inside backward)", file=out)
        trainer = plan["trainer_optim_args"]
        print(f"  HF Trainer: TrainingArguments(..., optim=\"{trainer['optim']}\", "
              f"optim_args=\"{trainer['optim_args']}\")", file=out)
    else:
        missing = plan["missing"]
        shortfall = ", ".join(f"{name.replace('_', ' ')} short by {human(value)} "
                              f"({value:,} bytes)" for name, value in missing["bytes"].items())
        print(f"does not fit: even the most frugal settings ({_settings_text(missing['settings'])}"
              f") leave {shortfall}.", file=out)
        weights = next(c for c in plan["columns"]
                       if c["name"] == _TORCH_NAMES[plan["optimizer"]])["weights"]
        room = budget["gpu"] if gpu else budget["host"]
        if room is not None and weights > room:
            print(f"  The weights alone need {human(weights)} "
                  f"{'on the GPU' if gpu else 'in host memory'}: pagedoptim pages optimizer "
                  "state, never weights.", file=out)
        options = [] if plan["method"].startswith("LoRA") else ["LoRA (--lora-rank)"]
        if not plan["training"]["activation_checkpointing"]:
            options.append("activation checkpointing")
        options += ["a shorter sequence or micro-batch", "or more memory"]
        fits_with = plan["fits_with"]
        if fits_with is not None:
            print(f"  It fits with {fits_with['flags']}: "
                  f"po.{_CLASS_NAMES[plan['optimizer']]}(model.parameters(), "
                  f"{_settings_text(fits_with['settings'])}), peak "
                  f"{human(fits_with['device_peak'])}.", file=out)
        print(f"  Options: {', '.join(options)}.", file=out)
    if plan["bench_file"] is None:
        print("Bandwidths are stated defaults: run `python -m pagedoptim bench` to measure "
              "this machine.", file=out)


# --- command line ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("the model (exactly one)")
    model.add_argument("--model", help="a HF config.json (or a directory holding one)")
    model.add_argument("--params", help="a parameter count, e.g. 7e9 or 7B")
    model.add_argument("--shapes", help="named shapes, e.g. embed=32000x4096,q=4096x4096*32")
    parser.add_argument("--dtype", choices=sorted(memory_plan.DTYPES),
                        help="param dtype (default: the config's, else bf16 on a GPU, fp32 on "
                             "the CPU)")
    memory = parser.add_argument_group("the memory you have")
    memory.add_argument("--gpu-memory", help="GPU memory, e.g. 24GiB (omit: train on the CPU)")
    memory.add_argument("--host-memory", help="host memory, e.g. 64GiB")
    memory.add_argument("--nvme-free", help="free space for the page file, e.g. 500GB")
    memory.add_argument("--nvme-dir", help="where the page file would go (its free space is "
                                           "used when --nvme-free is not given)")
    shape = parser.add_argument_group("the training")
    shape.add_argument("--seq-len", type=int, default=2048, help="default: %(default)s")
    shape.add_argument("--micro-batch", type=int, default=1, help="default: %(default)s")
    shape.add_argument("--activation-checkpointing", action="store_true")
    shape.add_argument("--lora-rank", type=int, help="LoRA of this rank (default: full "
                                                     "fine-tune)")
    shape.add_argument("--lora-modules", default="q_proj,k_proj,v_proj,o_proj",
                       help="comma-separated module names, or all-linear (default: "
                            "%(default)s)")
    options = parser.add_argument_group("the optimizer")
    options.add_argument("--optimizer", choices=("adamw", "lion", "sgd"), default="adamw")
    options.add_argument("--state-bits", type=int, choices=(8, 32), default=8)
    options.add_argument("--master-bits", type=lambda text: None if text == "none" else int(text),
                         default=24, help="24, 32 or none (default: %(default)s)")
    options.add_argument("--cache-bytes", help="page cache size to plan with (default: what "
                                               "fits)")
    parser.add_argument("--bench-file", help="bench results to estimate with (default: "
                                             f"{machine_profile.default_path()})")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _validate(args: argparse.Namespace) -> None:
    for name in ("seq_len", "micro_batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lora_rank is not None and args.lora_rank < 1:
        raise ValueError(f"--lora-rank must be >= 1, got {args.lora_rank}")
    if args.master_bits not in (None, 24, 32):
        raise ValueError(f"--master-bits must be 24, 32 or none, got {args.master_bits}")
    for flag in ("gpu_memory", "host_memory", "nvme_free", "cache_bytes"):
        value = getattr(args, flag)
        if value is not None:
            setattr(args, flag, parse_size(value, f"--{flag.replace('_', '-')}"))
    if args.nvme_dir and not os.path.isdir(args.nvme_dir):
        raise ValueError(f"--nvme-dir {args.nvme_dir!r} is not a directory")


def run(args: argparse.Namespace) -> int:
    try:
        _validate(args)
        plan = build_plan(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"plan: {error}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(plan, sys.stdout, indent=1, default=str)
        print()
    else:
        print_plan(plan)
    return 0 if plan["recommendation"] is not None else 1
