"""The optimizer configurations the test files share, in the manner of torch's OptimizerInfo.

Each row is one of our optimizers with one set of hyperparameters, what torch defines for the
same algorithm (torch.optim's class, or our plain-torch Lion where torch has none), the
bit-exact oracle of our kernels (`pagedoptim.reference`), and which params it takes as they
come. A test picks rows with `configs(...)` rather than keeping a table of its own, so that
an algorithm (SkewAdam) or a branch added here is tested wherever it applies.

`CORE` names the rows that between them reach every branch of every algorithm's kernels
(AdamW with and without amsgrad, maximize and weight decay; SGD with momentum, dampening,
Nesterov and weight decay; Lion; SkewAdam's tiers): what a test over many formats or shapes
runs. Tests of torch's exact behaviour run every row that has a torch counterpart.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional

import torch

import pagedoptim as po
from pagedoptim import reference

from support import LionReference

ALGORITHM_OF = {po.AdamW: "adamw", po.SGD: "sgd", po.Lion: "lion", po.SkewAdam: "skewadam"}
# What `make` gives the optimizers (see there), and reference.init_state the oracle.
MIN_8BIT_SIZE = 0


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: str  # the test id: "<Class>-<what the hyperparameters exercise>"
    cls: type
    hyper: dict[str, Any]
    # torch's definition of the algorithm with these hyperparameters (None: none exists).
    torch_cls: Optional[type] = None
    # pagedoptim.reference's step for it (None: the algorithm has an oracle of its own).
    reference_step: Optional[Callable[..., Any]] = None

    @property
    def algorithm(self) -> str:
        return ALGORITHM_OF[self.cls]

    @property
    def class_name(self) -> str:
        return self.cls.__name__

    @property
    def in_torch_optim(self) -> bool:
        """Whether torch.optim itself has the algorithm (LionReference is ours)."""
        return self.torch_cls is not None and self.torch_cls.__module__.startswith("torch.optim")

    def groups(self, params: list[torch.Tensor]) -> list[dict[str, Any]]:
        """`params` as this optimizer takes them: SkewAdam puts a 3-D [experts, rows, cols]
        tensor in the experts tier (only that tier takes one); the others take any shape."""
        if self.cls is not po.SkewAdam:
            return [{"params": list(params)}]
        experts = [p for p in params if p.dim() == 3]
        rest = [p for p in params if p.dim() != 3]
        return [g for g in ({"params": rest}, {"params": experts, "tier": "experts"})
                if g["params"]]

    def make(self, params: Iterable[torch.Tensor], **settings: Any) -> po.PagedOptimizer:
        """Our optimizer over `params` (grouped as `groups` says), with these
        hyperparameters and the given state and paging settings. The tests' params are
        small: every param of two or more dimensions keeps 8-bit moments with state_bits=8
        (min_8bit_size=0, unless a test says otherwise); 1-D ones keep fp32 moments, as they
        do in any optimizer (state_format.keeps_8bit_state)."""
        settings = {"min_8bit_size": MIN_8BIT_SIZE, **settings}
        return self.cls(self.groups(list(params)), **{**self.hyper, **settings})

    def make_torch(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        assert self.torch_cls is not None, f"{self.name} has no torch counterpart"
        return self.torch_cls(list(params), **self.hyper)

    def moments(self) -> list[str]:
        """The moments this configuration keeps (by torch's names)."""
        if self.algorithm == "adamw":
            return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self.hyper.get("amsgrad")
                                                else [])
        if self.algorithm == "sgd":
            return ["momentum_buffer"] if self.hyper.get("momentum", 0.0) else []
        if self.algorithm == "lion":
            return ["exp_avg"]
        return ["exp_avg", "exp_avg_sq"]


def _adamw(label: str, **hyper: Any) -> OptimizerConfig:
    # Every row names lr (the oracles take no default), the classes' default where unsaid.
    return OptimizerConfig(f"AdamW-{label}", po.AdamW, {"lr": 1e-3, **hyper}, torch.optim.AdamW,
                           reference.adamw_step)


def _sgd(label: str, **hyper: Any) -> OptimizerConfig:
    return OptimizerConfig(f"SGD-{label}", po.SGD, {"lr": 1e-2, **hyper}, torch.optim.SGD,
                           reference.sgd_step)


def _lion(label: str, **hyper: Any) -> OptimizerConfig:
    return OptimizerConfig(f"Lion-{label}", po.Lion, {"lr": 1e-4, **hyper}, LionReference,
                           reference.lion_step)


def _skewadam(label: str, **hyper: Any) -> OptimizerConfig:
    # SkewAdam's oracle is pagedoptim.reference.skewadam.SkewAdamReference (test_skewadam.py).
    return OptimizerConfig(f"SkewAdam-{label}", po.SkewAdam, {"lr": 1e-2, **hyper})


CONFIGS: list[OptimizerConfig] = [
    _adamw("default"),
    _adamw("amsgrad", amsgrad=True),
    _adamw("maximize", maximize=True),
    _adamw("no_weight_decay", weight_decay=0.0),
    _adamw("amsgrad_maximize_wd", lr=1e-2, amsgrad=True, maximize=True, weight_decay=0.1),
    _adamw("betas_eps", lr=1e-2, betas=(0.8, 0.95), eps=1e-6),
    _sgd("plain"),
    _sgd("momentum", momentum=0.9),
    _sgd("dampening", momentum=0.9, dampening=0.1),
    _sgd("nesterov", momentum=0.9, nesterov=True),
    _sgd("weight_decay", momentum=0.9, weight_decay=1e-2),
    _sgd("weight_decay_no_momentum", weight_decay=1e-2),
    _sgd("maximize", momentum=0.9, maximize=True),
    _sgd("nesterov_wd_maximize", momentum=0.5, nesterov=True, weight_decay=0.1, maximize=True),
    _lion("default"),
    _lion("weight_decay", lr=3e-4, weight_decay=0.1),
    _lion("maximize", maximize=True),
    _lion("betas", lr=1e-3, betas=(0.95, 0.98)),
    _skewadam("default"),
    _skewadam("weight_decay", weight_decay=0.1),
]
BY_NAME = {config.name: config for config in CONFIGS}
assert len(BY_NAME) == len(CONFIGS), "configuration names must be unique"

CORE = ["AdamW-default", "AdamW-amsgrad_maximize_wd", "SGD-dampening",
        "SGD-nesterov_wd_maximize", "Lion-weight_decay", "SkewAdam-weight_decay"]


def configs(*names: str, core: bool = False, algorithms: Optional[Iterable[str]] = None,
            with_torch: bool = False, in_torch_optim: bool = False,
            with_reference: bool = False) -> list[OptimizerConfig]:
    """The rows named, or every row (only the CORE ones with core=True) of the given
    algorithms that has a torch counterpart (with_torch; in torch.optim itself:
    in_torch_optim) or a reference step (with_reference)."""
    if names:
        return [BY_NAME[name] for name in names]
    chosen = [BY_NAME[name] for name in CORE] if core else CONFIGS
    if algorithms is not None:
        wanted = set(algorithms)
        chosen = [c for c in chosen if c.algorithm in wanted]
    if with_torch:
        chosen = [c for c in chosen if c.torch_cls is not None]
    if in_torch_optim:
        chosen = [c for c in chosen if c.in_torch_optim]
    if with_reference:
        chosen = [c for c in chosen if c.reference_step is not None]
    return chosen


def parametrize(argname: str, rows: list[OptimizerConfig]) -> Any:
    """pytest.mark.parametrize over `rows`, each test id the row's name."""
    import pytest
    return pytest.mark.parametrize(argname, rows, ids=[row.name for row in rows])
