"""Gradient release: what an optimizer with `release_grads=True` does between backward and step.

Each gradient, as soon as autograd has produced it, is added to the param's gradient stream
(engine/gradient_store.py: paged like the state) and `p.grad` is freed; the norm of the sum
so far is taken on the way (engine/release_clipping.py). step() then steps each param from
its stream, in the order the gradients were released, with what the loop without release
would have done to p.grad in between applied in the same order (GradScaler's unscale_, the
clip coefficients of clip_grad_norm_ calls, routed here by engine/release_guard.py, and of
`max_grad_norm=`). So release keeps what the loop without it computes, bit for bit:

- accumulation: k backward calls add into the streams as they would into p.grad, and the
  step after the last one steps the sum; zero_grad() (the optimizer's or a module's, which
  release_guard routes) empties the streams as it empties p.grad, or, with
  set_to_none=False, zeroes them;
- clipping: the coefficient is clip_grad_norm_'s, from the same norms summed in the same
  order;
- GradScaler: a release in a backward that started from a scaled loss also takes the norm of
  the unscaled sum and notes infs; unscale_ and step() find them through the routed
  `_unscale_grads_`, and the step unscales each gradient as unscale_ (or, for device state,
  the kernel) would, or is skipped, as without release;
- DDP: optim/release_ddp.py, after the all-reduce;
- a backward that raised midway (out of memory) changed no param: the gradients it released
  wait in their streams, as they would in p.grad, until zero_grad() drops them.

One difference is left: step() ends the round, so gradients carried over a step without any
zero_grad() are not added to the next step's (torch adds the new gradients to the old,
clipped ones). What release cannot keep exact raises the first time it meets it:
clip_grad_value_, a second clip_grad_norm_ of the same gradients, another norm_type than 2,
a backward after the clip or after unscale_ (engine/release_guard.py and below).
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Callable, Optional

import torch

from pagedoptim.engine import release_clipping, release_guard, release_hooks
from pagedoptim.engine.gradient_store import GradientStore
from pagedoptim.engine.step_batch import refuse_cuda_graph_capture
from pagedoptim.paging.options import PagingOptions

# The gradients step() holds at once, read back from their streams: one native step call per
# batch of this many bytes. Bigger batches save per-call work; smaller ones keep device memory
# for gradients far below one full gradient buffer (a 7B model's bf16 gradients: 14 GB).
STEP_BATCH_BYTES = 64 << 20

StepFunction = Callable[[list[tuple[torch.Tensor, int, torch.Tensor]], dict[str, torch.Tensor]],
                        None]


class GradientRelease:
    """The released gradients of one optimizer and what step() needs of them (see the
    module doc). Holds its optimizer weakly: the optimizer owns it."""

    def __init__(self, optimizer: Any, options: PagingOptions) -> None:
        self._optimizer = weakref.ref(optimizer)
        self.gradients = GradientStore(options, lambda: self.optimizer._store.params())
        self.max_grad_norm = options.max_grad_norm
        self.last_grad_norm: Optional[torch.Tensor] = None
        self.ddp_params: set[int] = set()  # ids of the params DDP reduces (release_ddp.py)
        # Per round (until step() or zero_grad()), by param: the norm of its stream's sum, an
        # empty tensor of its gradient's dtype and device (the order torch sums norms in
        # follows them), the norm of the unscaled sum (GradScaler), the coefficients of the
        # clip_grad_norm_ calls that clipped it.
        self.norms: dict[torch.Tensor, torch.Tensor] = {}
        self.likes: dict[torch.Tensor, torch.Tensor] = {}
        self.unscaled_norms: dict[torch.Tensor, torch.Tensor] = {}
        self.coefficients: dict[torch.Tensor, list[torch.Tensor]] = {}
        # GradScaler: the scaler whose scaled loss produced this round's gradients, whether
        # any sum holds an inf or NaN, and the inv_scale unscale_ gave.
        self.scaler: Any = None
        self.found_inf: Optional[torch.Tensor] = None
        self.unscaled_by: Optional[torch.Tensor] = None
        # max_grad_norm's coefficient, once computed: a step retried after it raised
        # midway clips with it again, not with the norm of the streams it has left.
        self.round_coefficient: Optional[torch.Tensor] = None
        # The params the last step stepped: zero_grad(set_to_none=False) zeroes their
        # streams, as it zeroes the p.grad a step leaves behind.
        self.had_gradient: dict[torch.Tensor, None] = {}
        self._backward_checked = False
        self._groups: Optional[dict[int, list[int]]] = None

    @property
    def optimizer(self) -> Any:
        return self._optimizer()

    # -- during backward -------------------------------------------------------------------

    def on_hook(self, p: torch.Tensor) -> None:
        """The post-accumulate-grad hook of p: releases its gradient, except where DDP
        reduces it first (release_ddp.py releases the reduced one)."""
        if p.grad is None or id(p) in self.ddp_params:
            return
        self.check_backward(data_parallel=True)
        self.release(p, p.grad)
        p.grad = None

    def check_backward(self, data_parallel: bool) -> None:
        """What holds for a whole backward, checked at its first release. data_parallel:
        whether a gradient DDP has not reduced is released (refused under several ranks)."""
        if data_parallel:
            release_guard.check_not_data_parallel()
        if self._backward_checked:
            return
        refuse_cuda_graph_capture()
        release_guard.install()  # accelerate may have been imported after __init__
        self._backward_checked = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._backward_checked = False

    @torch.no_grad()
    def release(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Adds `grad` to p's stream and takes the norm of the sum."""
        if p in self.coefficients:
            raise RuntimeError(
                "a gradient was released after clip_grad_norm_ clipped this optimizer's "
                "released gradients and before step(): the clip was computed without it. Call "
                "clip_grad_norm_ after the last backward before step()")
        if self.unscaled_by is not None:
            raise RuntimeError(
                "a gradient was released after GradScaler.unscale_ unscaled this optimizer's "
                "released gradients and before step(): it would be added to unscaled "
                "gradients while scaled. Call unscale_ after the last backward before step()")
        optimizer = self.optimizer
        grad = optimizer._dense_grad(p, grad, self._group_of(p))
        total = self.gradients.accumulate(p, grad)
        self._note(p, total)
        scaler = release_guard.scaler_of_backward()
        if scaler is not None:
            self.scaler = scaler
        if self.scaler is not None:  # a late gradient of a scaled round is scaled too
            self._note_scaled(p, total)

    def _note(self, p: torch.Tensor, total: torch.Tensor) -> None:
        self.norms[p] = release_clipping.norm_of(total)
        self.likes[p] = torch.empty(0, dtype=total.dtype, device=total.device)

    def _note_scaled(self, p: torch.Tensor, total: torch.Tensor) -> None:
        """A release in a round GradScaler scaled: the norm of the sum as unscale_ would
        leave it (unscale_'s own kernel on a copy, with its inv_scale), and whether the sum
        holds an inf or NaN. An inf in any micro-batch stays in the sum, so the last check
        of each stream is the one unscale_ would make."""
        if self.found_inf is None:
            self.found_inf = torch.zeros((), dtype=torch.float32, device=total.device)
        inv_scale = self.scaler._scale.double().reciprocal().float().to(total.device)
        unscaled = total.clone()
        torch._amp_foreach_non_finite_check_and_unscale_([unscaled], self.found_inf, inv_scale)
        self.unscaled_norms[p] = release_clipping.norm_of(unscaled)

    def _group_of(self, p: torch.Tensor) -> dict[str, Any]:
        groups = self.optimizer.param_groups
        return groups[self._group_ids()[id(p)][0]]

    def _group_ids(self) -> dict[int, list[int]]:
        """id(param) -> the index of each group it is in (twice: stepped twice, as torch
        does), built once per round."""
        if self._groups is None:
            groups: dict[int, list[int]] = collections.defaultdict(list)
            for index, group in enumerate(self.optimizer.param_groups):
                for p in group["params"]:
                    groups[id(p)].append(index)
            self._groups = dict(groups)
        return self._groups

    def release_late_gradients(self) -> None:
        """Releases every gradient no hook released: a param frozen at construction and
        unfrozen since (it gets its hook now), a gradient set by hand, or a DDP param's
        gradient of a no_sync() backward that no synced one followed (stepped unreduced, as
        without release). Before anything reads the released gradients after backward."""
        optimizer = self.optimizer
        late = [p for p in dict.fromkeys(optimizer._store.params()) if p.grad is not None]
        for p in late:
            self.release(p, p.grad)
            p.grad = None
        unhooked = [p for p in late if release_hooks.owner_of(p) is not optimizer]
        if unhooked:
            optimizer._register_release_hooks(unhooked)

    # -- after backward: GradScaler and clip_grad_norm_ (routed by release_guard) ----------

    def unscale(self, inv_scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """GradScaler looks for infs in this optimizer's gradients: returns the released
        gradients' found_inf (None: none was released in a scaled round). inv_scale:
        unscale_'s (None: the check of an amp-aware step only); the step multiplies it into
        each released gradient, and clipping from then on uses the unscaled norms."""
        if not self.unscaled_norms:
            return None
        if inv_scale is not None:
            self.unscaled_by = inv_scale
        return self.found_inf

    def released_norm(self, p: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(the norm of p's released gradient, a tensor of its dtype and device) this round
        (unscaled, after GradScaler's unscale_), or None (none released)."""
        if not self.gradients.has(p):
            return None
        norms = self.unscaled_norms if self.unscaled_by is not None else self.norms
        return norms[p], self.likes[p]

    def clip(self, p: torch.Tensor, coefficient: Optional[torch.Tensor],
             total: torch.Tensor, times: int) -> None:
        """A clip call's coefficient for p's released gradient, applied at step() `times`
        times (p was given that often: torch multiplies it in once per time); None: the
        call only measured the norm."""
        self.last_grad_norm = total
        if coefficient is None:
            return
        if p in self.coefficients:
            raise RuntimeError(
                "clip_grad_norm_ was called twice on released gradients before step(): the "
                "second call would need the norms of the clipped gradients, which were never "
                "taken. Clip once per step")
        self.coefficients[p] = [coefficient] * times

    # -- step() and zero_grad() ------------------------------------------------------------

    @torch.no_grad()
    def finish_round(self, step: StepFunction, amp: dict[str, torch.Tensor]) -> None:
        """Steps every param with a released gradient, in release order, its gradient
        unscaled and clipped: `step([(p, group index, grad), ...], amp)` per batch of at most
        STEP_BATCH_BYTES of gradients (one native call each; a param larger than that is a
        batch of its own; a param in two groups twice). Then the streams are empty.

        amp: GradScaler's found_inf / grad_scale, which it hands over where the kernels take
        them (device state: they unscale by grad_scale and skip on found_inf, no host
        sync); elsewhere GradScaler unscales (unscale_, routed here) and skips the step
        itself, as without release."""
        self.release_late_gradients()
        params = self.gradients.filled()
        if "grad_scale" in amp and self.max_grad_norm is not None:
            raise RuntimeError(
                f"max_grad_norm={self.max_grad_norm} cannot clip gradients GradScaler has not "
                "unscaled: call scaler.unscale_(optimizer) before scaler.step(optimizer)")
        if self.round_coefficient is None:
            self.round_coefficient = self._coefficient_of_max_grad_norm(params)
        group_ids = self._group_ids()
        self.gradients.plan_reads(params)
        try:
            for batch in _batches(params, STEP_BATCH_BYTES):
                entries = []
                for p in batch:
                    # In the order the loop without release changes p.grad: unscale_, the
                    # clip_grad_norm_ calls, max_grad_norm's clip.
                    grad = self.gradients.read(p)
                    _unscale(grad, self.unscaled_by)
                    for coefficient in self.coefficients.get(p, []):
                        release_clipping.apply(grad, coefficient)
                    release_clipping.apply(grad, self.round_coefficient)
                    entries += [(p, group_id, grad) for group_id in group_ids[id(p)]]
                step(entries, amp)
                # Emptied once stepped: a step that raised midway steps the rest on retry
                # (the batch that raised is read again, the same, and resumed).
                for p in batch:
                    self.gradients.discard(p)
        finally:
            self.gradients.plan_reads([])
        self.had_gradient = dict.fromkeys(params)
        self.end_round()

    def _coefficient_of_max_grad_norm(self, params: list[torch.Tensor]
                                      ) -> Optional[torch.Tensor]:
        """max_grad_norm's clip coefficient over the params in the optimizer's order (where
        clip_grad_norm_(optimizer's params) would take them), or None."""
        if self.max_grad_norm is None or not params:
            return None
        if self.coefficients:
            raise RuntimeError(
                "clip_grad_norm_ was called on the released gradients of an optimizer that "
                f"clips them itself (max_grad_norm={self.max_grad_norm}): they would be "
                "clipped twice. Use one or the other")
        filled = set(params)
        ordered = [p for p in dict.fromkeys(self.optimizer._store.params()) if p in filled]
        norms, likes = zip(*(self.released_norm(p) for p in ordered))
        total = release_clipping.total_norm(list(norms), list(likes))
        self.last_grad_norm = total
        return release_clipping.clip_coefficient(self.max_grad_norm, total)

    @torch.no_grad()
    def zero(self, params: list[torch.Tensor], set_to_none: bool) -> None:
        """zero_grad for `params` (the optimizer's, or a module's): their streams are
        emptied, or, with set_to_none=False, those holding a gradient (or left by the last
        step, as p.grad is) are zeroed, as p.grad would be."""
        params = list(dict.fromkeys(params))
        zeroed = [] if set_to_none else \
            [p for p in params if self.gradients.has(p) or p in self.had_gradient]
        for p in params:
            self._forget(p)
            if set_to_none:
                self.had_gradient.pop(p, None)
        if not self.gradients.filled():
            self._reset_round()
        for p in zeroed:
            self.gradients.zero(p)
            # A zero gradient's norm is 0 (of its dtype), whatever its size.
            self._note(p, torch.zeros(1, dtype=p.dtype, device=p.device))

    def _forget(self, p: torch.Tensor) -> None:
        self.gradients.forget(p)
        for per_param in (self.norms, self.likes, self.unscaled_norms, self.coefficients):
            per_param.pop(p, None)

    def groups_changed(self) -> None:
        """A param group was added: the groups of the params are looked up anew."""
        self._groups = None

    def end_round(self) -> None:
        """Empties the streams (step() applied them, or zero_grad() dropped them)."""
        self.gradients.clear()
        self.norms.clear()
        self.likes.clear()
        self.coefficients.clear()
        self.unscaled_norms.clear()
        self._reset_round()

    def _reset_round(self) -> None:
        self._backward_checked = False
        self._groups = None
        release_guard.forget_scaled_backwards()
        self.scaler = None
        self.found_inf = None
        self.unscaled_by = None
        self.round_coefficient = None

    def close(self) -> None:
        """The optimizer was closed: the gradients are dropped with their pages (the page
        file, pinned memory)."""
        self.end_round()
        self.gradients.close()


def _unscale(grad: torch.Tensor, inv_scale: Optional[torch.Tensor]) -> None:
    """grad *= inv_scale with the kernel GradScaler.unscale_ uses (its found_inf is known)."""
    if inv_scale is None:
        return
    found_inf = torch.zeros((), dtype=torch.float32, device=grad.device)
    torch._amp_foreach_non_finite_check_and_unscale_([grad], found_inf,
                                                     inv_scale.to(grad.device).reshape(()))


def _batches(params: list[torch.Tensor], budget: int) -> list[list[torch.Tensor]]:
    """`params` in order, cut into runs whose gradients take at most `budget` bytes."""
    batches: list[list[torch.Tensor]] = []
    size = budget
    for p in params:
        nbytes = p.numel() * p.element_size()
        if size + nbytes > budget:
            batches.append([])
            size = 0
        batches[-1].append(p)
        size += nbytes
    return batches
