"""Gradient release must never silently change training.

With `release_grads=True` each gradient goes into a gradient stream as backward produces it
and p.grad is freed (optim/gradient_release.py), so what reads p.grad between backward and
step() would find nothing. This module puts released gradients where those readers look:

- **clip_grad_norm_** (torch.nn.utils' and accelerate's `Accelerator.clip_grad_norm_`, which
  HF Trainer calls): given released params, the call computes the total norm from the norms
  taken at release, exactly as torch would from the gradients (engine/release_clipping.py),
  returns it, and hands the clip coefficient to the optimizer, which multiplies it into each
  gradient as step() takes it from its stream. Plain gradients in the same call are clipped
  in place as torch does. accelerate has to be routed on its own: it drops every parameter
  whose gradient is None before it reaches torch.
- **clip_grad_value_** is not routed: given a release optimizer's params and a finite limit
  it raises (an infinite limit changes nothing and goes through).
- **zero_grad of a module** (`model.zero_grad()`, what HF Trainer calls) empties, or with
  set_to_none=False zeroes, the gradient streams of the module's released params, as it
  does their p.grad.
- **data parallelism**: under DDP the post-accumulate-grad hook fires before the all-reduce,
  so the gradients must be taken after it instead (`optimizer.register_ddp(model)`,
  optim/release_ddp.py); a multi-rank backward that releases a gradient DDP has not reduced
  raises before anything is released.
- **GradScaler**: its gradients are scaled until it unscales them, and it looks for infs in
  p.grad. `GradScaler.scale` is wrapped so that the losses it scales mark the backward they
  start with the scaler (the mark lasts until that backward ends, so the inner backward
  calls of reentrant activation checkpoints carry it too): a release in such a backward
  also takes the norm of the unscaled sum and notes any inf or NaN in it
  (optim/gradient_release.py). `GradScaler._unscale_grads_`, which both `unscale_` and
  `step` use to look for infs, is wrapped to add the released gradients' found_inf to what
  it found in p.grad, and, for `unscale_`, to have the optimizer unscale them when it steps.

The functions are wrapped once, when the first such optimizer is created (and, for
accelerate, at the first release if accelerate was imported after that); the wrapper calls
the original function unchanged unless it was given released params. Code that imported
clip_grad_norm_ by name before that (`from torch.nn.utils import clip_grad_norm_`) keeps
torch's, which would leave the released gradients out of its norm; torch's function looks
up its `_clip_grads_with_norm_` at call time, and that is wrapped to raise when it meets
released params, before anything is clipped.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import sys
import weakref
from typing import Any, Callable, Optional

import torch

from pagedoptim.engine import release_clipping, release_hooks

_watched: "weakref.WeakSet[Any]" = weakref.WeakSet()
# The backward calls running now that started from a loss GradScaler scaled: a token each,
# added by a hook on the scaled loss (the first thing its backward runs) and removed by a
# callback at the end of that backward. Not per graph task: a reentrant activation
# checkpoint computes its params' gradients in an inner backward of its own.
_scaled_backwards: dict[int, Any] = {}  # token -> the GradScaler that scaled its loss
_tokens = itertools.count()


def watch(optimizer: Any) -> None:
    """Guards the clipping functions against `optimizer`'s params (release_grads=True)."""
    _watched.add(optimizer)
    install()


def check_not_data_parallel() -> None:
    """Raises in a multi-rank process: a gradient DDP has not reduced is being released."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized() \
            and distributed.get_world_size() > 1:
        raise RuntimeError(
            "release_grads=True under data parallelism (world_size="
            f"{distributed.get_world_size()}) must take the gradients after DDP's all-reduce: "
            "call optimizer.register_ddp(ddp_model) once after wrapping the model in "
            "DistributedDataParallel. Here a gradient was released before any all-reduce, so "
            "every rank would step with its own gradient. Nothing was released")


def _optimizers_of(parameters: list[torch.Tensor]) -> list[Any]:
    given = {id(p) for p in parameters}
    return [optimizer for optimizer in list(_watched)
            if any(id(p) in given for group in optimizer.param_groups for p in group["params"])]


def _check_clip(name: str, parameters: list[torch.Tensor], limit: float) -> None:
    """clip_grad_value_ of a release optimizer's params: an infinite limit changes nothing."""
    if math.isinf(limit) or not _optimizers_of(parameters):
        return
    raise RuntimeError(
        f"{name} was called on parameters of a pagedoptim optimizer with "
        "release_grads=True: their gradients are in gradient streams, not p.grad, and only "
        "clip_grad_norm_ (or the optimizer's max_grad_norm=) clips them. Use "
        "clip_grad_norm_, or release_grads=False")


def _release_of(p: torch.Tensor) -> Any:
    """The GradientRelease of the optimizer that releases p's gradient, or None."""
    owner = release_hooks.owner_of(p)
    return getattr(owner, "_release", None) if owner in _watched else None


def _released(parameters: list[torch.Tensor]) -> bool:
    """Whether any of `parameters` has a released gradient, once the gradients no hook
    released (a param unfrozen since, a gradient set by hand) are released too: what reads
    the released gradients must see those in their streams, not in p.grad."""
    releases = {id(r): r for r in map(_release_of, parameters) if r is not None}
    for release in releases.values():
        release.release_late_gradients()
    return any(r.released_norm(p) is not None
               for p, r in zip(parameters, map(_release_of, parameters)) if r is not None)


def _total_norm(parameters: list[torch.Tensor], error_if_nonfinite: bool) -> torch.Tensor:
    """clip_grad_norm_'s total norm of the gradients of `parameters`, released or not (a
    param given twice counts twice, as in torch)."""
    norms, likes = [], []
    for p in parameters:
        release = _release_of(p)
        released = release.released_norm(p) if release is not None else None
        if released is not None:
            norms.append(released[0])
            likes.append(released[1])
        elif p.grad is not None:
            norms.append(release_clipping.norm_of(p.grad))
            likes.append(p.grad)
    return release_clipping.total_norm(norms, likes, error_if_nonfinite)


def _clip(parameters: list[torch.Tensor], max_norm: Optional[float],
          total: torch.Tensor) -> None:
    """Clips plain gradients now and hands released ones their coefficient (applied when
    step() takes them); a param given n times is multiplied n times, as torch does.
    max_norm None: only notes the norm."""
    coefficient = None if max_norm is None else \
        release_clipping.clip_coefficient(max_norm, total)
    for p, times in collections.Counter(parameters).items():
        release = _release_of(p)
        if release is not None and release.released_norm(p) is not None:
            release.clip(p, coefficient, total, times)
        elif p.grad is not None and coefficient is not None:
            for _ in range(times):
                release_clipping.apply(p.grad, coefficient)


def _route_clip_grad_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    """torch.nn.utils.clip_grad_norm_, computed from the released norms where it is given
    released params."""
    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: Optional[bool] = None
                        ) -> torch.Tensor:
        if _watched:
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else \
                list(parameters)  # a generator is consumed here: pass the list on
            if _released(parameters):
                release_clipping.check_norm_type(norm_type, "torch.nn.utils.clip_grad_norm_")
                total = _total_norm(parameters, error_if_nonfinite)
                _clip(parameters, float(max_norm), total)
                return total
        return original(parameters, max_norm, norm_type, error_if_nonfinite, foreach)

    clip_grad_norm_.__wrapped_by_pagedoptim__ = original  # type: ignore[attr-defined]
    return clip_grad_norm_


def _route_accelerate_clip_grad_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    """Accelerator.clip_grad_norm_ for a single-device or DDP model (the only ones release
    runs under): accelerate's own arithmetic (the norm of the one-element stack of torch's
    total norm; no clipping at max_norm=inf) over the released norms."""
    @functools.wraps(original)
    def clip_grad_norm_(self: Any, parameters: Any, max_norm: float, norm_type: float = 2,
                        **kwargs: Any) -> Any:
        if _watched and not kwargs:
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else \
                list(parameters)
            if _released(parameters):
                release_clipping.check_norm_type(norm_type, "Accelerator.clip_grad_norm_")
                self.unscale_gradients()
                total = torch.linalg.vector_norm(
                    torch.stack([_total_norm(parameters, False)]), norm_type)
                _clip(parameters, None if max_norm == float("inf") else float(max_norm),
                      total)
                return total
        return original(self, parameters, max_norm, norm_type, **kwargs)

    clip_grad_norm_.__wrapped_by_pagedoptim__ = original  # type: ignore[attr-defined]
    return clip_grad_norm_


def _guard(original: Callable[..., Any], name: str, limit_argument: str,
           is_method: bool) -> Callable[..., Any]:
    """`original` with the clip check in front. `is_method`: original is an unbound method
    (accelerate's), so the parameters come after `self`; the limit follows them."""
    at = 1 if is_method else 0  # where the parameters are in the positional arguments

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        by_keyword = len(args) <= at
        if _watched and (not by_keyword or "parameters" in kwargs):
            args = list(args)
            parameters = kwargs["parameters"] if by_keyword else args[at]
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else \
                list(parameters)  # a generator is consumed here: pass the list on
            if by_keyword:
                kwargs["parameters"] = parameters
            else:
                args[at] = parameters
            limit = kwargs.get(limit_argument, args[at + 1] if len(args) > at + 1 else None)
            if limit is not None:
                _check_clip(name, parameters, float(limit))
        return original(*args, **kwargs)

    guarded.__wrapped_by_pagedoptim__ = original  # type: ignore[attr-defined]
    return guarded


_CLIP_VALUE = ("clip_grad_value_", "clip_value")


def scaler_of_backward() -> Any:
    """The GradScaler whose scaled loss started the backward running now, or None."""
    return next(reversed(_scaled_backwards.values()), None)


def _marker(scaler: Any) -> Callable[[torch.Tensor], None]:
    def mark_scaled_backward(grad: torch.Tensor) -> None:
        """Hook on a scaled loss: runs first in the backward that starts from it."""
        token = next(_tokens)
        _scaled_backwards[token] = scaler
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: _scaled_backwards.pop(token, None))
    return mark_scaled_backward


def forget_scaled_backwards() -> None:
    """Between backward calls (step(), zero_grad()): drops the marks of backward calls that
    raised, whose end callbacks never ran."""
    _scaled_backwards.clear()


def _tensors_in(outputs: Any) -> list[torch.Tensor]:
    """The tensors of GradScaler.scale's result: a tensor, or lists and tuples of them. (An
    iterator it returns lazily is left alone: reading it here would empty it for the user.)"""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (list, tuple)):
        return [t for item in outputs for t in _tensors_in(item)]
    return []


def _guard_scale(original: Callable[..., Any]) -> Callable[..., Any]:
    """GradScaler.scale, marking the backward of each loss it scales with the scaler."""
    @functools.wraps(original)
    def scale(self: Any, outputs: Any) -> Any:
        scaled = original(self, outputs)
        if _watched and self.is_enabled():
            for tensor in _tensors_in(scaled):
                if tensor.requires_grad:
                    tensor.register_hook(_marker(self))
        return scaled

    scale.__wrapped_by_pagedoptim__ = original  # type: ignore[attr-defined]
    return scale


def _route_unscale_grads(original: Callable[..., Any]) -> Callable[..., Any]:
    """GradScaler._unscale_grads_ (what unscale_, with allow_fp16=False, and the inf check of
    step(), with allow_fp16=True and an inv_scale of 1, call per optimizer), with the found_inf
    of the optimizer's released gradients added to what it found in p.grad; unscale_'s
    inv_scale is handed to the optimizer, which multiplies it into each released gradient as
    unscale_ multiplies p.grad, when it steps."""
    @functools.wraps(original)
    def _unscale_grads_(self: Any, optimizer: Any, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool) -> dict:
        release = getattr(optimizer, "_release", None) if optimizer in _watched else None
        if release is not None:
            release.release_late_gradients()  # before GradScaler unscales them in p.grad
        found = original(self, optimizer, inv_scale, found_inf, allow_fp16)
        if release is None:
            return found
        released_inf = release.unscale(None if allow_fp16 else inv_scale)
        if released_inf is not None:
            device = released_inf.device
            found[device] = released_inf if device not in found else \
                torch.maximum(found[device], released_inf)
        return found

    _unscale_grads_.__wrapped_by_pagedoptim__ = original  # type: ignore[attr-defined]
    return _unscale_grads_


def _refuse_unrouted_clip(original: Callable[..., Any]) -> Callable[..., Any]:
    """torch's _clip_grads_with_norm_, which clip_grad_norm_ looks up at call time, and the
    public clip_grads_with_norm_: reached with released params only by a clip_grad_norm_
    bound by name before the routing was installed, or with a total norm the caller took of
    p.grad (get_total_norm), both of which left the released gradients out. Raises before
    anything is clipped, rather than clip nothing after a wrong norm."""
    @functools.wraps(original)
    def _clip_grads_with_norm_(parameters: Any, *args: Any, **kwargs: Any) -> None:
        if _watched:
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else \
                list(parameters)
            if _released(parameters):
                raise RuntimeError(
                    "gradients released by release_grads=True reached torch's clipping "
                    "without pagedoptim's routing: through a clip_grad_norm_ bound by name "
                    "before the optimizer was built (`from torch.nn.utils import "
                    "clip_grad_norm_`), or clip_grads_with_norm_ with a norm from "
                    "get_total_norm of p.grad; either norm leaves them out. Call "
                    "torch.nn.utils.clip_grad_norm_ after building the optimizer. Nothing "
                    "was clipped")
        return original(parameters, *args, **kwargs)

    _clip_grads_with_norm_.__wrapped_by_pagedoptim__ = original  # type: ignore[attr-defined]
    return _clip_grads_with_norm_


def _route_module_zero_grad(original: Callable[..., Any]) -> Callable[..., Any]:
    """torch.nn.Module.zero_grad (what HF Trainer calls), which also empties (or zeroes) the
    gradient streams of the module's released params, as it does their p.grad."""
    @functools.wraps(original)
    def zero_grad(self: Any, set_to_none: bool = True) -> None:
        original(self, set_to_none)
        if not _watched:
            return
        by_release: dict[int, tuple[Any, list[torch.Tensor]]] = {}
        for p in self.parameters():
            release = _release_of(p)
            if release is not None:
                by_release.setdefault(id(release), (release, []))[1].append(p)
        for release, params in by_release.values():
            release.zero(params, set_to_none)

    zero_grad.__wrapped_by_pagedoptim__ = original  # type: ignore[attr-defined]
    return zero_grad


def install() -> None:
    """Wraps GradScaler.scale and the clipping functions that are not wrapped yet: torch's
    always, accelerate's when accelerate is imported (importing it here would cost every
    user its start-up)."""
    scaler = torch.amp.GradScaler
    if not hasattr(scaler.scale, "__wrapped_by_pagedoptim__"):
        scaler.scale = _guard_scale(scaler.scale)
    if not hasattr(scaler._unscale_grads_, "__wrapped_by_pagedoptim__"):
        scaler._unscale_grads_ = _route_unscale_grads(scaler._unscale_grads_)
    module = torch.nn.Module
    if not hasattr(module.zero_grad, "__wrapped_by_pagedoptim__"):
        module.zero_grad = _route_module_zero_grad(module.zero_grad)
    utils = torch.nn.utils
    name, limit_argument = _CLIP_VALUE
    if not hasattr(getattr(utils, name), "__wrapped_by_pagedoptim__"):
        guarded = _guard(getattr(utils, name), f"torch.nn.utils.{name}", limit_argument,
                         is_method=False)
        setattr(utils, name, guarded)
        setattr(utils.clip_grad, name, guarded)
    if not hasattr(utils.clip_grad_norm_, "__wrapped_by_pagedoptim__"):
        routed = _route_clip_grad_norm(utils.clip_grad_norm_)
        utils.clip_grad_norm_ = routed
        utils.clip_grad.clip_grad_norm_ = routed
    # torch's function looks its inner one up at call time; the public one (torch 2.6+) is
    # the inner one wrapped in no_grad, bound at import.
    for owner, attribute in ((utils.clip_grad, "_clip_grads_with_norm_"),
                             (utils, "clip_grads_with_norm_")):
        inner = getattr(owner, attribute, None)
        if inner is not None and not hasattr(inner, "__wrapped_by_pagedoptim__"):
            setattr(owner, attribute, _refuse_unrouted_clip(inner))
    accelerate = sys.modules.get("accelerate")
    accelerator = getattr(accelerate, "Accelerator", None)
    if accelerator is None:
        return
    name, limit_argument = _CLIP_VALUE
    current = getattr(accelerator, name, None)
    if current is not None and not hasattr(current, "__wrapped_by_pagedoptim__"):
        setattr(accelerator, name, _guard(current, f"Accelerator.{name}", limit_argument,
                                          is_method=True))
    current = getattr(accelerator, "clip_grad_norm_", None)
    if current is not None and not hasattr(current, "__wrapped_by_pagedoptim__"):
        accelerator.clip_grad_norm_ = _route_accelerate_clip_grad_norm(current)
