"""The optimizer step under torch.compile: one registered custom op, opaque to Dynamo.

The native engine is a Python object that Dynamo cannot trace (a pybind11 class), and the
eager step's bookkeeping (engine creation, slot registration, hyperparameter validation)
would graph-break and recompile once per parameter. Under torch.compile the step therefore
becomes one call of `pagedoptim::step_params_`, whose arguments are only what a graph can
carry:

- optimizer_id: an int naming the optimizer in a registry (a custom op cannot take the
  optimizer or its engine);
- params, grads, steps: the params with a gradient, their gradients and their step
  counters (`state[p]['step']`), as Tensor lists; params and steps are declared mutated, so
  the compiler orders every read of them after the op;
- positions: each param's index among the optimizer's params, to find its state;
- found_inf, grad_scale: GradScaler's tensors where the step takes them (CUDA state).
  GradScaler sets them on the optimizer just before step(); inside a compiled region that
  assignment is replayed only after the graph, so the op must be handed them.

The hyperparameters are not arguments: the op reads them from `param_groups` when it runs,
exactly as the eager step does. Dynamo never sees `group['lr']`, so an LR scheduler that
changes it every step causes no recompile (a float read by traced code is guarded as a
constant, and each new value would recompile).

What Dynamo traces is `step_under_compile`: a loop over the param groups reached through a
plan object (not through `optimizer.param_groups`: reading that attribute of an optimizer
makes Dynamo guard on every value of every group, lr included). The plan is made by
`_prepare`, which Dynamo runs eagerly while it traces (`assume_constant_result`), so the
step counters a first step creates exist before the graph is built and the second call
finds its guards still true. The engine itself is created when the op first runs, by the
eager code.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from typing import Any, Optional

import torch

from pagedoptim.state import sharding as sharded_params

OP_NAME = "pagedoptim::step_params_"

_next_id = itertools.count(1)
_optimizers: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_ids: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


class _CompiledPlan:
    """What the traced step reads from an optimizer: its live param_groups list and the step
    counters of its params, by position (None until the param first has a gradient).

    The traced code iterates this plan's `param_groups`, the optimizer's own list, so Dynamo
    guards the list's length and each group's params (add_param_group retraces) but not the
    other values of the groups."""

    def __init__(self, optimizer: Any) -> None:
        self.param_groups = optimizer.param_groups
        self.steps: list[Optional[torch.Tensor]] = [None] * len(optimizer.state_store.params())
        # Whether the step takes GradScaler's tensors: set by _prepare, because the traced
        # code must not look at the engine (the first run of the op creates it).
        self.amp_scaling = False

    def describes(self, optimizer: Any) -> bool:
        return (self.param_groups is optimizer.param_groups
                and len(self.steps) == len(optimizer.state_store.params()))


def forget_plan(optimizer: Any) -> None:
    """The step counters were replaced (a load, a param's state reset or its 'step'
    assigned): the next call must trace again, with the new ones."""
    optimizer._compiled_plan = None


def _registered_id(optimizer: Any) -> int:
    optimizer_id = _ids.get(optimizer)
    if optimizer_id is None:
        optimizer_id = next(_next_id)
        _ids[optimizer] = optimizer_id
        _optimizers[optimizer_id] = optimizer
        optimizer.register_load_state_dict_post_hook(forget_plan)
    return optimizer_id


def _assume_constant_result(fn: Any) -> Any:
    """torch.compiler.assume_constant_result without importing torch._dynamo, which costs
    `import pagedoptim` (and, under PAGEDOPTIM=1, every script importing torch) about 1.5 s.
    The decorator only marks the function; Dynamo reads the mark when it traces, by which
    time torch.compile has imported it. Once Dynamo is loaded the public decorator is used;
    tests/python/test_compile.py checks that it still sets nothing but this mark."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _prepare(optimizer: Any) -> int:
    """Runs eagerly while Dynamo traces the step (and on every retrace): registers the
    optimizer, refreshes its plan and creates the step counters of the params that have a
    gradient, as the eager step would. Returns the optimizer's registry id."""
    optimizer_id = _registered_id(optimizer)
    plan = getattr(optimizer, "_compiled_plan", None)
    if plan is None or not plan.describes(optimizer):
        plan = _CompiledPlan(optimizer)
        optimizer._compiled_plan = plan
    plan.amp_scaling = bool(optimizer._step_supports_amp_scaling)
    for position, p in enumerate(optimizer.state_store.params()):
        if sharded_params.is_dtensor(p):
            raise RuntimeError(f"torch.compile of {type(optimizer).__name__}.step() with "
                               f"DTensor params (param {position}) is not supported: the "
                               "step's custom op takes plain tensors. Call step() outside the "
                               "compiled region (FSDP2 steps the local shards eagerly)")
        if p.grad is not None:
            plan.steps[position] = optimizer._step_counter(p)
    return optimizer_id


def step_under_compile(optimizer: Any) -> None:
    """The step as Dynamo traces it: gather the tensors, make one custom-op call."""
    optimizer_id = _prepare(optimizer)
    plan = optimizer._compiled_plan
    params, grads, steps, positions = [], [], [], []
    position = 0
    for group in plan.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                params.append(p)
                grads.append(p.grad)
                steps.append(plan.steps[position])
                positions.append(position)
            position += 1
    found_inf = grad_scale = None
    if plan.amp_scaling:
        found_inf = _as_optional_tensor(getattr(optimizer, "found_inf", None))
        grad_scale = _as_optional_tensor(getattr(optimizer, "grad_scale", None))
    if params:
        step_params_(optimizer_id, params, grads, steps, positions, found_inf, grad_scale)


def _as_optional_tensor(value: Any) -> Optional[torch.Tensor]:
    if value is None or isinstance(value, torch.Tensor):
        return value
    return torch.tensor(float(value))


# cudagraph_unsafe: CUDA graphs (torch.compile's mode="reduce-overhead") must leave the op out;
# a replay would reuse the host buffers and pages of the captured step (optimizer.py,
# _refuse_cuda_graph_capture).
# (custom_op takes tags only from torch 2.8 on; older torch has no such tag either.)
_TAGS = {"tags": (torch.Tag.cudagraph_unsafe,)} if hasattr(torch.Tag, "cudagraph_unsafe") else {}


@torch.library.custom_op(OP_NAME, mutates_args=("params", "steps"), **_TAGS)
def step_params_(optimizer_id: int, params: list[torch.Tensor], grads: list[torch.Tensor],
                 steps: list[torch.Tensor], positions: list[int],
                 found_inf: Optional[torch.Tensor] = None,
                 grad_scale: Optional[torch.Tensor] = None) -> None:
    """One optimizer step of the registered optimizer `optimizer_id` over `params`.

    The tensors may be the optimizer's own or, where the compiler does not update in
    place, functional copies of them: the step updates the tensors it is given, and finds
    each one's state through its position among the optimizer's params."""
    optimizer = _optimizers.get(optimizer_id)
    if optimizer is None:
        raise RuntimeError(f"{OP_NAME}: no live pagedoptim optimizer has id {optimizer_id} "
                           "(the op is called by a compiled optimizer.step())")
    counts = {len(params), len(grads), len(steps), len(positions)}
    if len(counts) != 1:
        raise ValueError(f"{OP_NAME}: params, grads, steps and positions must have one entry "
                         f"per param, got {len(params)}, {len(grads)}, {len(steps)} and "
                         f"{len(positions)}")
    owners = optimizer.state_store.params()
    for param, position in zip(params, positions):
        _check_stands_for(param, position, owners)
    group_ids = [group_id for group_id, group in enumerate(optimizer.param_groups)
                 for _ in group["params"]]
    # The eager step over the op's tensors: it reads the hyperparameters now, as
    # optimizer.step() reads them.
    amp = (optimizer._amp_arguments({"found_inf": found_inf, "grad_scale": grad_scale})
           if optimizer._step_supports_amp_scaling else {})
    optimizer._step_params([(owners[position], group_ids[position], grad,
                             {"target": param, "step": step})
                            for param, grad, step, position
                            in zip(params, grads, steps, positions)], amp)


def _check_stands_for(param: torch.Tensor, position: int, owners: list[torch.Tensor]) -> None:
    """The op's tensor for `position` must be that param or a copy of it: the engine writes
    as many elements as the param's state has."""
    if not 0 <= position < len(owners):
        raise IndexError(f"{OP_NAME}: position {position} is out of range for an optimizer "
                         f"of {len(owners)} params")
    owner = owners[position]
    if (param.shape, param.dtype, param.device) != (owner.shape, owner.dtype, owner.device):
        raise ValueError(f"{OP_NAME}: the tensor for param {position} has shape "
                         f"{tuple(param.shape)}, {param.dtype} on {param.device}; the param has "
                         f"shape {tuple(owner.shape)}, {owner.dtype} on {owner.device}")


@step_params_.register_fake
def _step_params_fake(optimizer_id: int, params: list[torch.Tensor],
                      grads: list[torch.Tensor], steps: list[torch.Tensor],
                      positions: list[int], found_inf: Optional[torch.Tensor] = None,
                      grad_scale: Optional[torch.Tensor] = None) -> None:
    """Writes only its mutated arguments in place, so there is nothing to describe."""
    return None
