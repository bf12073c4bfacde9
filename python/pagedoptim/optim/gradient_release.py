"""Gradient release: what an optimizer with `release_grads=True` does between backward and step.

Each gradient, as soon as autograd has produced it, is added to the param's gradient stream
(engine/gradient_store.py: paged like the state) and `p.grad` is freed; the norm of the sum
so far is taken on the way (engine/release_clipping.py). step() then steps each param from
its stream, in the order the gradients were released, multiplied by the clip coefficient of
the global norm where clipping was asked for: by `max_grad_norm=`, or by a call of
clip_grad_norm_ (torch's or accelerate's, which engine/release_guard.py routes here). So
release keeps what the loop without it computes, bit for bit:

- accumulation: k backward calls add into the streams as they would into p.grad, and the
  step after the last one steps the sum; zero_grad() empties the streams, as it empties
  p.grad;
- clipping: the coefficient is clip_grad_norm_'s, from the same norms summed in the same
  order;
- DDP: `register_ddp(model)` puts a communication hook on the DDP module that takes each
  bucket's gradients after the all-reduce (torch's default all-reduce, then the release), so
  every rank adds the same reduced gradient; the release hooks leave the module's params to
  it, and under no_sync() their gradients stay in p.grad for DDP to reduce at the synced
  backward, as without release;
- a backward that raised midway (out of memory) changed no param: the gradients it released
  wait in their streams, as they would in p.grad, until step() or zero_grad().

- GradScaler: a release in a backward that started from a scaled loss also takes the norm of
  the unscaled sum and notes infs; unscale_ and step() find them through the routed
  `_unscale_grads_`, the step unscales each gradient as unscale_ (or, for device state, the
  kernel) would, and is skipped on an inf as without release.

What release cannot keep exact raises the first time it meets it: clip_grad_value_, a second
clip_grad_norm_ of the same gradients, another norm_type than 2, a backward after the clip or
after unscale_ (engine/release_guard.py and below).
"""

from __future__ import annotations

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


class GradientRelease:
    """The released gradients of one optimizer and what step() needs of them (see the
    module doc). Holds its optimizer weakly: the optimizer owns it."""

    def __init__(self, optimizer: Any, options: PagingOptions) -> None:
        self._optimizer = weakref.ref(optimizer)
        self.gradients = GradientStore(options)
        self.max_grad_norm = options.max_grad_norm
        self.norms: dict[torch.Tensor, torch.Tensor] = {}        # of each stream's sum
        self.coefficients: dict[torch.Tensor, torch.Tensor] = {}  # set by a clip call
        self.last_grad_norm: Optional[torch.Tensor] = None
        self.ddp_params: set[int] = set()  # ids of the params a DDP comm hook releases
        self._backward_checked = False
        # GradScaler: the norms of the unscaled sums (taken where a scaled loss started the
        # backward), whether any sum holds an inf or NaN, and the inv_scale unscale_ gave.
        self.unscaled_norms: dict[torch.Tensor, torch.Tensor] = {}
        self.found_inf: Optional[torch.Tensor] = None
        self.unscaled_by: Optional[torch.Tensor] = None

    @property
    def optimizer(self) -> Any:
        return self._optimizer()

    # -- during backward -------------------------------------------------------------------

    def on_hook(self, p: torch.Tensor) -> None:
        """The post-accumulate-grad hook of p: releases its gradient, except where DDP
        reduces it first (its communication hook releases the reduced one)."""
        if p.grad is None or id(p) in self.ddp_params:
            return
        self.check_backward()
        self.release(p, p.grad)
        p.grad = None

    def check_backward(self) -> None:
        """What holds for a whole backward, checked at its first release."""
        if self._backward_checked:
            return
        refuse_cuda_graph_capture()
        release_guard.check_not_data_parallel(bool(self.ddp_params))
        release_guard.install()  # accelerate may have been imported after __init__
        self._backward_checked = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._backward_checked = False

    @torch.no_grad()
    def release(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Adds `grad` to p's stream and takes the norm of the sum."""
        optimizer = self.optimizer
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
        grad = optimizer._dense_grad(p, grad, optimizer._group_of(p))
        total = self.gradients.accumulate(p, grad, optimizer._store.params())
        self.norms[p] = release_clipping.norm_of(total)
        scaler = release_guard.scaler_of_backward()
        if scaler is not None:
            self._note_scaled(p, total, scaler)

    def _note_scaled(self, p: torch.Tensor, total: torch.Tensor, scaler: Any) -> None:
        """A release in a backward GradScaler scaled: the norm of the sum as unscale_ would
        leave it (unscale_'s own kernel on a copy, with its inv_scale), and whether the sum
        holds an inf or NaN. An inf in any micro-batch stays in the sum, so the last check
        of each stream is the one unscale_ would make."""
        if self.found_inf is None:
            self.found_inf = torch.zeros((), dtype=torch.float32, device=total.device)
        inv_scale = scaler._scale.double().reciprocal().float().to(total.device)
        unscaled = total.clone()
        torch._amp_foreach_non_finite_check_and_unscale_([unscaled], self.found_inf, inv_scale)
        self.unscaled_norms[p] = release_clipping.norm_of(unscaled)

    def unscale(self, inv_scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """GradScaler looks for infs in this optimizer's gradients (routed here by
        engine/release_guard.py): returns the released gradients' found_inf (None: none was
        released in a scaled backward). inv_scale: unscale_'s (None: step()'s check only);
        the step multiplies it into each released gradient, and clipping from then on uses
        the unscaled norms."""
        if not self.unscaled_norms:
            return None
        if inv_scale is not None:
            self.unscaled_by = inv_scale
        return self.found_inf
    # -- clipping (clip_grad_norm_ routed here by engine/release_guard.py) -----------------

    def released_norm(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The norm of p's released gradient this round (unscaled, after GradScaler's
        unscale_), or None (none released)."""
        if not self.gradients.has(p):
            return None
        return (self.unscaled_norms if self.unscaled_by is not None else self.norms).get(p)

    def clip(self, p: torch.Tensor, coefficient: Optional[torch.Tensor],
             total: torch.Tensor) -> None:
        """A clip call's coefficient for p's released gradient, applied at step() (None: the
        call only measured the norm)."""
        self.last_grad_norm = total
        if coefficient is None:
            return
        if p in self.coefficients:
            raise RuntimeError(
                "clip_grad_norm_ was called twice on released gradients before step(): the "
                "second call would need the norms of the clipped gradients, which were never "
                "taken. Clip once per step")
        self.coefficients[p] = coefficient

    # -- step() ----------------------------------------------------------------------------

    @torch.no_grad()
    def finish_round(self, step: Callable[[list[tuple[torch.Tensor, int, torch.Tensor]],
                                           dict[str, torch.Tensor]], None],
                     amp: dict[str, torch.Tensor], on_device: bool) -> None:
        """Steps every param with a released gradient, in release order, its gradient
        unscaled and clipped: `step([(p, group index, grad), ...], amp)` per batch of at most
        STEP_BATCH_BYTES of gradients (one native call each; a param larger than that is a
        batch of its own). Then the streams are empty.

        amp: GradScaler's found_inf / grad_scale, handed over by GradScaler.step. on_device:
        whether the kernels take them, as the step without release does on device state
        (they unscale by grad_scale and skip on found_inf, no host sync); otherwise (CPU
        state, SkewAdam), where GradScaler unscales p.grad (unscale_'s multiply) and skips
        on the host without release, the same is done here."""
        optimizer = self.optimizer
        self._release_late_gradients()
        params = self.gradients.filled()
        group_ids = {id(p): index for index, group in enumerate(optimizer.param_groups)
                     for p in group["params"]}
        inv_scale_at_step = None
        if not on_device:
            found_inf = amp.get("found_inf")
            if found_inf is not None and float(found_inf.sum()) != 0:
                self.end_round()  # GradScaler skips the step: the gradients are dropped
                return
            if "grad_scale" in amp:
                inv_scale_at_step = amp["grad_scale"].double().reciprocal().float()
            amp = {}
        elif "grad_scale" in amp and self.max_grad_norm is not None:
            raise RuntimeError(
                f"max_grad_norm={self.max_grad_norm} cannot clip gradients GradScaler has not "
                "unscaled: call scaler.unscale_(optimizer) before scaler.step(optimizer)")
        coefficient = self._coefficient_of_max_grad_norm(
            params, unscaled=self.unscaled_by is not None or inv_scale_at_step is not None)
        self.gradients.plan_reads(params)
        try:
            for batch in _batches(params, STEP_BATCH_BYTES):
                entries = []
                for p in batch:
                    # In the order the loop without release changes p.grad: unscale_, a
                    # clip_grad_norm_ call, GradScaler.step's unscale_, max_grad_norm's clip.
                    grad = self.gradients.read(p)
                    _unscale(grad, self.unscaled_by)
                    release_clipping.apply(grad, self.coefficients.get(p))
                    _unscale(grad, inv_scale_at_step)
                    release_clipping.apply(grad, coefficient)
                    entries.append((p, group_ids[id(p)], grad))
                step(entries, amp)
                # Emptied once stepped: a step that raised midway steps the rest on retry
                # (the batch that raised is read again, the same, and resumed).
                for p in batch:
                    self.gradients.discard(p)
        finally:
            self.gradients.plan_reads([])
        self.end_round()

    def _release_late_gradients(self) -> None:
        """Releases, before the step, every gradient no hook released: a param frozen at
        construction and unfrozen since (it gets its hook now), a gradient set by hand, or
        a DDP param's gradient of a no_sync() backward that no synced one followed (stepped
        unreduced, as without release)."""
        optimizer = self.optimizer
        late = [p for p in dict.fromkeys(optimizer._store.params()) if p.grad is not None]
        for p in late:
            self.release(p, p.grad)
            p.grad = None
        unhooked = [p for p in late if release_hooks.owner_of(p) is not optimizer]
        if unhooked:
            optimizer._register_release_hooks(unhooked)

    def _coefficient_of_max_grad_norm(self, params: list[torch.Tensor], unscaled: bool
                                      ) -> Optional[torch.Tensor]:
        """max_grad_norm's clip coefficient over the params in the optimizer's order (where
        clip_grad_norm_(optimizer's params) would take them), or None. unscaled: of the
        gradients GradScaler unscaled (their norms taken at release)."""
        if self.max_grad_norm is None or not params:
            return None
        if self.coefficients:
            raise RuntimeError(
                "clip_grad_norm_ was called on the released gradients of an optimizer that "
                f"clips them itself (max_grad_norm={self.max_grad_norm}): they would be "
                "clipped twice. Use one or the other")
        filled = set(params)
        ordered = [p for p in dict.fromkeys(self.optimizer._store.params()) if p in filled]
        norms = [(self.unscaled_norms if unscaled else self.norms)[p] for p in ordered]
        total = release_clipping.total_norm(norms, norms)
        self.last_grad_norm = total
        return release_clipping.clip_coefficient(self.max_grad_norm, total)

    def end_round(self) -> None:
        """Empties the streams (step() applied them, or zero_grad() dropped them)."""
        self._backward_checked = False
        release_guard.forget_scaled_backwards()
        self.gradients.clear()
        self.norms.clear()
        self.coefficients.clear()
        self.unscaled_norms.clear()
        self.found_inf = None
        self.unscaled_by = None

    def close(self) -> None:
        """The optimizer was closed: the gradients are dropped with their pages (the page
        file, pinned memory)."""
        self.end_round()
        self.gradients.close()

    # -- DDP -------------------------------------------------------------------------------

    def register_ddp(self, model: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"register_ddp: model must be a torch.nn.parallel."
                            f"DistributedDataParallel, got {type(model).__name__}")
        ours = {id(p) for p in self.optimizer._store.params()}
        managed = {id(p) for p in model.parameters() if p.requires_grad} & ours
        if not managed:
            raise ValueError("register_ddp: none of the DDP module's params is a param of "
                             "this optimizer")
        model.register_comm_hook(weakref.ref(self), _release_after_all_reduce)
        self.ddp_params |= managed


def _release_after_all_reduce(state, bucket):  # type: ignore[no-untyped-def]
    """DDP communication hook: torch's default all-reduce of the bucket (divided by the
    world size, then summed), waited for here, then the release of each reduced gradient.
    Waiting serializes the all-reduce with backward, as torch's own optimizer-in-backward
    hook does: the streams are written from this thread, in order. (No annotations: DDP
    refuses a hook whose `bucket` annotation is not dist.GradBucket itself, and under
    `from __future__ import annotations` every annotation is a string.)"""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    buffer = default_hooks.allreduce_hook(None, bucket).wait()
    release = state()
    if release is not None and release.optimizer is not None:
        release.check_backward()
        for p, grad in zip(bucket.parameters(), bucket.gradients()):
            if id(p) in release.ddp_params:
                release.release(p, grad)
        # DDP writes the reduced gradients into p.grad when backward ends; they are
        # released already, so they are freed after that (a callback queued from a callback
        # runs after DDP's own, queued before it).
        engine = torch.autograd.Variable._execution_engine
        params = [p for p in bucket.parameters() if id(p) in release.ddp_params]
        engine.queue_callback(lambda: engine.queue_callback(lambda: _free(params)))
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(buffer)
    return done


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


def _free(params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = None
