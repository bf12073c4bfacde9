"""
PagedOptim native engine: paged optimizer state and fused step kernels
"""
from __future__ import annotations
import collections.abc
import torch
import typing
import typing_extensions
__all__: list[str] = ['PageCorruptionError', 'PageIOError', 'PagedState', 'count_groups', 'count_pages', 'cpu_isa', 'cpu_runs_isa', 'crc32c', 'cuda_built', 'cuda_version', 'decode_moment', 'decode_second_moment', 'drain_paging', 'encode_moment', 'encode_second_moment', 'fault_counts', 'measure_disk_bandwidth', 'set_fault_rules', 'simulated_device_usage']
class PagedState:
    """
    Paged optimizer state of one optimizer: page table, store, driver.
    """
    def __init__(self, kind: str, kinds: collections.abc.Sequence[collections.abc.Sequence[tuple[str, typing.SupportsInt | typing.SupportsIndex, bool]]], page_bytes: typing.SupportsInt | typing.SupportsIndex, store: typing.Any = None, device: str = 'cpu') -> None:
        """
        kinds: per parameter kind, its streams as (name, bytes per group of 32, per_group); store: None (all pages in memory) or the paging options dict; device: where the pages live and the step runs, 'cpu', 'cuda:N' or 'simulated' (tests)
        """
    def discard_interrupted_step(self) -> None:
        """
        Forgets the interrupted step: its applied pages stay applied, the rest never will.
        """
    def memory_usage(self) -> dict:
        ...
    def paging_stats(self) -> dict:
        """
        Pager counters: hits, misses, bytes per tier, stall seconds, io backend.
        """
    def plan_stream_ranges(self, ranges: collections.abc.Sequence[tuple[typing.SupportsInt | typing.SupportsIndex, str, typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex]]) -> None:
        """
        Announces the (slot, stream, offset, bytes) ranges the coming read_stream_range / write_stream_range calls copy, in that order: a paged store reads ahead of them. An empty list ends the plan.
        """
    def read_stream(self, slot: typing.SupportsInt | typing.SupportsIndex, stream: str) -> torch.Tensor:
        """
        The raw bytes of one state stream of one parameter, in element order.
        """
    def read_stream_range(self, slot: typing.SupportsInt | typing.SupportsIndex, stream: str, offset: typing.SupportsInt | typing.SupportsIndex, out: torch.Tensor) -> None:
        """
        Fills `out` with the stream's bytes from byte `offset` on; pins only the pages of that range, one at a time (checkpoints of state larger than memory).
        """
    def register_param(self, numel: typing.SupportsInt | typing.SupportsIndex, kind: typing.SupportsInt | typing.SupportsIndex = 0, row_length: typing.SupportsInt | typing.SupportsIndex = 0) -> int:
        ...
    def resume_next_step(self) -> None:
        """
        The next step call finishes the interrupted step (same params, slots and groups) instead of starting a new one.
        """
    def set_sigint_before_batch(self, batch: typing.SupportsInt | typing.SupportsIndex) -> None:
        """
        Tests: the next step raises SIGINT in the process right before its batch `batch` (>= 1) of pinned pages, once; -1 disarms.
        """
    def set_vector_loads(self, on: bool) -> None:
        """
        Whether CUDA steps may use the vector bodies (four elements per lane) for aligned rows; off runs every row one element per lane, to measure the difference. The results are the same bits either way.
        """
    def step_adamw(self, params: collections.abc.Sequence[torch.Tensor], grads: collections.abc.Sequence[torch.Tensor], steps: collections.abc.Sequence[torch.Tensor], slots: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], groups: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], hyperparameters: collections.abc.Sequence[tuple[typing.SupportsFloat | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex, bool, bool]], found_inf: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None) -> None:
        ...
    def step_lion(self, params: collections.abc.Sequence[torch.Tensor], grads: collections.abc.Sequence[torch.Tensor], steps: collections.abc.Sequence[torch.Tensor], slots: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], groups: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], hyperparameters: collections.abc.Sequence[tuple[typing.SupportsFloat | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex, bool]], found_inf: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None) -> None:
        ...
    def step_sgd(self, params: collections.abc.Sequence[torch.Tensor], grads: collections.abc.Sequence[torch.Tensor], steps: collections.abc.Sequence[torch.Tensor], slots: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], groups: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], hyperparameters: collections.abc.Sequence[tuple[typing.SupportsFloat | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex, bool, bool]], found_inf: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None) -> None:
        ...
    def step_skewadam(self, params: collections.abc.Sequence[torch.Tensor], grads: collections.abc.Sequence[torch.Tensor], steps: collections.abc.Sequence[torch.Tensor], slots: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], groups: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], hyperparameters: collections.abc.Sequence[tuple[typing.SupportsFloat | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex]], layouts: collections.abc.Sequence[tuple[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex, bool]]) -> None:
        """
        hyperparameters: per group (lr, beta1, beta2, eps, weight_decay); layouts: per param (factor slot or -1, experts, rows, cols, momentum)
        """
    def stream_bytes(self, slot: typing.SupportsInt | typing.SupportsIndex, stream: str) -> int:
        """
        Bytes the stream of the parameter in `slot` holds (its payload, no padding).
        """
    def stream_names(self, slot: typing.SupportsInt | typing.SupportsIndex) -> list[str]:
        """
        Names of the state streams of the parameter in `slot`.
        """
    def write_stream(self, slot: typing.SupportsInt | typing.SupportsIndex, stream: str, bytes: torch.Tensor) -> None:
        ...
    def write_stream_range(self, slot: typing.SupportsInt | typing.SupportsIndex, stream: str, offset: typing.SupportsInt | typing.SupportsIndex, bytes: torch.Tensor) -> None:
        """
        Writes `bytes` into the stream from byte `offset` on (the inverse of read_stream_range).
        """
    @property
    def device(self) -> str:
        ...
    @property
    def interrupted_step(self) -> typing.Any:
        """
        The journal of a step that raised before it finished, or None (docs/reliability.md, 'Steps that fail').
        """
    @property
    def num_params(self) -> int:
        ...
    @property
    def page_bytes(self) -> int:
        ...
    @property
    def stateless(self) -> bool:
        ...
class PageIOError(OSError):
    """
    The page file failed (a full disk, EIO, a short transfer): an OSError whose errno and filename say which. A failed write-back loses no state; state_dict() still works.
    """
class PageCorruptionError(RuntimeError):
    """
    A page read back from the page file failed its crc32c; its bytes were not used.
    """
def count_pages(kinds: collections.abc.Sequence[collections.abc.Sequence[tuple[str, typing.SupportsInt | typing.SupportsIndex, bool]]], page_bytes: typing.SupportsInt | typing.SupportsIndex, params: collections.abc.Sequence[tuple[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex]]) -> int:
    """
    Pages PagedState would lay out for params given as (numel, kind, row_length), each kind's streams as (name, bytes per group of 32, per_group); nothing is allocated.
    """
def count_groups(numel: typing.SupportsInt | typing.SupportsIndex, row_length: typing.SupportsInt | typing.SupportsIndex) -> int:
    """
    Groups of 32 a param of numel elements in rows of row_length (0: one row) has, every row's last group possibly partial: what its per-group streams hold.
    """
def cpu_isa() -> str:
    """
    The ISA of the CPU kernels chosen for this machine.
    """
def cpu_runs_isa(isa: str) -> bool:
    """
    Whether this module has CPU kernels for `isa` ('avx512', 'avx2' or 'baseline') and this CPU can run them.
    """
def crc32c(data: typing_extensions.Buffer, crc: typing.SupportsInt | typing.SupportsIndex = 0) -> int:
    """
    crc32c (Castagnoli) of a contiguous buffer's bytes, continuing `crc`: the page checksum, also the checkpoint records' (pagedoptim/checkpoint/stream.py).
    """
def cuda_built() -> bool:
    """
    Whether this build has the CUDA kernels (params on a GPU can be stepped).
    """
def cuda_version() -> int:
    """
    0: this build has no CUDA kernels.
    """
def decode_moment(codes: torch.Tensor, scales: torch.Tensor, row_length: typing.SupportsInt | typing.SupportsIndex = 0) -> torch.Tensor:
    ...
def decode_second_moment(codes: torch.Tensor, scales: torch.Tensor, row_length: typing.SupportsInt | typing.SupportsIndex = 0) -> torch.Tensor:
    ...
def drain_paging(state: PagedState) -> None:
    """
    Waits until the pager has no I/O in flight.
    """
def encode_moment(values: torch.Tensor, row_length: typing.SupportsInt | typing.SupportsIndex = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Companded int8 codes and fp16 group scales of first-moment values; groups of 32 restart at every row of row_length values (0: one row).
    """
def encode_second_moment(values: torch.Tensor, row_length: typing.SupportsInt | typing.SupportsIndex = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """
    uint8 codes of sqrt(v) and fp16 group scales of second-moment values, in rows as encode_moment.
    """
def fault_counts(state: PagedState) -> list[int]:
    """
    How often each injected fault rule fired.
    """
def measure_disk_bandwidth(dir: str, file_bytes: typing.SupportsInt | typing.SupportsIndex = 268435456, block_bytes: typing.SupportsInt | typing.SupportsIndex = 1048576, queue_depth: typing.SupportsInt | typing.SupportsIndex = 16, backend: str = 'auto') -> dict:
    """
    Sequential write, sequential read, then mixed bandwidth (first half read while the second is written, on one queue; mixed_gb_per_s counts both) of a scratch file of at least two blocks in `dir`, through the same io engines the page file uses (GB/s = 1e9 B/s).
    """
def set_fault_rules(state: PagedState, rules: typing.Any) -> None:
    """
    Replaces the injected faults of a paged state's page file (tests only).
    """
def simulated_device_usage() -> dict:
    """
    What the simulated device (pagedoptim.paging.simulated_device()) holds now: device and pinned host bytes and allocations, streams, events.
    """
