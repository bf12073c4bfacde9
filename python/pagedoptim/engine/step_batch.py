"""StepBatch: the arguments of one native step call, collected param by param.

One `step()` is one native call (`PagedState.step_<algorithm>`) over every param with a
gradient; a param given twice in a group makes a second round (optim/optimizer.py). What a
param adds is checked here: its device, its gradient's shape and dtype, a DTensor's local
shard, a complex param's real view, a contiguous working copy where the param is not
contiguous (written back after the call).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedoptim._native import native
from pagedoptim.state import sharding as sharded_params


def refuse_cuda_graph_capture() -> None:
    """A step cannot be captured in a CUDA graph: its work tables reach the GPU through
    pinned host buffers that are reused once copied, paging moves pages between steps, and
    CPU params' steps are not GPU work at all. A replay would read memory rewritten since,
    or silently skip the step, so a capture is refused before anything changes. A process
    that never initialized CUDA captures nothing, and asking would initialize it."""
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "pagedoptim's step cannot be captured in a CUDA graph (torch.cuda.graph, "
            "CUDAGraph.capture_begin): a replay would reuse host buffers and pages that have "
            "changed since the capture. Run optimizer.step() outside the captured region; "
            "torch.compile(mode='reduce-overhead') already leaves it out")


class StepBatch:
    """The native call's lists, one entry per param; `amp` holds GradScaler's tensors and
    `layouts` what the algorithm needs beside the slot (StateStore.batch_layout)."""

    __slots__ = ("params", "grads", "steps", "slots", "group_ids", "hyperparameters",
                 "write_back", "amp", "layouts")

    def __init__(self, hyperparameters: list[tuple],
                 amp: Optional[dict[str, torch.Tensor]] = None) -> None:
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.steps: list[torch.Tensor] = []
        self.slots: list[int] = []
        self.group_ids: list[int] = []
        self.hyperparameters = hyperparameters
        self.write_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.amp: dict[str, torch.Tensor] = amp or {}
        self.layouts: list[Any] = []

    def add(self, store: Any, p: torch.Tensor, grad: torch.Tensor, group_id: int,
            step: torch.Tensor, target: Optional[torch.Tensor] = None) -> None:
        """Adds param `p` of `store` with its gradient. The step updates `target` and
        advances `step`: p and its step counter, unless a compiled step hands over the
        tensors of its custom op (functional copies of them)."""
        # is_cuda / is_cpu, not .device: this runs per param per step, and every .device
        # makes a new object.
        if p.is_cuda:
            if not native.cuda_built():
                raise RuntimeError(
                    f"{store.describe(p)} is on {p.device}, but this build of pagedoptim has "
                    "no CUDA kernels: rebuild it against a CUDA build of torch with a matching "
                    "nvcc (`PAGEDOPTIM_WITH_CUDA=1 pip install --no-build-isolation -e .`)")
        elif not p.is_cpu:
            raise NotImplementedError(
                f"{store.describe(p)} is on {p.device}; pagedoptim steps params on the CPU "
                "and on CUDA devices")
        if not (grad.is_cpu and p.is_cpu) and grad.device != p.device:
            raise ValueError(f"the grad of {store.describe(p)} is on {grad.device}, its param "
                             f"on {p.device}: they must be on one device")
        if grad.shape != p.shape or grad.dtype != p.dtype:
            raise ValueError(f"the grad of {store.describe(p)} has shape {tuple(grad.shape)} "
                             f"and dtype {grad.dtype}; it must match its param")
        values = p if target is None else target
        if sharded_params.is_dtensor(p) or sharded_params.is_dtensor(grad):
            # FSDP2 / tensor parallelism: the local shards are stepped, with state for them.
            grad = sharded_params.local_grad(p, grad, lambda: store.describe(p))
            # The step writes the local shard; a graph may have saved the DTensor itself
            # (tensor parallelism), whose version counter is its own.
            torch.autograd.graph.increment_version(values)
            values = sharded_params.local_tensor(values)
        if p.is_complex():
            # As torch.optim does: a complex param and its state are stepped as the real
            # view, every real and imaginary part an element of its own.
            values, grad = torch.view_as_real(values), torch.view_as_real(grad)
        work = values if values.is_contiguous() else values.contiguous()
        if work is not values:
            self.write_back.append((values, work))
        self.params.append(work)
        self.grads.append(grad if grad.is_contiguous() else grad.contiguous())
        self.steps.append(step)
        self.slots.append(store.slot(p))
        self.group_ids.append(group_id)
        layout = store.batch_layout(p)
        if layout is not None:
            self.layouts.append(layout)

    def native_args(self) -> tuple:
        """The positional arguments of the native step call (the algorithm's layouts, where
        it has any, follow them)."""
        return (self.params, self.grads, self.steps, self.slots, self.group_ids,
                self.hyperparameters)

    def finish(self) -> None:
        """After the native call, also after one that raised: the chunks applied before an
        error must reach the params stepped on contiguous copies, or a retry could not
        finish the step."""
        # The kernels wrote the params through their pointers: tell autograd, as an
        # in-place op would, so a graph that saved a param before the step refuses to
        # backward through it (torch.optim's in-place updates raise there too).
        for param in self.params:  # one at a time: torch < 2.5 takes no list
            torch.autograd.graph.increment_version(param)
        for p, work in self.write_back:
            p.copy_(work)
