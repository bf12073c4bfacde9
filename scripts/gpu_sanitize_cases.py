#!/usr/bin/env python3
"""Small CUDA step cases for compute-sanitizer (scripts/gpu_check.sh runs this under memcheck,
racecheck and synccheck).

Every kernel variant the table runs (AdamW with and without amsgrad, SGD with and without
momentum, Lion; fp32/bf16/fp16 params; fp32 and 8-bit state; no, int8 and int16 residuals),
over params whose sizes are off the 32-element group (partial last groups), a 0-dim param,
pages of 4 KiB (segments that start at odd group offsets inside shared pages), GradScaler's
unscale and skip paths, gradient release, a state_dict round trip, SkewAdam's statistics and
elementwise kernels (every tier), and state paged through the device cache to pinned host
memory and to the page file (the copy engine's side of a step). Each case is small: under a
sanitizer every access is checked, so the cases are chosen for coverage, not size.

Each case also compares the CUDA params with a CPU run of the same config, bit for bit (the
full comparison, state included, is tests/python/test_cuda_step.py): a sanitizer run that
passes its checks but computes wrong numbers should not look clean.

One JSON line per case, then a summary line; exit status 1 if any case failed, 0 otherwise
(also when there is no CUDA device: then it prints {"skipped": ...}). `--simulated` runs every
case on the simulated device instead (CPU params, the host emulation of the kernels): how CI
checks the cases themselves before a sanitizer runs them.

    python scripts/gpu_sanitize_cases.py            # all cases
    python scripts/gpu_sanitize_cases.py --quick    # one format per algorithm
    python scripts/gpu_sanitize_cases.py --quick --simulated   # on a machine without a GPU
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 PAGEDOPTIM_CUDA_DEBUG_SYNC=1 \\
        compute-sanitizer --tool memcheck python scripts/gpu_sanitize_cases.py
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch
from torch import nn

SHAPES = [(), (31,), (33,), (1000,), (64, 65)]
PAGE_BYTES = 4096
DEVICE = "cuda"  # "cpu" with --simulated
# What an optimizer over DEVICE params adds to its arguments: with --simulated,
# pagedoptim.paging.resident_on_simulated_device() (the analogue of CUDA's resident state).
ON_DEVICE: dict = {}

ALGORITHMS = {
    "adamw": ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    "adamw-amsgrad-maximize": ("AdamW", dict(lr=1e-2, amsgrad=True, maximize=True)),
    "sgd": ("SGD", dict(lr=0.1, weight_decay=0.01)),
    "sgd-nesterov": ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
    "lion": ("Lion", dict(lr=1e-3, weight_decay=0.1)),
}
FORMATS = [(torch.float32, 32, None), (torch.float32, 8, None), (torch.bfloat16, 8, 24),
           (torch.bfloat16, 32, 32), (torch.float16, 8, 32), (torch.float16, 32, None)]
QUICK_FORMATS = [(torch.bfloat16, 8, 24), (torch.float16, 32, 32)]


def optimizer_class(name: str):
    import pagedoptim

    return getattr(pagedoptim, name)


def grads_for(shapes, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=gen) * 10.0 ** ((i % 4) - 2)
            for i, shape in enumerate(shapes)]


def values_for(shapes, dtype, seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for shape in shapes]


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    return t


def check_same(cpu_params, cuda_params) -> None:
    for i, (a, b) in enumerate(zip(cpu_params, cuda_params)):
        differ = bits(a) != bits(b)
        if bool(differ.any()):
            raise AssertionError(f"param {i} {tuple(a.shape)}: {int(differ.sum())} of "
                                 f"{a.numel()} elements differ from the CPU step")


def synchronize() -> None:
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


def on_device(kwargs: dict) -> dict:
    """`kwargs` for an optimizer over DEVICE params: its own paging options, else ON_DEVICE."""
    return kwargs if "offload" in kwargs else {**ON_DEVICE, **kwargs}


def lockstep_case(class_name, kwargs, dtype, shapes, steps=2, groups=list):
    """A CPU and a device copy of the same params (param groups made by `groups`) stepped
    together; the device's params must equal the CPU's bit for bit."""
    factory = optimizer_class(class_name)
    values = values_for(shapes, dtype)
    cpu = [nn.Parameter(v.clone()) for v in values]
    cuda = [nn.Parameter(v.to(DEVICE, copy=True)) for v in values]
    cpu_opt = factory(groups(cpu), **{k: v for k, v in kwargs.items() if k not in PAGING_KEYS})
    cuda_opt = factory(groups(cuda), **on_device(kwargs))
    for t in range(steps):
        for p, q, g in zip(cpu, cuda, grads_for(shapes, t)):
            cast = g.to(dtype)
            p.grad = cast.clone()
            q.grad = cast.to(DEVICE)
        cpu_opt.step()
        cuda_opt.step()
    synchronize()
    check_same(cpu, cuda)
    cuda_opt.state_dict()  # reads every stream back through the page store
    return cpu_opt, cuda_opt, cpu, cuda


def amp_case(class_name, kwargs, dtype):
    """GradScaler over a CUDA optimizer: two ordinary steps (unscale on the device) and one
    with an inf (found_inf: the prepare and table kernels skip)."""
    factory = optimizer_class(class_name)
    values = values_for(SHAPES, dtype)
    cpu = [nn.Parameter(v.clone()) for v in values]
    cuda = [nn.Parameter(v.to(DEVICE, copy=True)) for v in values]
    cpu_opt = factory(cpu, **kwargs)
    cuda_opt = factory(cuda, **on_device(kwargs))
    scaler = torch.amp.GradScaler(torch.device(DEVICE).type, init_scale=1024.0)
    scaler.scale(torch.ones((), device=DEVICE))
    for t, poison in ((0, False), (1, True), (2, False)):
        scale = scaler.get_scale()  # halved after the step with the inf
        for i, (p, q, g) in enumerate(zip(cpu, cuda, grads_for(SHAPES, t))):
            cast = g.to(dtype)
            q.grad = (cast * scale).to(DEVICE)
            if poison and i == 3:
                q.grad[5] = float("inf")
            if not poison:
                p.grad = cast.clone()
        scaler.step(cuda_opt)
        scaler.update()
        if not poison:
            cpu_opt.step()
    synchronize()
    check_same(cpu, cuda)


def release_case(class_name, kwargs, dtype):
    """release_grads=True: one native step per param, inside backward."""
    factory = optimizer_class(class_name)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 33), nn.Tanh(), nn.Linear(33, 7)).to(DEVICE, dtype)
    opt = factory(model.parameters(), release_grads=True, **on_device(kwargs))
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(8, 40, generator=gen).to(DEVICE, dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()
    synchronize()


def lora_case(dtype_small, dtype_large):
    """Many small params packed into shared pages next to a large one, two variants per step."""
    shapes = [(16, 128), (128, 16)] * 14 + [(300, 701)]
    factory = optimizer_class("AdamW")
    values = values_for(shapes[:-1], dtype_small) + values_for(shapes[-1:], dtype_large, 1)
    cpu = [nn.Parameter(v.clone()) for v in values]
    cuda = [nn.Parameter(v.to(DEVICE, copy=True)) for v in values]
    kwargs = dict(lr=1e-3, page_bytes=64 << 10)
    cpu_opt, cuda_opt = factory(cpu, **kwargs), factory(cuda, **on_device(kwargs))
    for t in range(2):
        for p, q, g in zip(cpu, cuda, grads_for(shapes, t)):
            cast = g.to(p.dtype)
            p.grad = cast.clone()
            q.grad = cast.to(DEVICE)
        cpu_opt.step()
        cuda_opt.step()
    synchronize()
    check_same(cpu, cuda)


def state_dict_case():
    """state_dict out of and load_state_dict into device pages, then a step."""
    _, cuda_opt, _, cuda = lockstep_case("AdamW", dict(lr=1e-2, page_bytes=PAGE_BYTES),
                                         torch.bfloat16, SHAPES)
    saved = copy.deepcopy(cuda_opt.state_dict())  # as a checkpoint: not the live tensors
    copies = [nn.Parameter(p.detach().clone()) for p in cuda]
    resumed = optimizer_class("AdamW")(copies, **on_device(dict(lr=1e-2, page_bytes=PAGE_BYTES)))
    resumed.load_state_dict(saved)
    for p, g in zip(copies, grads_for(SHAPES, 9)):
        p.grad = g.to(p.dtype).to(DEVICE)
    resumed.step()
    synchronize()


# SkewAdam's tiers (factored backbone matrices with momentum, [E, rows, cols] experts with
# factors only, an exact router, exact 1-D params), rows off the 16-lane split.
SKEW_TIERS = [("backbone", [(40, 24), (33,)]), ("experts", [(3, 9, 37)]), ("router", [(8, 40)])]


def skewadam_case(dtype, state_bits, master_bits):
    """SkewAdam's statistics kernels and its elementwise tables, against the CPU."""
    def tiers(params):
        out, start = [], 0
        for tier, tier_shapes in SKEW_TIERS:
            out.append({"params": params[start:start + len(tier_shapes)], "tier": tier})
            start += len(tier_shapes)
        return out

    kwargs = dict(lr=1e-2, weight_decay=0.1, state_bits=state_bits, master_bits=master_bits,
                  page_bytes=PAGE_BYTES)
    shapes = [shape for _, tier in SKEW_TIERS for shape in tier]
    lockstep_case("SkewAdam", kwargs, dtype, shapes, groups=tiers)


PAGING_KEYS = ("offload", "cache_bytes", "nvme_dir", "prefetch", "policy")


def offload_case(offload: str):
    """State paged through a device cache of three pages to pinned host memory or the page
    file: the copy engine moves pages while the tables run, over three steps."""
    nvme = {}
    if offload == "nvme":
        nvme = dict(nvme_dir=tempfile.mkdtemp(prefix="pagedoptim-sanitize-"))
    kwargs = dict(lr=1e-2, weight_decay=0.1, page_bytes=PAGE_BYTES, offload=offload,
                  cache_bytes=3 * PAGE_BYTES, prefetch=2, **nvme)
    lockstep_case("AdamW", kwargs, torch.bfloat16, SHAPES, steps=3)


def cases(quick: bool) -> list[tuple[str, Callable[[], None]]]:
    out: list[tuple[str, Callable[[], None]]] = []
    formats = QUICK_FORMATS if quick else FORMATS
    for name, (class_name, defaults) in ALGORITHMS.items():
        for dtype, bits_, master in formats:
            kwargs = dict(defaults, state_bits=bits_, master_bits=master, page_bytes=PAGE_BYTES)
            label = f"{name}-{str(dtype)[6:]}-state{bits_}-master{master}"
            out.append((label, lambda c=class_name, k=kwargs, d=dtype:
                        lockstep_case(c, k, d, SHAPES)))
    for name in ("adamw", "sgd-nesterov", "lion"):
        class_name, defaults = ALGORITHMS[name]
        out.append((f"amp-{name}", lambda c=class_name, k=defaults:
                    amp_case(c, dict(k, page_bytes=PAGE_BYTES), torch.bfloat16)))
        out.append((f"release-{name}", lambda c=class_name, k=defaults:
                    release_case(c, k, torch.bfloat16)))
    out.append(("lora-fp32-bf16", lambda: lora_case(torch.float32, torch.bfloat16)))
    out.append(("state-dict", state_dict_case))
    for dtype, bits_, master in formats:
        out.append((f"skewadam-{str(dtype)[6:]}-state{bits_}-master{master}",
                    lambda d=dtype, b=bits_, m=master: skewadam_case(d, b, m)))
    for offload in ("host", "nvme"):
        out.append((f"offload-{offload}", lambda o=offload: offload_case(o)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one format per algorithm")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--simulated", action="store_true",
                        help="run the cases on the simulated device (no GPU needed)")
    args = parser.parse_args()
    selected = cases(args.quick)
    if args.list:
        for label, _ in selected:
            print(label)
        return 0
    if args.simulated:
        global DEVICE, ON_DEVICE
        from pagedoptim import paging

        DEVICE, ON_DEVICE = "cpu", paging.resident_on_simulated_device()
        with paging.simulated_device():
            return run_cases(selected)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}), flush=True)
        return 0
    from pagedoptim._native import native

    if not native.cuda_built():
        print(json.dumps({"skipped": "pagedoptim was built without its CUDA kernels"}),
              flush=True)
        return 0
    return run_cases(selected)


def run_cases(selected: list[tuple[str, Callable[[], None]]]) -> int:
    failed = []
    started = time.perf_counter()
    for label, run in selected:
        begin = time.perf_counter()
        try:
            run()
            result = {"case": label, "ok": True}
        except Exception as error:  # report every failing case, not just the first
            failed.append(label)
            result = {"case": label, "ok": False, "error": f"{type(error).__name__}: {error}"}
            traceback.print_exc(file=sys.stderr)
        result["seconds"] = round(time.perf_counter() - begin, 3)
        print(json.dumps(result), flush=True)
    print(json.dumps({"cases": len(selected), "failed": failed,
                      "seconds": round(time.perf_counter() - started, 1)}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
