"""Runs a function on several gloo ranks, each a spawned process, and gathers what they return.

`run_ranks(fn, world_size, *args, tmp_path=...)` calls `fn(rank, world_size, *args)` in
`world_size` processes joined in one gloo process group (a file:// rendezvous under
tmp_path) and returns their results by rank. A rank that raises fails the calling test with
its traceback; collectives time out after a minute, so a rank left waiting for one that
failed cannot hang the run. `fn` must be a module-level function of an importable module
(spawned children import it by name).
"""

from __future__ import annotations

import datetime
import io
import traceback
from typing import Any, Callable

import pytest
import torch

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def _entry(rank: int, world_size: int, init_file: str, fn: Callable[..., Any], args: tuple,
           results: Any) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    try:
        # As bytes: tensors put on a queue as they are are shared with the parent through
        # this process, which is gone by the time the parent reads them.
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        results.put((rank, None, buffer.getvalue()))
    except BaseException as error:  # reported to the test, with where it happened
        results.put((rank, f"{type(error).__name__}: {error}\n{traceback.format_exc()}", None))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, tmp_path: Any,
              timeout: float = 240.0) -> list[Any]:
    """fn(rank, world_size, *args) on each of world_size gloo ranks; the results by rank."""
    init_file = tmp_path / f"rendezvous-{fn.__name__}-{world_size}"
    if init_file.exists():
        init_file.unlink()
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = torch.multiprocessing.start_processes(
        _entry, args=(world_size, str(init_file), fn, args, results), nprocs=world_size,
        join=False, start_method="spawn")
    # Read before joining: a rank cannot exit until the parent has taken what it put.
    outcomes = {}
    for _ in range(world_size):
        rank, error, value = results.get(timeout=timeout)
        outcomes[rank] = (error, value)
    while not processes.join(timeout=timeout):
        pass
    failures = [f"rank {rank}: {error}" for rank, (error, _) in sorted(outcomes.items()) if error]
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    return [torch.load(io.BytesIO(outcomes[rank][1]), weights_only=False)
            for rank in range(world_size)]
