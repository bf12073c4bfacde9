"""Gradient release must never silently change training.

With `release_grads=True` each parameter is stepped inside backward and its gradient freed,
so two things that read gradients after backward would silently go wrong:

- **clipping**: `clip_grad_norm_` / `clip_grad_value_` would find no gradients, clip
  nothing and report a norm of 0.0. Exact global-norm clipping needs every gradient before
  the first parameter steps, which is what release gives up. So while an optimizer with
  release_grads is alive, torch.nn.utils' clipping functions, and accelerate's
  `Accelerator.clip_grad_norm_` / `clip_grad_value_`, raise when given its params and a
  finite limit. A call with max_norm=inf (HF Trainer's way of only measuring the norm)
  changes nothing and goes through, with a warning that the norm reads 0.0.

  accelerate has to be guarded on its own: its clip_grad_norm_ (which HF Trainer calls)
  skips every parameter whose gradient is None before it reaches torch, so torch's
  functions never see the released params at all.
- **data parallelism**: under DDP (or any multi-rank run) the hook fires before the
  gradients are all-reduced, so each rank would step with its own gradient and the ranks
  would drift apart. The first released step in a multi-rank process raises.
- **GradScaler**: its gradients are scaled until `scaler.step` unscales them, which with
  release is after they were applied. `GradScaler.scale` is wrapped so that the losses it
  scales mark the backward they start, and the first release hook of such a backward
  raises, before any parameter changed (`step()` alone would see the scaler only after a
  whole step was taken with scaled gradients). The mark lasts until that backward ends, so
  the inner backward calls of reentrant activation checkpoints are refused too.

The clipping functions are wrapped once, when the first such optimizer is created (and,
for accelerate, at the first released step if accelerate was imported after that); the
wrapper only adds the check and calls the original function unchanged. Code that imported the
function by name before that (`from torch.nn.utils import clip_grad_norm_`) keeps torch's,
unchecked: docs/drop_in.md says so.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import warnings
import weakref
from typing import Any, Callable

import torch

_watched: "weakref.WeakSet[Any]" = weakref.WeakSet()
# The backward calls running now that started from a loss GradScaler scaled: a token each,
# added by a hook on the scaled loss (the first thing its backward runs) and removed by a
# callback at the end of that backward. Not per graph task: a reentrant activation
# checkpoint computes its params' gradients in an inner backward of its own.
_scaled_backwards: set[int] = set()
_tokens = itertools.count()
_warned_about_norm: "weakref.WeakSet[Any]" = weakref.WeakSet()  # once per optimizer


def watch(optimizer: Any) -> None:
    """Guards the clipping functions against `optimizer`'s params (release_grads=True)."""
    _watched.add(optimizer)
    install()


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
            warnings.warn(f"{name} measured the gradient norm of parameters "
                          "whose optimizer has release_grads=True: their gradients are "
                          "freed inside backward, so the norm reads 0.0", RuntimeWarning,
                          stacklevel=4)
        return
    raise RuntimeError(
        f"{name} was called on parameters of a pagedoptim optimizer with "
        "release_grads=True: their gradients were applied and freed inside backward, so "
        "clipping would find none, clip nothing and report 0.0. Turn clipping off (HF "
        "Trainer: max_grad_norm=0) or use release_grads=False")


def _guard(original: Callable[..., Any], name: str, limit_argument: str,
           is_method: bool) -> Callable[..., Any]:
    """`original` with the clip check in front. `is_method`: original is an unbound method
    (accelerate's), so the parameters come after `self`; the limit follows them."""
    at = 1 if is_method else 0  # where the parameters are in the positional arguments

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if _watched and len(args) > at:
            args = list(args)
            parameters = args[at]
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else \
                list(parameters)
            args[at] = parameters  # a generator is consumed here: pass the list on
            limit = kwargs.get(limit_argument, args[at + 1] if len(args) > at + 1 else None)
            if limit is not None:
                _check_clip(name, parameters, float(limit))
        return original(*args, **kwargs)

    guarded.__wrapped_by_pagedoptim__ = original  # type: ignore[attr-defined]
    return guarded


_CLIPPING = (("clip_grad_norm_", "max_norm"), ("clip_grad_value_", "clip_value"))


def check_backward_not_scaled() -> None:
    """Raises in a release hook of a backward that started from a loss GradScaler scaled."""
    if not _scaled_backwards:
        return
    # The backward ends with this error, so its end callback never runs.
    _scaled_backwards.clear()
    raise RuntimeError(
        "GradScaler cannot be used with release_grads=True: this backward started from a "
        "loss GradScaler scaled, so its gradients are scaled until scaler.step() unscales "
        "them, but release applies each one inside backward. Nothing was stepped. Use "
        "release_grads=False with GradScaler, or train in bf16, which needs no loss scaling")


def _mark_scaled_backward(grad: torch.Tensor) -> None:
    """Hook on a scaled loss: runs first in the backward that starts from it."""
    token = next(_tokens)
    _scaled_backwards.add(token)
    torch.autograd.Variable._execution_engine.queue_callback(
        lambda: _scaled_backwards.discard(token))


def _tensors_in(outputs: Any) -> list[torch.Tensor]:
    """The tensors of GradScaler.scale's result: a tensor, or lists and tuples of them. (An
    iterator it returns lazily is left alone: reading it here would empty it for the user.)"""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (list, tuple)):
        return [t for item in outputs for t in _tensors_in(item)]
    return []


def _guard_scale(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def scale(self: Any, outputs: Any) -> Any:
        scaled = original(self, outputs)
        if _watched and self.is_enabled():
            for tensor in _tensors_in(scaled):
                if tensor.requires_grad:
                    tensor.register_hook(_mark_scaled_backward)
        return scaled

    scale.__wrapped_by_pagedoptim__ = original  # type: ignore[attr-defined]
    return scale


def install() -> None:
    """Wraps GradScaler.scale and the clipping functions that are not wrapped yet: torch's
    always, accelerate's when accelerate is imported (importing it here would cost every
    user its start-up)."""
    scaler = torch.amp.GradScaler
    if not hasattr(scaler.scale, "__wrapped_by_pagedoptim__"):
        scaler.scale = _guard_scale(scaler.scale)
    utils = torch.nn.utils
    for name, limit_argument in _CLIPPING:
        current = getattr(utils, name)
        if hasattr(current, "__wrapped_by_pagedoptim__"):
            continue
        guarded = _guard(current, f"torch.nn.utils.{name}", limit_argument, is_method=False)
        setattr(utils, name, guarded)
        setattr(utils.clip_grad, name, guarded)
    accelerate = sys.modules.get("accelerate")
    accelerator = getattr(accelerate, "Accelerator", None)
    if accelerator is None:
        return
    for name, limit_argument in _CLIPPING:
        current = getattr(accelerator, name, None)
        if current is None or hasattr(current, "__wrapped_by_pagedoptim__"):
            continue
        setattr(accelerator, name, _guard(current, f"Accelerator.{name}", limit_argument,
                                          is_method=True))
