"""Global-norm clipping of released gradients, bit for bit as torch's clip_grad_norm_.

Released gradients are gone from `p.grad` before anyone could clip them, so their norms are
taken while they are released: each time a gradient is added to its stream (engine/
gradient_store.py), the norm of the sum so far is taken on the param's device, so after the
last micro-batch every param's norm is that of its whole accumulated gradient, and no second
pass over the gradients is needed. After backward, the total norm and the clip coefficient
are computed from those norms exactly as torch.nn.utils.clip_grad_norm_ computes them from the
gradients (torch/nn/utils/clip_grad.py, `_get_total_norm` and `_clip_grads_with_norm_`):

- each gradient's norm: `torch._foreach_norm` where torch's foreach path takes the gradient's
  device, else `torch.linalg.vector_norm` (one tensor at a time gives the bits a list gives:
  the CPU path is a loop over the tensors, the CUDA kernel reduces each tensor on its own);
- the total: `vector_norm` of the stacked norms, stacked in the order torch groups the
  gradients (by device and dtype, `_group_tensors_by_device_and_dtype`), so the sum of
  squares adds up in the same order;
- the coefficient: `clamp(max_norm / (total + 1e-6), max=1)`, multiplied into each gradient
  with `_foreach_mul_` (or `mul_`) when the step takes it from its stream.

So the step sees the gradients clip_grad_norm_ would have left, and the norm returned to the
caller (Trainer logs it as grad_norm) is the one it would have returned.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.utils._foreach_utils import (_group_tensors_by_device_and_dtype,
                                        _has_foreach_support)

NORM_TYPE = 2.0


def check_norm_type(norm_type: float, where: str) -> None:
    if float(norm_type) != NORM_TYPE:
        raise ValueError(
            f"{where}: norm_type={norm_type!r} cannot clip released gradients (release_grads="
            "True): their norms are taken as they are released, in the 2-norm, which is what "
            "clip_grad_norm_ uses by default. Use norm_type=2, or release_grads=False")


def norm_of(grad: torch.Tensor) -> torch.Tensor:
    """grad's 2-norm as clip_grad_norm_ takes it (a 0-dim tensor on grad's device, of its
    dtype)."""
    if _has_foreach_support([grad], grad.device):
        return torch._foreach_norm([grad], NORM_TYPE)[0]
    return torch.linalg.vector_norm(grad, NORM_TYPE)


def total_norm(norms: list[torch.Tensor], grad_like: list[torch.Tensor],
               error_if_nonfinite: bool = False) -> torch.Tensor:
    """The total norm of gradients whose norms are `norms`, as torch's _get_total_norm of
    those gradients (in that order) returns it. `grad_like[i]`: a tensor of gradient i's
    device and dtype (only those decide the order torch sums the norms in)."""
    if not norms:
        return torch.tensor(0.0)
    first_device = grad_like[0].device
    placeholders = [torch.empty(0, dtype=g.dtype, device=g.device) for g in grad_like]
    grouped = _group_tensors_by_device_and_dtype([placeholders], with_indices=True)
    ordered = [norms[index] for _, (_, indices) in grouped.items() for index in indices]
    total = torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in ordered]),
                                     NORM_TYPE)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        # torch's words (clip_grad.py), so that code catching them still does.
        raise RuntimeError(
            f"The total norm of order {NORM_TYPE} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return total


def clip_coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """What clip_grad_norm_ multiplies every gradient by (1 where none is clipped)."""
    return torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)


def apply(grad: torch.Tensor, coefficient: Optional[torch.Tensor]) -> None:
    """Multiplies `grad` by the clip coefficient in place, as _clip_grads_with_norm_ does."""
    if coefficient is None:
        return
    if _has_foreach_support([grad], grad.device):
        torch._foreach_mul_([grad], coefficient.to(grad.device))
    else:
        grad.mul_(coefficient.to(grad.device))


def check_max_norm(max_norm: object, name: str) -> Optional[float]:
    """max_grad_norm as the optimizer takes it: None (no clipping) or a number > 0."""
    if max_norm is None:
        return None
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) \
            or math.isnan(max_norm) or max_norm <= 0:
        raise ValueError(f"Invalid {name}: {max_norm!r} (expected None or a number > 0: the "
                         "max_norm clip_grad_norm_ would clip the gradients to)")
    return float(max_norm)
