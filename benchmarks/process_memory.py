"""What a step costs in memory: tensor storage, resident-set growth and the transient peak.

Three views of the same bytes, because each hides something the others show:

- storage: the bytes of the tensors an optimizer keeps (deduplicated by storage, so a shared
  lookup table counts once) -- what the format needs;
- RSS growth across the first step, which allocates the state -- what the process really
  paid, allocator slack and one-time costs (a compiled kernel, a loaded library) included;
- the transient peak of a later step on top of the RSS before it -- the temporaries a step
  allocates and frees (an fp32 copy of a bf16 param, a dequantized state), which storage
  never shows and which decide whether the step fits.

For RSS to move with live tensors, glibc must hand large blocks back when they are freed and
must not serve a new tensor from memory an earlier one left in its heap. `pin_malloc_to_mmap`
fixes the mmap threshold at 64 KiB (setting it also stops glibc raising it on its own), so
every allocation above that is mapped when made and unmapped when freed; torch's CPU allocator
calls malloc/free directly, with no cache of its own. The peak comes from the kernel's
high-water mark (VmHWM), reset before each measured step by writing 5 to
/proc/self/clear_refs: an exact peak, not a sampled one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

# The RSS probes live in the package (one copy for the library, benchmarks and tests).
from pagedoptim.cli.process_memory import (  # noqa: F401
    MMAP_THRESHOLD_BYTES, peak_rss_bytes, pin_malloc_to_mmap, reset_peak_rss, rss_bytes)


def _tensors_in(value: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    """Every plain tensor reachable from an optimizer's state entry: tensor subclasses (torchao's
    quantized states) are opened into their inner tensors, containers and small state objects
    (a peer's quantized-tensor wrapper) into their fields."""
    if depth > 4:
        return
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            for name in names:
                yield from _tensors_in(getattr(value, name), depth + 1)
        else:
            yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, depth + 1)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        for item in vars(value).values():
            yield from _tensors_in(item, depth + 1)


def state_storage_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's own state tensors, each storage counted once."""
    if hasattr(optimizer, "memory_report"):  # ours: the state lives in pages, not in .state
        return int(optimizer.memory_report()["state_bytes"])
    states = [optimizer.state]
    # torchao's CPUOffloadOptimizer keeps one inner optimizer per param.
    for inner in getattr(optimizer, "optim_dict", {}).values():
        states.append(inner.state)
    seen: dict[tuple[str, int], int] = {}
    for state in states:
        for tensor in _tensors_in(dict(state)):
            storage = tensor.untyped_storage()
            seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())
