"""The streaming checkpoint file format (docs/checkpoint_format.md): writer and reader.

This module knows bytes, not optimizers: `read_header(file)` and `iter_records(file,
header)` are pure functions over a binary file object (a file on disk or an io.BytesIO),
which check everything they read and raise `CheckpointError` for anything that is not a
well-formed checkpoint; no input makes them allocate more than the file could hold or the
header's own bound on a record. pagedoptim/checkpoint/stream.py moves the records between
these functions and an optimizer's pages.

Layout (all integers little-endian):

    preamble   MAGIC (8 bytes) | u32 version | u32 header length
    header     UTF-8 JSON (see Header) | u32 crc32c of preamble + JSON
    records    one per (param, slot, element range), in the order `expected_records` gives:
               u32 RECORD_MAGIC | u32 param | u32 slot | u32 payload bytes | u64 first element
               | u64 elements | u32 crc32c of the payload | u32 crc32c of the 36 bytes before
               payload: each stream of the slot's bytes for those elements, in header order
    footer     u32 FOOTER_MAGIC | u32 0 | u64 records | u64 payload bytes
               | u32 crc32c of every record header | u32 crc32c of the 28 bytes before
    end of file
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import sys
from typing import Any, BinaryIO, Iterator, Optional

import torch

from pagedoptim._native import native

MAGIC = b"\x89POCKPT\n"  # a high-bit byte and a newline: mangled transfers show at once
FORMAT = "pagedoptim-checkpoint"
# Version 2: a slot's 8-bit groups restart at every row of `row_length` elements (0: flat);
# version 1 (pagedoptim before 0.2) had flat groups only, and reads as row_length 0.
VERSION = 2
READABLE_VERSIONS = (1, 2)
GROUP_SIZE = 32

_PREAMBLE = struct.Struct("<8sII")
_CRC = struct.Struct("<I")
_RECORD = struct.Struct("<IIIIQQII")
_FOOTER = struct.Struct("<IIQQII")
RECORD_MAGIC = 0x43455250  # "PREC"
FOOTER_MAGIC = 0x444E4550  # "PEND"

# Bounds the reader enforces before it allocates anything a header asks for.
MAX_HEADER_BYTES = 64 << 20
MIN_RECORD_BYTES = 4096
MAX_RECORD_BYTES = 64 << 20
MAX_VALUE_TENSOR_BYTES = 1 << 16  # tensors among hyperparameters / plain state, in JSON

_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
    torch.bool)}


class CheckpointError(ValueError):
    """A file that is not a readable pagedoptim checkpoint: foreign, truncated, corrupted or
    of another format version. The message names the file and, past the header, the record."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: Any, where: str) -> torch.dtype:
    if not isinstance(name, str) or name not in _DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {name!r}")
    return _DTYPES[name]


# -- values in JSON --------------------------------------------------------------------------

def encode_value(value: Any, where: str) -> Any:
    """`value` (a hyperparameter, a plain state entry) as JSON. Scalars, strings, lists and
    str-keyed dicts are themselves; tuples, other dicts, non-finite floats and small tensors
    are tagged objects with one '$' key. Anything else raises TypeError naming `where`."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, list):
        return [encode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [encode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode_value(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {"$dict": [[encode_value(k, f"{where} key"), encode_value(v, f"{where}[{k!r}]")]
                          for k, v in value.items()]}
    if isinstance(value, torch.Tensor):
        return {"$tensor": _encode_tensor(value, where)}
    raise TypeError(f"{where} is a {type(value).__name__}, which a streaming checkpoint cannot "
                    "hold (it keeps numbers, strings, lists, tuples, dicts and tensors of up to "
                    f"{MAX_VALUE_TENSOR_BYTES} bytes beside the state streams); use "
                    "state_dict() and torch.save for such state")


def _encode_tensor(tensor: torch.Tensor, where: str) -> dict[str, Any]:
    if tensor.layout != torch.strided or tensor.dtype not in _DTYPES.values():
        raise TypeError(f"{where} is a {tensor.layout} {tensor.dtype} tensor, which a streaming "
                        "checkpoint cannot hold; use state_dict() and torch.save for it")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes > MAX_VALUE_TENSOR_BYTES:
        raise TypeError(f"{where} is a tensor of {nbytes} bytes; beside the state streams a "
                        f"streaming checkpoint holds tensors of up to {MAX_VALUE_TENSOR_BYTES} "
                        "bytes; use state_dict() and torch.save for it")
    raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape),
            "hex": bytes(raw.numpy()).hex()}


def decode_value(obj: Any, where: str) -> Any:
    """The inverse of encode_value; CheckpointError for anything encode_value cannot make."""
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        return obj
    if isinstance(obj, list):
        return [decode_value(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: unexpected JSON value {obj!r}")
    tags = [k for k in obj if k.startswith("$")]
    if not tags:
        return {k: decode_value(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if len(obj) != 1:
        raise CheckpointError(f"{where}: a tagged value must have one key, got {sorted(obj)}")
    tag, body = tags[0], obj[tags[0]]
    if tag == "$float":
        if body not in ("nan", "inf", "-inf"):
            raise CheckpointError(f"{where}: $float must be 'nan', 'inf' or '-inf', got {body!r}")
        return float(body)
    if tag == "$tuple":
        if not isinstance(body, list):
            raise CheckpointError(f"{where}: $tuple must hold a list")
        return tuple(decode_value(v, f"{where}[{i}]") for i, v in enumerate(body))
    if tag == "$dict":
        if not isinstance(body, list) or not all(isinstance(e, list) and len(e) == 2
                                                 for e in body):
            raise CheckpointError(f"{where}: $dict must hold [key, value] pairs")
        result = {}
        for key, value in body:
            key = decode_value(key, f"{where} key")
            try:
                hash(key)
            except TypeError:
                raise CheckpointError(f"{where}: key {key!r} is not hashable") from None
            result[key] = decode_value(value, f"{where}[{key!r}]")
        return result
    if tag == "$tensor":
        return _decode_tensor(body, where)
    raise CheckpointError(f"{where}: unknown tag {tag!r}")


def _decode_tensor(body: Any, where: str) -> torch.Tensor:
    if not isinstance(body, dict) or set(body) != {"dtype", "shape", "hex"}:
        raise CheckpointError(f"{where}: $tensor must have dtype, shape and hex")
    dtype = dtype_of(body["dtype"], where)
    shape = _shape(body["shape"], where)
    numel = math.prod(shape)
    raw = body["hex"]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not isinstance(raw, str) or len(raw) != 2 * numel * itemsize \
            or numel * itemsize > MAX_VALUE_TENSOR_BYTES:
        raise CheckpointError(f"{where}: $tensor hex must hold {numel * itemsize} bytes")
    try:
        data = bytearray.fromhex(raw)
    except ValueError:
        raise CheckpointError(f"{where}: $tensor hex is not hexadecimal") from None
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape).clone()


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > 64 or not all(
            type(n) is int and 0 <= n < 1 << 62 for n in value):
        raise CheckpointError(f"{where}: a shape must be a list of non-negative integers, "
                              f"got {value!r}")
    if math.prod(value) >= 1 << 62:
        raise CheckpointError(f"{where}: shape {value} is too large")
    return tuple(value)


# -- the header ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StreamEntry:
    """One state stream of a slot: its name and its bytes per group of 32 elements (one
    value per group when per_group, like the fp16 scales)."""

    name: str
    dtype: str
    bytes_per_group: int
    per_group: bool

    def byte_range(self, begin: int, end: int, row_length: int = 0) -> tuple[int, int]:
        """Bytes [first, last) of elements [begin, end) (begin a multiple of 32 elements).
        A per-group stream's range runs from the group holding `begin` to the last group
        holding an element before `end`: with groups that restart at every row of
        `row_length` elements (0: flat), a range cut inside a row's last group shares that
        group's scale with the next range."""
        if self.per_group:
            first = _group_at(begin, row_length, round_up=False)
            last = _group_at(end, row_length, round_up=True)
            return first * self.bytes_per_group, max(first, last) * self.bytes_per_group
        return (begin * self.bytes_per_group // GROUP_SIZE,
                end * self.bytes_per_group // GROUP_SIZE)

    def total_bytes(self, numel: int, row_length: int = 0) -> int:
        first, last = self.byte_range(0, numel, row_length)
        return last - first


def _group_at(element: int, row_length: int, round_up: bool) -> int:
    """The index of the group holding `element` (round_up: of the first group at or after
    it), groups of 32 restarting at every row of `row_length` elements (0: one row)."""
    if row_length == 0:
        return -(-element // GROUP_SIZE) if round_up else element // GROUP_SIZE
    row, column = divmod(element, row_length)
    per_row = -(-row_length // GROUP_SIZE)
    in_row = -(-column // GROUP_SIZE) if round_up else column // GROUP_SIZE
    return row * per_row + in_row


def row_grouping(numel: int, row_length: int, streams: Any) -> int:
    """The row length a slot's groups restart at, 0 where they are flat: a slot without
    per-group streams, one row, or rows of whole groups (where both layouts agree)."""
    if (not any(s.per_group for s in streams) or row_length <= 0 or row_length >= numel
            or row_length % GROUP_SIZE == 0):
        return 0
    return row_length


@dataclasses.dataclass(frozen=True)
class SlotEntry:
    """The paged state of one engine slot of a param (SkewAdam's factored params have two:
    the elementwise state and the row / column means)."""

    role: str
    numel: int
    streams: tuple[StreamEntry, ...]
    # The row length its 8-bit groups restart at (row_grouping); 0: flat.
    row_length: int = 0

    @property
    def bytes_per_group(self) -> int:
        return sum(s.bytes_per_group for s in self.streams)


@dataclasses.dataclass(frozen=True)
class ParamEntry:
    """One position in the optimizer's params (param_groups order)."""

    shape: tuple[int, ...]
    dtype: str
    alias_of: Optional[int]  # the first position of a param given twice
    state: Optional[dict[Any, Any]]  # plain entries of optimizer.state[p] ('step', ...)
    hidden_step: Optional[float]  # the step count an algorithm keeps out of state (SGD)
    slots: tuple[SlotEntry, ...]


@dataclasses.dataclass(frozen=True)
class Header:
    algorithm: str  # the optimizer's kind: adamw, sgd, lion, skewadam
    optimizer: str  # its class name, for messages
    stream_format: dict[str, Any]  # state_bits, master_bits, group_size
    record_bytes: int  # the largest payload of a record
    param_groups: list[dict[str, Any]]  # decoded; 'params' holds positions
    params: tuple[ParamEntry, ...]
    other_state: list[tuple[Any, Any]]  # optimizer.state entries not keyed by a param
    saved_with: dict[str, Any]  # informational: the paging settings of the saver

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "algorithm": self.algorithm,
            "optimizer": self.optimizer, "stream_format": self.stream_format,
            "record_bytes": self.record_bytes,
            "param_groups": [encode_value(g, f"param_groups[{i}]")
                             for i, g in enumerate(self.param_groups)],
            "params": [{
                "shape": list(entry.shape), "dtype": entry.dtype, "alias_of": entry.alias_of,
                "state": (None if entry.state is None
                          else encode_value(entry.state, f"state of param {i}")),
                "hidden_step": entry.hidden_step,
                "slots": [{"role": slot.role, "numel": slot.numel,
                           "row_length": slot.row_length, "streams": [
                               dataclasses.asdict(stream) for stream in slot.streams]}
                          for slot in entry.slots]}
                for i, entry in enumerate(self.params)],
            "other_state": [[encode_value(k, "optimizer.state key"),
                             encode_value(v, f"optimizer.state[{k!r}]")]
                            for k, v in self.other_state],
            "saved_with": encode_value(self.saved_with, "saved_with"),
        }


def _field(obj: dict[str, Any], key: str, kind: Any, where: str) -> Any:
    if key not in obj:
        raise CheckpointError(f"{where}: missing '{key}'")
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not any(value is None if k is None else (type(value) is k or (k is float and type(value)
               is int)) for k in kinds):
        raise CheckpointError(f"{where}: '{key}' has the wrong type ({type(value).__name__})")
    return value


def _index(value: Any, limit: int, where: str) -> int:
    if type(value) is not int or not 0 <= value < limit:
        raise CheckpointError(f"{where}: expected an index below {limit}, got {value!r}")
    return value


def _objects(obj: dict[str, Any], key: str, where: str) -> Iterator[tuple[str, dict]]:
    """(where, item) of each item of the list obj[key], which must all be objects."""
    for i, item in enumerate(_field(obj, key, list, where)):
        if not isinstance(item, dict):
            raise CheckpointError(f"{where}[{i}] is not an object")
        yield f"{where}[{i}]", item


def _stream_from_json(raw: dict[str, Any], where: str) -> StreamEntry:
    bytes_per_group = _field(raw, "bytes_per_group", int, where)
    per_group = _field(raw, "per_group", bool, where)
    dtype = _field(raw, "dtype", str, where)
    dtype_of(dtype, where)
    if not 0 < bytes_per_group <= 1024 or (not per_group and bytes_per_group % GROUP_SIZE):
        raise CheckpointError(f"{where}: bytes_per_group {bytes_per_group} is not a stream's")
    return StreamEntry(_field(raw, "name", str, where), dtype, bytes_per_group, per_group)


def _slot_from_json(raw: dict[str, Any], where: str, record_bytes: int,
                    version: int) -> SlotEntry:
    numel = _field(raw, "numel", int, where)
    if not 0 <= numel < 1 << 48:
        raise CheckpointError(f"{where}: numel {numel} is out of range")
    streams = tuple(_stream_from_json(stream, stream_where)
                    for stream_where, stream in _objects(raw, "streams", f"{where} streams"))
    if not streams:
        raise CheckpointError(f"{where} has no streams")
    row_length = _field(raw, "row_length", int, where) if version >= 2 else 0
    if row_length != row_grouping(numel, row_length, streams) or \
            (row_length and numel % row_length):
        raise CheckpointError(f"{where}: row_length {row_length} is not a row grouping of "
                              f"{numel} elements")
    slot = SlotEntry(_field(raw, "role", str, where), numel, streams, row_length)
    if slot.bytes_per_group > record_bytes:
        raise CheckpointError(f"{where}: a group of its streams does not fit a record")
    return slot


def _param_from_json(raw: dict[str, Any], position: int, where: str,
                     record_bytes: int, version: int) -> ParamEntry:
    alias = _field(raw, "alias_of", (int, None), where)
    if alias is not None:
        _index(alias, position, f"{where} alias_of")
    state = _field(raw, "state", (dict, None), where)
    if state is not None:
        state = decode_value(state, f"{where} state")
        if not isinstance(state, dict):
            raise CheckpointError(f"{where}: state must be a dict")
    hidden = _field(raw, "hidden_step", (float, None), where)
    if hidden is not None and not -2.0 ** 63 < hidden < 2.0 ** 63:  # a JSON int may be huge
        raise CheckpointError(f"{where}: hidden_step {hidden!r} is out of range")
    slots = tuple(_slot_from_json(slot, slot_where, record_bytes, version)
                  for slot_where, slot in _objects(raw, "slots", f"{where} slots"))
    return ParamEntry(_shape(_field(raw, "shape", list, where), where),
                      _field(raw, "dtype", str, where), alias, state,
                      None if hidden is None else float(hidden), slots)


def header_from_json(obj: Any) -> Header:
    """Validates a decoded header (CheckpointError naming what is wrong)."""
    if not isinstance(obj, dict):
        raise CheckpointError("the header is not a JSON object")
    if obj.get("format") != FORMAT:
        raise CheckpointError(f"the header's format is {obj.get('format')!r}, not {FORMAT!r}")
    version = obj.get("version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(f"format version {version!r}; this pagedoptim reads versions "
                              f"{READABLE_VERSIONS}")
    algorithm = _field(obj, "algorithm", str, "header")
    optimizer = _field(obj, "optimizer", str, "header")
    stream_format = _field(obj, "stream_format", dict, "header")
    record_bytes = _field(obj, "record_bytes", int, "header")
    if not MIN_RECORD_BYTES <= record_bytes <= MAX_RECORD_BYTES:
        raise CheckpointError(f"header: record_bytes {record_bytes} is outside "
                              f"[{MIN_RECORD_BYTES}, {MAX_RECORD_BYTES}]")
    params = [_param_from_json(raw, i, where, record_bytes, version)
              for i, (where, raw) in enumerate(_objects(obj, "params", "header: params"))]
    groups = []
    for i, raw in enumerate(_field(obj, "param_groups", list, "header")):
        group = decode_value(raw, f"header: param_groups[{i}]")
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise CheckpointError(f"header: param_groups[{i}] has no list of params")
        for position in group["params"]:
            _index(position, len(params), f"header: param_groups[{i}] params")
        groups.append(group)
    other = []
    for i, pair in enumerate(_field(obj, "other_state", list, "header")):
        if not isinstance(pair, list) or len(pair) != 2:
            raise CheckpointError(f"header: other_state[{i}] is not a [key, value] pair")
        key = decode_value(pair[0], f"header: other_state[{i}] key")
        try:
            hash(key)
        except TypeError:
            raise CheckpointError(f"header: other_state[{i}] key {key!r} is not hashable") \
                from None
        if isinstance(key, torch.Tensor):  # tensor keys are params, which have entries
            raise CheckpointError(f"header: other_state[{i}] key is a tensor")
        other.append((key, decode_value(pair[1], f"header: other_state[{i}] value")))
    saved_with = decode_value(_field(obj, "saved_with", dict, "header"), "header: saved_with")
    return Header(algorithm, optimizer, stream_format, record_bytes, groups, tuple(params),
                  other, saved_with)


def write_header(handle: BinaryIO, header: Header) -> None:
    _check_byte_order()
    text = json.dumps(header.to_json(), allow_nan=False, separators=(",", ":")).encode()
    preamble = _PREAMBLE.pack(MAGIC, VERSION, len(text))
    handle.write(preamble)
    handle.write(text)
    handle.write(_CRC.pack(native.crc32c(text, native.crc32c(preamble))))


def read_exact(handle: BinaryIO, view: memoryview, what: str) -> None:
    """Fills `view` from the file; CheckpointError when the file ends first."""
    done = 0
    while done < len(view):
        n = handle.readinto(view[done:])
        if not n:
            raise CheckpointError(f"the file ends inside {what} (truncated)")
        done += n


def _read_bytes(handle: BinaryIO, size: int, what: str) -> bytes:
    buffer = bytearray(size)
    read_exact(handle, memoryview(buffer), what)
    return bytes(buffer)


def _remaining(handle: BinaryIO) -> Optional[int]:
    """Bytes left in the file after the position (None when it cannot seek)."""
    try:
        here = handle.tell()
        end = handle.seek(0, 2)
        handle.seek(here)
    except (OSError, AttributeError):
        return None
    return end - here


def read_header(handle: BinaryIO) -> Header:
    """Reads and checks the preamble and the header from the start of `handle`."""
    _check_byte_order()
    preamble = _read_bytes(handle, _PREAMBLE.size, "the preamble")
    magic, version, length = _PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise CheckpointError("not a pagedoptim streaming checkpoint (its first bytes are "
                              f"{magic!r}; a torch.save file loads with load_state_dict)")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(f"format version {version}; this pagedoptim reads versions "
                              f"{READABLE_VERSIONS}")
    remaining = _remaining(handle)
    if length > MAX_HEADER_BYTES or (remaining is not None and length + _CRC.size > remaining):
        raise CheckpointError(f"the header claims {length} bytes, more than the file holds "
                              "(truncated or corrupted)")
    text = _read_bytes(handle, length, "the header")
    (crc,) = _CRC.unpack(_read_bytes(handle, _CRC.size, "the header's checksum"))
    if crc != native.crc32c(text, native.crc32c(preamble)):
        raise CheckpointError("the header fails its crc32c (corrupted)")
    try:
        obj = json.loads(text.decode("utf-8"), parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CheckpointError(f"the header is not JSON: {error}") from None
    try:
        return header_from_json(obj)
    except RecursionError:
        raise CheckpointError("the header nests too deeply") from None


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# -- records ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RecordSpec:
    """Where one record's payload belongs: elements [begin, begin + count) of slot `slot`
    of the param at position `param`."""

    param: int
    slot: int
    begin: int
    count: int
    payload_bytes: int


def elements_per_record(slot: SlotEntry, record_bytes: int) -> int:
    """Whole groups of the slot's streams, as many as fit in record_bytes, in elements: 32
    a group, or a row's where rows shorter than 32 are groups of their own (longer rows add
    at most one partial group per row crossed, so a payload stays within twice
    record_bytes)."""
    per_group = min(GROUP_SIZE, slot.row_length) if slot.row_length else GROUP_SIZE
    return max(1, record_bytes // slot.bytes_per_group) * per_group


def expected_records(header: Header) -> Iterator[RecordSpec]:
    """The records a checkpoint with this header holds, in file order: params by position,
    their slots in order, each slot's elements in ranges of elements_per_record."""
    for position, entry in enumerate(header.params):
        for index, slot in enumerate(entry.slots):
            step = elements_per_record(slot, header.record_bytes)
            for begin in range(0, slot.numel, step):
                end = min(slot.numel, begin + step)
                payload = sum(last - first for first, last in
                              (s.byte_range(begin, end, slot.row_length) for s in slot.streams))
                yield RecordSpec(position, index, begin, end - begin, payload)


def _groups_in(numel: int, row_length: int) -> int:
    """The groups of a slot of `numel` elements in rows of `row_length` (0: flat)."""
    if row_length == 0:
        return -(-numel // GROUP_SIZE)
    return numel // row_length * -(-row_length // GROUP_SIZE)


def max_payload_bytes(header: Header) -> int:
    """A bound on the largest payload of the file's records, from the slots alone (a record
    of `step` elements touches at most step // row + 2 rows, so that many rows' groups), for
    the buffer the records are read into; iter_records checks each record's own size."""
    bound = 0
    for entry in header.params:
        for slot in entry.slots:
            step = min(slot.numel, elements_per_record(slot, header.record_bytes))
            if slot.row_length:
                per_row = -(-slot.row_length // GROUP_SIZE)
                groups = (step // slot.row_length + 2) * per_row
            else:
                groups = step // GROUP_SIZE + 1
            bound = max(bound, sum(groups * s.bytes_per_group if s.per_group
                                   else step * s.bytes_per_group // GROUP_SIZE
                                   for s in slot.streams))
    return bound


def _least_records_bytes(header: Header) -> int:
    """A lower bound of records_bytes, from the slots alone: every record's header, every
    element's bytes and every group's (records cut inside a group repeat it)."""
    total = _FOOTER.size
    for entry in header.params:
        for slot in entry.slots:
            step = elements_per_record(slot, header.record_bytes)
            total += -(-slot.numel // step) * _RECORD.size
            total += sum(_groups_in(slot.numel, slot.row_length) * s.bytes_per_group
                         if s.per_group else slot.numel * s.bytes_per_group // GROUP_SIZE
                         for s in slot.streams)
    return total


def records_bytes(header: Header) -> int:
    """Bytes of all records and the footer: what follows the header in a whole file."""
    return _FOOTER.size + sum(_RECORD.size + spec.payload_bytes
                              for spec in expected_records(header))


def record_parts(header: Header, spec: RecordSpec) -> Iterator[tuple[str, int, int, int]]:
    """(stream name, byte offset in the stream, byte offset in the payload, bytes) of each
    stream's part of the record's payload."""
    at = 0
    slot = header.params[spec.param].slots[spec.slot]
    for stream in slot.streams:
        first, last = stream.byte_range(spec.begin, spec.begin + spec.count, slot.row_length)
        yield stream.name, first, at, last - first
        at += last - first


def check_length(handle: BinaryIO, header: Header) -> None:
    """Raises CheckpointError unless exactly the header's records and footer follow (a
    truncated or extended file is refused before any record is read)."""
    remaining = _remaining(handle)
    # A header claiming more than the file holds is refused before its records are counted
    # one by one (a crafted numel of 2^47 would take hours to count).
    least = _least_records_bytes(header)
    if remaining is not None and remaining < least:
        raise CheckpointError(f"{remaining} bytes follow the header where its records and "
                              f"footer take at least {least} (truncated)")
    expected = records_bytes(header)
    if remaining is not None and remaining != expected:
        state = "truncated" if remaining < expected else "trailing bytes"
        raise CheckpointError(f"{remaining} bytes follow the header where its records and "
                              f"footer take {expected} ({state})")


class RecordWriter:
    """Writes records after the header, then the footer."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self._records = 0
        self._payload = 0
        self._chain = 0

    def write(self, spec: RecordSpec, payload: memoryview) -> None:
        assert len(payload) == spec.payload_bytes
        head = struct.pack("<IIIIQQI", RECORD_MAGIC, spec.param, spec.slot, spec.payload_bytes,
                           spec.begin, spec.count, native.crc32c(payload))
        head += _CRC.pack(native.crc32c(head))
        self._handle.write(head)
        self._handle.write(payload)
        self._chain = native.crc32c(head, self._chain)
        self._records += 1
        self._payload += spec.payload_bytes

    def finish(self) -> None:
        body = struct.pack("<IIQQI", FOOTER_MAGIC, 0, self._records, self._payload, self._chain)
        self._handle.write(body + _CRC.pack(native.crc32c(body)))


def iter_records(handle: BinaryIO, header: Header, buffer: memoryview
                 ) -> Iterator[tuple[RecordSpec, memoryview]]:
    """Yields each record's spec and its verified payload (a view into `buffer`, valid until
    the next record; `buffer` must hold max_payload_bytes(header)), then checks the footer
    and the end of the file. `handle` is positioned after the header."""
    if len(buffer) < max_payload_bytes(header):
        raise ValueError(f"buffer holds {len(buffer)} bytes; the records need "
                         f"{max_payload_bytes(header)}")
    records = payload_total = chain = 0
    remaining = _remaining(handle)
    for number, spec in enumerate(expected_records(header)):
        where = (f"record {number} (param {spec.param}, slot {spec.slot}, elements "
                 f"{spec.begin}..{spec.begin + spec.count})")
        if remaining is not None and spec.payload_bytes + _RECORD.size > remaining:
            raise CheckpointError(f"{where}: the file ends before it (truncated)")
        head = _read_bytes(handle, _RECORD.size, where)
        magic, param, slot, size, begin, count, payload_crc, head_crc = _RECORD.unpack(head)
        if head_crc != native.crc32c(head[:-_CRC.size]):
            raise CheckpointError(f"{where}: its header fails its crc32c (corrupted)")
        if (magic, param, slot, size, begin, count) != (
                RECORD_MAGIC, spec.param, spec.slot, spec.payload_bytes, spec.begin, spec.count):
            raise CheckpointError(f"{where}: found param {param}, slot {slot}, elements "
                                  f"{begin}..{begin + count} of {size} bytes instead")
        view = buffer[:size]
        read_exact(handle, view, where)
        if native.crc32c(view) != payload_crc:
            raise CheckpointError(f"{where}: its payload fails its crc32c (corrupted)")
        chain = native.crc32c(head, chain)
        records += 1
        payload_total += size
        if remaining is not None:
            remaining -= _RECORD.size + size
        yield spec, view
    footer = _read_bytes(handle, _FOOTER.size, "the footer")
    magic, _, count, total, footer_chain, crc = _FOOTER.unpack(footer)
    if crc != native.crc32c(footer[:-_CRC.size]) or magic != FOOTER_MAGIC:
        raise CheckpointError("the footer is corrupted")
    if (count, total, footer_chain) != (records, payload_total, chain):
        raise CheckpointError(f"the footer counts {count} records of {total} bytes, the file "
                              f"holds {records} of {payload_total}")
    if handle.read(1):
        raise CheckpointError("bytes follow the footer (not one checkpoint)")


def _check_byte_order() -> None:
    # Record payloads are the pages' bytes as they are; the format states little-endian.
    if sys.byteorder != "little":
        raise RuntimeError("streaming checkpoints are little-endian; this machine is not")
