"""Interleaved wall-clock timing: the one way bench and the benchmark scripts time a step.

Absolute times on shared machines drift by tens of percent between runs, so candidates are
timed taking turns in the same rounds and compared by medians, never one after the other.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of the timed (post-warmup) repetitions of one callable."""

    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def min(self) -> float:
        return min(self.seconds)


def synchronize(device: torch.device | str = "cpu") -> None:
    """Wait for queued device work so a timer brackets the work, not its launch."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    candidates: Mapping[str, Callable[[], Any]],
    *,
    warmup: int,
    repeats: int,
    device: torch.device | str = "cpu",
    on_round: Callable[[], None] | None = None,
) -> dict[str, Timing]:
    """Time each callable `repeats` times, taking turns, after `warmup` untimed calls each.

    Taking turns (one call of each candidate per round) exposes all candidates to the same
    drift in clock speed and memory traffic from neighbours; timing one candidate to completion
    before the next would turn that drift into a fake speed difference. The order rotates each
    round so no candidate always runs right after the same other one (caches, page faults).

    `on_round`, when given, is called after each warmup and each timed round (a progress
    display), outside the timed region.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
        if on_round is not None:
            on_round()
    synchronize(device)

    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            candidates[name]()
            synchronize(device)
            samples[name].append(time.perf_counter() - start)
        if on_round is not None:
            on_round()
    return {name: Timing(tuple(values)) for name, values in samples.items()}
