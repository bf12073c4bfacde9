"""Small optimizers in each state format, and exact snapshots of them, for the tests of bad
state_dicts (tests/python/test_bad_state_dicts.py) and the load_state_dict fuzzer.

Every mode has two parameter groups so that group mismatches can be built, and steps twice
with seeded gradients so that its state is not all zeros.
"""

from __future__ import annotations

import tempfile
from typing import Any, Callable

import torch

import pagedoptim as po

_NVME_DIR = tempfile.gettempdir()


def _params(dtype: torch.dtype, seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    # [2, 35]: rows of a full group of 32 and a partial one; [3, 64]: two full groups a row.
    # Both keep 8-bit moments in the 8-bit modes (min_8bit_size=0 below).
    return [torch.nn.Parameter(torch.randn(2, 35, generator=gen).to(dtype)),
            torch.nn.Parameter(torch.randn(3, 64, generator=gen).to(dtype))]


def _groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    return [{"params": [params[0]]}, {"params": [params[1]], "lr": 5e-3}]


def _skewadam(params: list[torch.nn.Parameter], **kw: Any) -> po.SkewAdam:
    return po.SkewAdam([{"params": [("bias", params[0])]},
                        {"params": [("weight", params[1])], "lr": 5e-3}], lr=1e-2, **_SMALL,
                       **kw)


# These params are small: every one keeps 8-bit moments in the 8-bit modes.
_SMALL = dict(min_8bit_size=0)

# name -> (param dtype, optimizer factory)
MODES: dict[str, tuple[torch.dtype, Callable[..., torch.optim.Optimizer]]] = {
    "adamw_exact": (torch.float32, lambda ps: po.AdamW(_groups(ps), lr=1e-2, state_bits=32,
                                                       master_bits=None)),
    "adamw_8bit": (torch.float32, lambda ps: po.AdamW(_groups(ps), lr=1e-2, **_SMALL)),
    "adamw_bf16_residual": (torch.bfloat16, lambda ps: po.AdamW(_groups(ps), lr=1e-2,
                                                                master_bits=24, **_SMALL)),
    "adamw_amsgrad_16bit_residual": (torch.bfloat16, lambda ps: po.AdamW(
        _groups(ps), lr=1e-2, amsgrad=True, master_bits=32, **_SMALL)),
    "sgd_momentum": (torch.float32, lambda ps: po.SGD(_groups(ps), lr=1e-2, momentum=0.9,
                                                      **_SMALL)),
    "lion_8bit": (torch.float32, lambda ps: po.Lion(_groups(ps), lr=1e-3, **_SMALL)),
    "skewadam": (torch.float32, lambda ps: _skewadam(ps)),
    "adamw_nvme": (torch.float32, lambda ps: po.AdamW(
        _groups(ps), lr=1e-2, offload="nvme", nvme_dir=_NVME_DIR, page_bytes=4096,
        cache_bytes=4096, **_SMALL)),
}


def make(mode: str, seed: int = 0, steps: int = 2) -> torch.optim.Optimizer:
    """The optimizer of `mode` over fresh params, stepped `steps` times."""
    dtype, factory = MODES[mode]
    params = _params(dtype, seed)
    opt = factory(params)
    step(opt, seed, steps)
    return opt


def step(opt: torch.optim.Optimizer, seed: int, steps: int = 1) -> None:
    gen = torch.Generator().manual_seed(1000 + seed)
    for _ in range(steps):
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def params_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def snapshot(opt: torch.optim.Optimizer) -> Any:
    """Everything observable of `opt`'s state, exactly: its state_dict (tensors by dtype,
    shape and bytes, so NaN compares equal to itself), and its params' values."""
    return _exact({"state_dict": opt.state_dict(),
                   "params": [p.detach() for p in params_of(opt)]})


def _exact(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        # Read without densifying or copying what may be hostile (a sparse tensor with
        # indices outside its size), and without data where there is none (meta).
        if value.is_meta:
            return ("meta", str(value.dtype), tuple(value.shape))
        if value.layout == torch.sparse_coo:
            return ("sparse", tuple(value.shape), _exact(value._indices()),
                    _exact(value._values()))
        if value.layout != torch.strided:
            return ("layout", str(value.layout), tuple(value.shape))
        if value.is_quantized:
            return ("quantized", str(value.dtype), _exact(value.int_repr()))
        dense = value.detach().cpu().contiguous()
        return ("tensor", str(dense.dtype), tuple(dense.shape),
                dense.reshape(-1).view(torch.uint8).numpy().tobytes())
    if isinstance(value, dict):
        return {"dict": sorted(((repr(k), _exact(v)) for k, v in value.items()))}
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_exact(v) for v in value]]
    if isinstance(value, float):
        return ("float", repr(value))
    return value
