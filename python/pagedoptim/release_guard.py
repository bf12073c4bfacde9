"""Gradient release must never silently change training.

With `release_grads=True` each parameter is stepped inside backward and its gradient freed,
so two things that read gradients after backward would silently go wrong:

- **clipping**: `clip_grad_norm_` / `clip_grad_value_` would find no gradients, clip
  nothing and report a norm of 0.0. Exact global-norm clipping needs every gradient before
  the first parameter steps, which is what release gives up. So while an optimizer with
  release_grads is alive, torch.nn.utils' clipping functions raise when given its params and
  a finite limit. A call with max_norm=inf (HF Trainer's way of only measuring the norm)
  changes nothing and goes through, with a warning that the norm reads 0.0.
- **data parallelism**: under DDP (or any multi-rank run) the hook fires before the
  gradients are all-reduced, so each rank would step with its own gradient and the ranks
  would drift apart. The first released step in a multi-rank process raises.

The clipping functions are wrapped once, when the first such optimizer is created; the
wrapper only adds the check and calls torch's function unchanged. Code that imported the
function by name before that (`from torch.nn.utils import clip_grad_norm_`) keeps torch's,
unchecked: docs/drop_in.md says so.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from typing import Any, Callable

import torch

_watched: "weakref.WeakSet[Any]" = weakref.WeakSet()
_warned_about_norm: "weakref.WeakSet[Any]" = weakref.WeakSet()  # once per optimizer


def watch(optimizer: Any) -> None:
    """Guards the clipping functions against `optimizer`'s params (release_grads=True)."""
    _watched.add(optimizer)
    _install()


def check_not_data_parallel() -> None:
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized() \
            and distributed.get_world_size() > 1:
        raise RuntimeError(
            "release_grads=True cannot be used with data parallelism (DDP, or any run with "
            f"world_size={distributed.get_world_size()}): the step runs inside backward, "
            "before the gradients are all-reduced, so every rank would step with its own "
            "gradient and the ranks would drift apart. Use release_grads=False")


def _optimizers_of(parameters: list[torch.Tensor]) -> list[Any]:
    given = {id(p) for p in parameters}
    return [optimizer for optimizer in list(_watched)
            if any(id(p) in given for group in optimizer.param_groups for p in group["params"])]


def _check_clip(name: str, parameters: list[torch.Tensor], limit: float) -> None:
    optimizers = _optimizers_of(parameters)
    if not optimizers:
        return
    if math.isinf(limit):
        if any(optimizer not in _warned_about_norm for optimizer in optimizers):
            _warned_about_norm.update(optimizers)
            warnings.warn(f"torch.nn.utils.{name} measured the gradient norm of parameters "
                          "whose optimizer has release_grads=True: their gradients are "
                          "freed inside backward, so the norm reads 0.0", RuntimeWarning,
                          stacklevel=4)
        return
    raise RuntimeError(
        f"torch.nn.utils.{name} was called on parameters of a pagedoptim optimizer with "
        "release_grads=True: their gradients were applied and freed inside backward, so "
        "clipping would find none, clip nothing and report 0.0. Turn clipping off (HF "
        "Trainer: max_grad_norm=0) or use release_grads=False")


def _guard(original: Callable[..., Any], limit_argument: str, position: int) -> Callable[..., Any]:
    @functools.wraps(original)
    def guarded(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if _watched:
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else \
                list(parameters)
            limit = kwargs.get(limit_argument, args[position] if len(args) > position else None)
            if limit is not None:
                _check_clip(original.__name__, parameters, float(limit))
        return original(parameters, *args, **kwargs)

    guarded.__wrapped_by_pagedoptim__ = original  # type: ignore[attr-defined]
    return guarded


def _install() -> None:
    utils = torch.nn.utils
    for name, limit_argument in (("clip_grad_norm_", "max_norm"),
                                 ("clip_grad_value_", "clip_value")):
        current = getattr(utils, name)
        if hasattr(current, "__wrapped_by_pagedoptim__"):
            continue
        guarded = _guard(current, limit_argument, 0)
        setattr(utils, name, guarded)
        setattr(utils.clip_grad, name, guarded)
