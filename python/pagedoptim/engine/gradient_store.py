"""GradientStore: where gradient release keeps each param's gradient between backward and
step(): a gradient stream per param in pages of its own native `PagedState`.

With `release_grads=True` a post-accumulate-grad hook hands each gradient over as soon as
autograd has produced it (engine/release_hooks.py); the optimizer adds it to the param's
stream here and frees the device gradient, so backward never holds more than the gradients
autograd is producing at that moment. step() reads the streams back in batches of params, in
the order they were released (optim/gradient_release.py).

Why a store of its own, not one more stream in the state's pages: the gradient is not state
(it is not in state_dict(), checkpoints or memory_report()'s state bytes, and a load must not
replace it), and it is touched on another schedule (every micro-batch, where the state is
touched once a step). It pages exactly like the state all the same, through the same native
engine: the pages live in memory (offload=None), on the device over pinned host memory
(offload="host") or over a page file (offload="nvme", a second file in nvme_dir). Its cache is
small (MIN_CACHE_PAGES pages): each stream is read and written once per pass, so pages beyond
the prefetch depth would never be hit again.

The stream holds the gradient in the param's dtype (fp32 for fp32 and complex params, bf16 or
fp16 for 16-bit ones), added in that dtype: exactly what `p.grad` accumulates without
release, so release changes where the gradient lives and nothing else.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from pagedoptim import paging
from pagedoptim._native import native
from pagedoptim.paging.options import PagingOptions
from pagedoptim.state import format as state_format
from pagedoptim.state.format import StreamSpec

GRADIENT = "grad"
# One page kind per element size: the kernels never read these pages, they only hold bytes.
_KIND_OF_DTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 1}
_STREAM_ELEMENT_BYTES = (4, 2)  # by kind
_KINDS = [[StreamSpec(GRADIENT, 4 * state_format.GROUP_SIZE, False, torch.float32)],
          [StreamSpec(GRADIENT, 2 * state_format.GROUP_SIZE, False, torch.bfloat16)]]
# The native engine wants an algorithm; no step is ever called on this one.
_ALGORITHM = "sgd"


class GradientStore:
    """The released gradients of one optimizer's params, by param (see the module doc).

    A param's stream is either empty (no gradient since the last step or zero_grad) or holds
    the sum of the gradients released since; `filled()` lists the second kind in release
    order."""

    def __init__(self, options: PagingOptions,
                 all_params: Callable[[], list[torch.Tensor]]) -> None:
        # Every param of the optimizer: the engine, created at the first release, chooses its
        # page size for all of them (asked then, not on every release).
        self.options = options
        self._all_params = all_params
        self.engine: Any = None
        self.device: Optional[torch.device] = None
        self._slots: dict[torch.Tensor, int] = {}
        self._filled: dict[torch.Tensor, None] = {}  # insertion order: the release order

    # -- layout ----------------------------------------------------------------------------

    def _ensure_engine(self) -> Any:
        """The engine, created at the first release with room for every param."""
        if self.engine is not None:
            return self.engine
        params = self._all_params()
        self.device = params[0].device
        store = paging.store_options(self.options)
        planned = [(_kind(p), _numel(p), 0) for p in dict.fromkeys(params)]
        page_bytes = paging.choose_page_bytes(self.options, store, _KINDS, planned)
        if store is not None:
            store = {**store,
                     "cache_bytes": min(store["cache_bytes"], paging.MIN_CACHE_PAGES * page_bytes)}
        self.engine = native.PagedState(
            _ALGORITHM, [[spec.as_native() for spec in kind] for kind in _KINDS], page_bytes,
            store=store, device=paging.engine_device(store, self.device))
        if store is not None:
            paging.warn_about_fallbacks(self.engine)
        return self.engine

    def _slot(self, p: torch.Tensor) -> int:
        slot = self._slots.get(p)
        if slot is None:
            engine = self._ensure_engine()
            slot = self._slots[p] = engine.register_param(_numel(p), _kind(p), 0)
        return slot

    # -- the gradients ---------------------------------------------------------------------

    def has(self, p: torch.Tensor) -> bool:
        return p in self._filled

    def filled(self) -> list[torch.Tensor]:
        """The params whose stream holds a gradient, in the order of their first release."""
        return list(self._filled)

    def accumulate(self, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Adds `grad` (p's gradient, on p's device) to p's stream and returns the sum on p's
        device: `grad` itself for the first gradient since the stream was emptied."""
        slot = self._slot(p)
        if p in self._filled:
            total = self._read(p, slot, grad.device)
            total.add_(grad)
        else:
            total = grad
        self.engine.write_stream(slot, GRADIENT, _as_bytes(total))
        self._filled[p] = None
        return total

    def read(self, p: torch.Tensor) -> torch.Tensor:
        """p's gradient: a new tensor on p's device (the stream keeps it until `discard`)."""
        return self._read(p, self._slots[p], p.device)

    def discard(self, p: torch.Tensor) -> None:
        """Empties p's stream (its gradient was stepped)."""
        del self._filled[p]

    def forget(self, p: torch.Tensor) -> None:
        """Empties p's stream if it holds a gradient (zero_grad)."""
        self._filled.pop(p, None)

    def zero(self, p: torch.Tensor) -> None:
        """p's stream holds a zero gradient (zero_grad(set_to_none=False))."""
        slot = self._slot(p)
        size = self.engine.stream_bytes(slot, GRADIENT)
        self.engine.write_stream(slot, GRADIENT, torch.zeros(size, dtype=torch.uint8))
        self._filled[p] = None

    def plan_reads(self, params: list[torch.Tensor]) -> None:
        """Announces that `read` will read these params' streams in this order: a paged store
        reads ahead of them (an empty list ends the plan)."""
        if self.engine is None:
            return
        self.engine.plan_stream_ranges(
            [(self._slots[p], GRADIENT, 0, self.engine.stream_bytes(self._slots[p], GRADIENT))
             for p in params])

    def clear(self) -> None:
        """Empties every stream (zero_grad): the next release starts each sum anew."""
        self._filled.clear()

    def close(self) -> None:
        """Drops the engine (the last reference: its destructor closes the page file and
        frees the pinned memory); a later release builds a new one."""
        self._filled.clear()
        self._slots.clear()
        self.engine = None

    def _read(self, p: torch.Tensor, slot: int, device: torch.device) -> torch.Tensor:
        raw = self.engine.read_stream(slot, GRADIENT)
        value = raw.view(_stream_dtype(p)).view(_shape(p))
        if p.is_complex():
            value = torch.view_as_complex(value)
        return value.to(device, non_blocking=False)

    # -- reports ---------------------------------------------------------------------------

    def memory_usage(self) -> dict[str, Any]:
        """The pages' bytes and where they are ('placement', as memory_report() says it)."""
        if self.engine is None:
            return {"state_bytes": 0, "resident_bytes": 0, "placement": {}}
        usage = self.engine.memory_usage()
        return {"state_bytes": usage["state_bytes"], "resident_bytes": usage["resident_bytes"],
                "placement": dict(usage["placement"])}

    def paging_stats(self) -> Optional[dict[str, Any]]:
        return None if self.engine is None else self.engine.paging_stats()


def payload_bytes(params: list[torch.Tensor]) -> int:
    """The bytes the gradient streams of `params` hold (whole groups of 32 elements)."""
    return sum(-(-_numel(p) // state_format.GROUP_SIZE) * state_format.GROUP_SIZE
               * _STREAM_ELEMENT_BYTES[_kind(p)] for p in dict.fromkeys(params))


def _stream_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.float32 if p.is_complex() else p.dtype


def _kind(p: torch.Tensor) -> int:
    return _KIND_OF_DTYPE[_stream_dtype(p)]


def _numel(p: torch.Tensor) -> int:
    return p.numel() * (2 if p.is_complex() else 1)


def _shape(p: torch.Tensor) -> torch.Size:
    return torch.Size([*p.shape, 2]) if p.is_complex() else p.shape


def _as_bytes(value: torch.Tensor) -> torch.Tensor:
    """A gradient's bytes as the engine takes them: a contiguous uint8 CPU tensor."""
    if value.is_complex():
        value = torch.view_as_real(value)
    return value.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
