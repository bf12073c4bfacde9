"""The optimizer state an optimizer will have, before it has any: the same bytes that
`memory_report()` gives after the first step, from the param shapes alone.

It runs the optimizer's own layout code (its stream kinds, `paging.choose_page_bytes`, and
the native page table through `native.count_pages`), so a plan cannot drift from what the
engine allocates. The params may be meta tensors: `plan` builds 70B models that way, and
nothing here touches their data.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from pagedoptim import paging

from pagedoptim.state import format as state_format
from pagedoptim._native import native

# The 4-byte step counter each stepped param keeps (memory_report's 'step_bytes').
STEP_COUNTER_BYTES = 4
# pagedoptim/paging.py's bounce-buffer rule for a GPU cache over the page file
# (csrc/bindings/page_store_binding.cpp, bounce_pages).
_MIN_BOUNCE_PAGES = 16


@dataclasses.dataclass(frozen=True)
class StatePlan:
    """memory_report()'s state fields, predicted."""

    state_bytes: int
    moment_bytes: int
    scale_bytes: int
    residual_bytes: int
    step_bytes: int
    page_slack_bytes: int
    num_pages: int
    page_bytes: int
    # Where the page bytes are once a step has run (memory_report()['state_placement']).
    state_placement: dict[str, int]
    # The paging options resolved for the device: None when every page stays resident.
    offload: Optional[str]
    cache_bytes: Optional[int]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _stream_payload(spec: state_format.StreamSpec, numel: int, row_length: int) -> int:
    """What StreamSpec::bytes_for sums to over a param's segments: one scale per group of a
    row (native.count_groups, the page table's count), one element per element."""
    if spec.per_group:
        return int(native.count_groups(numel, row_length)) * spec.bytes_per_group
    return numel * spec.bytes_per_group // state_format.GROUP_SIZE


def _placement(offload: Optional[str], device: torch.device, all_bytes: int, num_pages: int,
               page_bytes: int, cache_bytes: int, prefetch: int) -> dict[str, int]:
    on_gpu = device.type == "cuda"
    if offload is None:
        return {"device" if on_gpu else "host": all_bytes}
    resident = min(cache_bytes // page_bytes, num_pages) * page_bytes
    if on_gpu:
        if offload == "host":
            return {"device": resident, "pinned_host": all_bytes}
        budget_pages = cache_bytes // page_bytes
        bounce = max(_MIN_BOUNCE_PAGES, budget_pages // 2 + 2 * prefetch + 4)
        return {"device": resident, "pinned_host": min(bounce, num_pages) * page_bytes,
                "nvme": all_bytes}
    return {"host": resident, ("nvme" if offload == "nvme" else "host_tier"): all_bytes}


def plan_state(store: Any, device: torch.device | str) -> StatePlan:
    """The state the StateStore of an optimizer (`optimizer.state_store`, before its first
    step) will have when its params live on `device`; every param of its groups is counted
    as stepped."""
    device = torch.device(device)
    options = store.options
    kinds = store.stream_kinds()
    planned = store.planned_state()  # (kind, elements, row length) per distinct param
    store = paging.store_options(options)
    page_bytes = paging.choose_page_bytes(options, store, kinds, planned)
    native_kinds = [[spec.as_native() for spec in kind] for kind in kinds]
    num_pages = int(native.count_pages(native_kinds, page_bytes,
                                       [(numel, kind, row) for kind, numel, row in planned]))

    stream_bytes = {"moment_bytes": 0, "scale_bytes": 0, "residual_bytes": 0}
    for kind, numel, row in planned:
        for spec in kinds[kind]:
            stream_bytes[state_format.report_field(spec)] += _stream_payload(spec, numel, row)
    moment_bytes, scale_bytes, residual_bytes = stream_bytes.values()
    all_pages = num_pages * page_bytes
    # Every stepped param counts its steps, plain SGD's too (out of sight of state[p]).
    step_bytes = STEP_COUNTER_BYTES * len(planned)
    cache_bytes = store["cache_bytes"] if store is not None else None
    placement = _placement(store["offload"] if store else None, device, all_pages, num_pages,
                           page_bytes, cache_bytes or 0, options.prefetch)
    return StatePlan(
        state_bytes=all_pages + step_bytes,
        moment_bytes=moment_bytes,
        scale_bytes=scale_bytes,
        residual_bytes=residual_bytes,
        step_bytes=step_bytes,
        page_slack_bytes=all_pages - moment_bytes - scale_bytes - residual_bytes,
        num_pages=num_pages,
        page_bytes=page_bytes,
        state_placement=placement,
        offload=store["offload"] if store else None,
        cache_bytes=cache_bytes,
    )
