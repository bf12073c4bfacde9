"""save_checkpoint / load_checkpoint: an optimizer's state to a file and back, page by page.

state_dict() gathers every moment into memory, so state larger than RAM (what NVMe paging
is for) cannot be saved through it. These functions move the state between the engine's
pages and a file (pagedoptim/checkpoint/format.py, docs/checkpoint_format.md) one record
at a time: a record holds every stream of one element range of one param (about one page
of state), read from / written to the pages with PagedState.read_stream_range /
write_stream_range, which pin one page at a time. Memory beyond the optimizer's own page
cache: one record buffer (record_bytes, the optimizer's page size) and the header (a few
hundred bytes per param). See docs/reliability.md, "Checkpoints".
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from typing import Any, Iterator, Optional, Union

import torch

from pagedoptim.checkpoint import atomic_file, format as checkpoint_format

from pagedoptim.engine.state_store import state_shape
from pagedoptim.state import format as state_format
from pagedoptim.state import sharding as sharded_params
from pagedoptim.checkpoint.format import (CheckpointError, Header, ParamEntry, SlotEntry,
                                          StreamEntry, dtype_name)
from pagedoptim.state.param_state import ParamState

PathLike = Union[str, os.PathLike]

# Records of at most this many bytes when the optimizer has no engine yet (no state).
DEFAULT_RECORD_BYTES = 2 << 20


def _check_local(store: Any, action: str) -> None:
    for index, p in enumerate(store.params()):
        if sharded_params.is_dtensor(p):
            raise ValueError(f"{action}: param {index} is a DTensor; a streaming checkpoint "
                             "holds one process's state, and sharded state is saved with "
                             "torch.distributed.checkpoint (pagedoptim.dcp)")


def _stream_entries(specs: list[Any]) -> tuple[StreamEntry, ...]:
    return tuple(StreamEntry(spec.name, dtype_name(spec.dtype), spec.bytes_per_group,
                             spec.per_group) for spec in specs)


def _slot_entry(role: str, numel: int, specs: list[Any], row_length: int) -> SlotEntry:
    streams = _stream_entries(specs)
    return SlotEntry(role, numel, streams,
                     checkpoint_format.row_grouping(numel, row_length, streams))


def _stream_format(store: Any) -> dict[str, Any]:
    return {"state_bits": store.options.state_bits, "master_bits": store.options.master_bits,
            "group_size": checkpoint_format.GROUP_SIZE}


def _build_header(store: Any, state_map: Any) -> tuple[Header, list[list[int]]]:
    """The header of the checkpoint of `store` and `state_map` (its optimizer's state), and
    per position the engine slots of its records."""
    opt = store.optimizer
    params = store.params()
    first_position: dict[int, int] = {}
    entries, engine_slots = [], []
    for position, p in enumerate(params):
        alias = first_position.setdefault(id(p), position)
        value = dict.get(state_map, p)  # dict.get: no entry is made for p
        slots: list[SlotEntry] = []
        numbers: list[int] = []
        if alias == position:
            for role, slot, numel, specs, row_length in store.checkpoint_slots(p):
                slots.append(_slot_entry(role, numel, specs, row_length))
                numbers.append(slot)
        state = hidden = None
        if alias == position and isinstance(value, ParamState):
            state = value.plain_items()
            hidden = value.hidden_step()
        entries.append(ParamEntry(tuple(sharded_params.local_tensor(p).shape),
                                  dtype_name(p.dtype), None if alias == position else alias,
                                  state, hidden, tuple(slots)))
        engine_slots.append(numbers)
    groups = []
    for group in opt.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [first_position[id(p)] for p in group["params"]]
        groups.append(packed)
    other = [(k, v) for k, v in state_map.items() if not isinstance(k, torch.Tensor)]
    record_bytes = store.page_bytes if store.page_bytes is not None else DEFAULT_RECORD_BYTES
    record_bytes = min(max(record_bytes, checkpoint_format.MIN_RECORD_BYTES),
                       checkpoint_format.MAX_RECORD_BYTES)
    saved_with = {"offload": store.paging_stats().get("offload"),
                  "page_bytes": store.page_bytes}
    header = Header(store.algorithm, type(opt).__name__, _stream_format(store), record_bytes,
                    groups, tuple(entries), other, saved_with)
    return header, engine_slots


def save(store: Any, state_map: Any, path: PathLike) -> None:
    """optimizer.save_checkpoint(path) of the optimizer of `store` and `state_map` (its
    synced optimizer.state): see PagedOptimizer.save_checkpoint."""
    _check_local(store, "save_checkpoint")
    path = pathlib.Path(path)
    header, engine_slots = _build_header(store, state_map)
    buffer = torch.empty(checkpoint_format.max_payload_bytes(header), dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    # Each record with its reads: (engine slot, stream, offset in the stream, offset in the
    # payload, bytes).
    records = [(spec, [(engine_slots[spec.param][spec.slot], name, offset, at, size)
                       for name, offset, at, size in checkpoint_format.record_parts(header, spec)])
               for spec in checkpoint_format.expected_records(header)]
    with atomic_file.atomic_write(path) as handle, _reading_ahead(store.engine, records):
        checkpoint_format.write_header(handle, header)
        writer = checkpoint_format.RecordWriter(handle)
        for spec, reads in records:
            for engine_slot, name, offset, at, size in reads:
                store.engine.read_stream_range(engine_slot, name, offset,
                                               buffer[at:at + size])
            writer.write(spec, view[:spec.payload_bytes])
        writer.finish()


@contextlib.contextmanager
def _reading_ahead(engine: Any, records: list[tuple[Any, list[tuple]]]) -> Iterator[None]:
    """The pages of the records' reads, in record order, as the page store's plan while
    they are read: a store paged to NVMe reads ahead of the copies (with the engine's
    prefetch depth) while this thread writes the file, where it would otherwise read each
    page only when its record reaches it. The plan ends with the save, whether it completes
    or raises."""
    if engine is None or not records:
        yield
        return
    engine.plan_stream_ranges([(engine_slot, name, offset, size)
                               for _, reads in records
                               for engine_slot, name, offset, _, size in reads])
    try:
        yield
    finally:
        engine.plan_stream_ranges([])


def read_header(path: PathLike) -> Header:
    """The checked header of the checkpoint at `path` (CheckpointError naming the file)."""
    path = pathlib.Path(path)
    with open(path, "rb") as handle:
        try:
            return checkpoint_format.read_header(handle)
        except CheckpointError as error:
            raise CheckpointError(f"{path}: {error}") from None


def verify(path: PathLike) -> Header:
    """Reads the whole checkpoint at `path`, checking every record; returns its header."""
    path = pathlib.Path(path)
    with open(path, "rb") as handle:
        try:
            header = checkpoint_format.read_header(handle)
            checkpoint_format.check_length(handle, header)
            buffer = memoryview(bytearray(checkpoint_format.max_payload_bytes(header)))
            for _ in checkpoint_format.iter_records(handle, header, buffer):
                pass
        except CheckpointError as error:
            raise CheckpointError(f"{path}: {error}") from None
    return header


def _is_step_count(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_matches(store: Any, header: Header, path: pathlib.Path) -> None:
    """What the header says must fit the store's optimizer before anything is loaded."""
    opt = store.optimizer
    name = type(opt).__name__
    if header.algorithm != store.algorithm:
        raise ValueError(f"{path} holds the state of a {header.optimizer} ('{header.algorithm}'), "
                         f"not of a {name} ('{store.algorithm}')")
    ours = _stream_format(store)
    differences = [f"{key} {header.stream_format.get(key)!r} in the checkpoint, {ours[key]!r} "
                   "here" for key in ours if header.stream_format.get(key) != ours[key]]
    differences += [f"{key} {value!r} in the checkpoint, unknown here"
                    for key, value in header.stream_format.items() if key not in ours]
    if differences:
        raise ValueError(f"{path} was saved in another state format ({'; '.join(differences)}): "
                         "a streaming checkpoint loads into the stream format that saved it. "
                         "To convert between formats, load it into an optimizer of its format "
                         f"and move the state with state_dict() / load_state_dict()")
    groups = opt.param_groups
    if len(groups) != len(header.param_groups):
        raise ValueError(f"{path} has {len(header.param_groups)} parameter groups, this "
                         f"{name} has {len(groups)}")
    for index, (group, saved) in enumerate(zip(groups, header.param_groups)):
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(f"{path}: parameter group {index} has {len(saved['params'])} "
                             f"params in the checkpoint, {len(group['params'])} here")
    params = store.params()
    if len(params) != len(header.params):
        raise ValueError(f"{path} holds {len(header.params)} params, this {name} has "
                         f"{len(params)}")
    first_position: dict[int, int] = {}
    for position, (p, entry) in enumerate(zip(params, header.params)):
        alias = first_position.setdefault(id(p), position)
        shape = tuple(sharded_params.local_tensor(p).shape)
        if entry.shape != shape or entry.dtype != dtype_name(p.dtype):
            raise ValueError(f"{path}: param {position} is {list(entry.shape)} {entry.dtype} "
                             f"in the checkpoint, {list(shape)} {dtype_name(p.dtype)} here")
        if (entry.alias_of is None) != (alias == position) or (
                entry.alias_of is not None and entry.alias_of != alias):
            raise ValueError(f"{path}: param {position} is given twice in one optimizer but "
                             "not in the other")
    for position, entry in enumerate(header.params):
        step = (entry.state or {}).get("step")
        if step is not None and not _is_step_count(step):
            raise CheckpointError(f"{path}: the step of param {position} is {step!r}, not a "
                                  "number or a one-element real tensor")
    for index, saved in enumerate(header.param_groups):
        positions = saved["params"]
        ours_positions = [first_position[id(p)] for p in groups[index]["params"]]
        if positions != ours_positions:
            raise ValueError(f"{path}: parameter group {index} lists params {positions} in "
                             f"the checkpoint, {ours_positions} here")


def _check_slots(store: Any, p: torch.Tensor, position: int, entry: ParamEntry,
                 path: pathlib.Path) -> list[Optional[int]]:
    """The engine slots the staging store gave p, checked against the saved ones; None for
    a slot saved in another layout of the same state (8-bit moments where this optimizer
    keeps fp32 ones or the reverse, as min_8bit_size decides; or the flat groups of
    version 1), which the reader converts through the store (`Reader.read_streams`)."""
    store.slot(p)
    ours = [(role, slot, _slot_entry(role, numel, specs, row))
            for role, slot, numel, specs, row in store.checkpoint_slots(p)]
    mine = [slot for _, _, slot in ours]
    if mine == list(entry.slots):
        return [number for _, number, _ in ours]
    known = _known_streams(store)
    convertible = (
        [(s.role, s.numel) for s in mine] == [(s.role, s.numel) for s in entry.slots]
        and all(a == b or (a.role == "state" and all(s in known for s in a.streams))
                for a, b in zip(entry.slots, mine)))
    if not convertible:
        describe = lambda slots: [(slot.role, slot.numel,  # noqa: E731
                                   [s.name for s in slot.streams]) for slot in slots]
        raise ValueError(f"{path}: param {position} keeps state {describe(entry.slots)} in "
                         f"the checkpoint, this optimizer lays out {describe(mine)} for it "
                         "with the checkpoint's hyperparameters")
    return [number if saved == slot else None
            for (_, number, slot), saved in zip(ours, entry.slots)]


def _known_streams(store: Any) -> set[StreamEntry]:
    """Every stream a slot of this algorithm's state can hold, in any state format: what a
    saved slot in another layout may have (a name with another dtype or size is refused
    before any byte is read as it)."""
    specs = [state_format.residual_stream(bits) for bits in (24, 32)]
    for moment in store.all_moments():
        for bits in (8, 32):
            specs += state_format.moment_streams(moment, bits)
    return set(_stream_entries(specs))


class _Conversion:
    """The streams of one saved slot gathered from its records, for a slot whose layout
    differs from the store's: written through store.write_streams, which converts (decodes
    8-bit moments to fp32, encodes fp32 ones, re-groups flat groups in rows)."""

    def __init__(self, slot: SlotEntry) -> None:
        self.slot = slot
        self.buffers = {stream.name: torch.empty(stream.total_bytes(slot.numel, slot.row_length),
                                                 dtype=torch.uint8)
                        for stream in slot.streams}

    def write(self, name: str, offset: int, payload: torch.Tensor) -> None:
        self.buffers[name][offset:offset + payload.numel()] = payload

    def given(self, shape: torch.Size) -> dict[str, torch.Tensor]:
        """The saved streams as tensors: element streams shaped like the state, scales in
        their saved layout (flat where the saved groups were: state_format.is_flat_layout
        tells them apart by that)."""
        given = {}
        for stream in self.slot.streams:
            values = self.buffers[stream.name].view(
                checkpoint_format.dtype_of(stream.dtype, stream.name))
            if not stream.per_group:
                values = values.view(shape)
            elif self.slot.row_length or len(shape) < 2:
                values = values.view(state_format.group_shape(shape))
            given[stream.name] = values
        return given


class Reader:
    """A checkpoint file opened for optimizer.load_checkpoint, its header read and checked
    against the optimizer of `store` (the params, their groups, the state format) before
    anything is loaded. The optimizer validates `param_groups` (the saved groups), builds a
    fresh store, and has the reader fill it (`read_streams`, `other_state`,
    `plain_state`); a file that turns out bad midway raises CheckpointError and the
    optimizer's load is undone."""

    def __init__(self, store: Any, path: PathLike) -> None:
        _check_local(store, "load_checkpoint")
        self.path = pathlib.Path(path)
        self._handle = open(self.path, "rb")
        try:
            try:
                self.header = checkpoint_format.read_header(self._handle)
                checkpoint_format.check_length(self._handle, self.header)
            except CheckpointError as error:
                raise CheckpointError(f"{self.path}: {error}") from None
            _check_matches(store, self.header, self.path)
        except BaseException:
            self._handle.close()
            raise

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._handle.close()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return list(self.header.param_groups)

    def read_streams(self, store: Any) -> None:
        """Lays out the state of every saved param in `store` (a fresh one, over the
        checkpoint's groups), checks it against the saved layout, and reads every record
        into its pages."""
        params = store.params()
        slots: dict[int, list[Optional[int]]] = {}
        conversions: dict[tuple[int, int], _Conversion] = {}
        for position, entry in enumerate(self.header.params):
            if entry.slots:
                slots[position] = _check_slots(store, params[position], position, entry,
                                               self.path)
                for index, number in enumerate(slots[position]):
                    if number is None:
                        conversions[position, index] = _Conversion(entry.slots[index])
        buffer = torch.empty(checkpoint_format.max_payload_bytes(self.header), dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        try:
            for spec, payload in checkpoint_format.iter_records(self._handle, self.header, view):
                engine_slot = slots[spec.param][spec.slot]
                conversion = conversions.get((spec.param, spec.slot))
                for name, offset, at, size in checkpoint_format.record_parts(self.header, spec):
                    if conversion is not None:
                        conversion.write(name, offset, buffer[at:at + size])
                    else:
                        store.engine.write_stream_range(engine_slot, name, offset,
                                                        buffer[at:at + size])
        except CheckpointError as error:
            raise CheckpointError(f"{self.path}: {error}") from None
        for (position, _), conversion in conversions.items():
            p = params[position]
            store.write_streams(p, conversion.given(state_shape(p)), complete=True,
                                where=f"{self.path}: state of param {position}")

    def other_state(self) -> list[tuple[Any, Any]]:
        """The saved state entries whose keys are not params."""
        return list(self.header.other_state)

    def plain_state(self, step_in_state: bool) -> Iterator[tuple[int, dict[Any, Any], bool]]:
        """(position, entries other than streams, whether it has streams) of every saved
        param with state; its step where the optimizer keeps it (step_in_state), or its
        hidden step as 'step' for an algorithm that keeps it out of sight."""
        for position, entry in enumerate(self.header.params):
            if entry.state is None:
                continue
            entries = dict(entry.state)
            if not step_in_state:
                entries.pop("step", None)
                if entry.hidden_step is not None:
                    entries["step"] = entry.hidden_step
            yield position, entries, bool(entry.slots)
