"""Gradient release under DDP: the gradients are released after DDP's all-reduce.

A param's post-accumulate-grad hook fires before DDP has reduced its gradient, so the release
hooks leave DDP's params alone (GradientRelease.ddp_params) and `optimizer.register_ddp(model)`
puts a communication hook on the DDP module instead. The hook reduces each bucket as DDP
does without one (each gradient multiplied by 1/world_size, DDP's reducer's own division,
then summed over the ranks) and marks the backward as synced; when that backward ends,
after DDP has written the reduced gradients into p.grad, the gradients of the registered
optimizers' params are released from there and freed. So every rank adds the same reduced
gradient; a param DDP found unused keeps no gradient and is not stepped, as without release;
and under no_sync() the hook never runs: the gradients stay in p.grad for DDP to reduce at
the synced backward, as without release.

One module has one communication hook, shared by every optimizer registered on it (an
optimizer per param group, say).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from pagedoptim.engine import release_guard

# The attribute of a DDP module that holds its _ModuleRelease.
_STATE = "_pagedoptim_release"


class _ModuleRelease:
    """The releases of one DDP module's params (held weakly: the optimizers own them)."""

    def __init__(self, model: Any) -> None:
        self.process_group = model.process_group
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.releases: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self.scaler: Any = None  # the GradScaler of the synced backward running now
        self._queued = False

    def synced(self) -> None:
        """A bucket of a synced backward is being reduced (the communication hook)."""
        if self._queued:
            return
        self._queued = True
        self.scaler = release_guard.scaler_of_backward()
        # DDP queues the callback that writes the reduced gradients into p.grad when its
        # last bucket is ready, after this one; a callback queued from a callback runs after
        # every callback queued before it, so the release runs after DDP's.
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(self._release_reduced))

    def _release_reduced(self) -> None:
        self._queued = False
        for release in list(self.releases):
            params = [p for p in self.params
                      if id(p) in release.ddp_params and p.grad is not None]
            if not params:
                continue
            release.check_backward(data_parallel=False)
            if self.scaler is not None:
                release.scaler = self.scaler
            for p in params:
                release.release(p, p.grad)
                p.grad = None
        self.scaler = None


def register(release: Any, model: Any) -> None:
    """optimizer.register_ddp(model): the gradients of `model`'s params that `release`'s
    optimizer holds are released after DDP's all-reduce."""
    from torch.nn.parallel import DistributedDataParallel
    if not isinstance(model, DistributedDataParallel):
        raise TypeError("register_ddp: model must be a torch.nn.parallel."
                        f"DistributedDataParallel, got {type(model).__name__}")
    ours = {id(p) for p in release.optimizer._store.params()}
    managed = {id(p) for p in model.parameters() if p.requires_grad} & ours
    if not managed:
        raise ValueError("register_ddp: none of the DDP module's params is a param of this "
                         "optimizer")
    state = getattr(model, _STATE, None)
    if state is None:
        state = _ModuleRelease(model)
        try:
            model.register_comm_hook(state, _reduce_as_ddp_does)
        except RuntimeError as error:
            raise RuntimeError(f"register_ddp: DDP refused the communication hook that takes "
                               f"the released gradients after the all-reduce ({error}); a "
                               "module with a communication hook of its own cannot release "
                               "gradients") from None
        setattr(model, _STATE, state)
    state.releases.add(release)
    release.ddp_params |= managed


def _reduce_as_ddp_does(state, bucket):  # type: ignore[no-untyped-def]
    """DDP communication hook: the bucket reduced as DDP's reducer reduces it without a hook
    (multiplied by 1/world_size, then summed over the ranks), and the backward marked synced.
    (No annotations: DDP refuses a hook whose `bucket` annotation is not dist.GradBucket
    itself, and under `from __future__ import annotations` every annotation is a string.)"""
    group = state.process_group
    buffer = bucket.buffer()
    buffer.mul_(1.0 / group.size())
    future = torch.distributed.all_reduce(buffer, group=group, async_op=True).get_future()
    state.synced()
    return future.then(lambda done: done.value()[0])
