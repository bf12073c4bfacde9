"""Fuzzer of PagedOptimizer.load_state_dict (and, with --target load_checkpoint, of
load_checkpoint): a valid state_dict, mutated by the bytes of a fuzz input (or a valid
checkpoint file, damaged by them), loaded into a stepped optimizer in this process.

What each input must show (else `check` raises FuzzFailure, and a crash ends the process):
- load_state_dict either loads, or raises ValueError or TypeError;
- after a load, the optimizer steps without an error (what it accepted, it can run);
- after a refused load, the optimizer is exactly as before (state_dict and params, bit for
  bit) and still steps.

An input is a byte string, decoded by `decode` (deterministic, total: every byte string is a
valid input, extra bytes are ignored and missing ones read as 0):
  byte 0         the mode (state_dict_cases.MODES, in order) of the saved and the loading
                 optimizer
  then, repeated the mutation kind (byte % len(MUTATIONS)) and the bytes that kind reads
                 (see each `_mutate_*`): which param, which key, which value.

Run it (from the repository root):
  PYTHONPATH=python python tests/fuzz/fuzz_load_state_dict.py -max_total_time=600 \
      tests/fuzz/corpus/load_state_dict
With atheris installed this is coverage-guided libFuzzer (its flags apply; a crashing or
failing input is written to ./crash-*, add it to the corpus). Without atheris it runs
random inputs: `--runs N --seed S --max-seconds T`. `--replay FILE...` runs given inputs.

Adding a target: write a `check_*(data)` that builds its input from the bytes and checks
the same three properties (as check_checkpoint does), add it to TARGETS below with its own
corpus directory (tests/fuzz/corpus/<target>/); tests/python/test_fuzz_load_state_dict.py
replays and runs every entry of TARGETS.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import math
import os
import pathlib
import random
import sys
import time
import warnings
from typing import Any, Callable

import torch

try:
    import atheris
except ImportError:
    atheris = None
if atheris is not None and __name__ == "__main__" \
        and not {"--random", "--replay"} & set(sys.argv):
    # Coverage for libFuzzer: pagedoptim's Python code only (instrumenting torch as well
    # takes minutes at startup and guides nothing here).
    with atheris.instrument_imports(include=["pagedoptim"]):
        import pagedoptim  # noqa: F401

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import state_dict_cases  # noqa: E402

EXPECTED_ERRORS = (ValueError, TypeError)
MODE_NAMES = list(state_dict_cases.MODES)


class FuzzFailure(AssertionError):
    """An input broke one of the properties (not a refused load, which is fine)."""


class _Reader:
    """The fuzz input as a stream of small numbers; reads past its end give 0."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def byte(self) -> int:
        value = self.data[self.at] if self.at < len(self.data) else 0
        self.at += 1
        return value

    def pick(self, options: list[Any]) -> Any:
        return options[self.byte() % len(options)] if options else None

    def more(self) -> bool:
        return self.at < len(self.data)


# -- mutations: each takes the reader and the state_dict (a deep copy) and changes it -------

def _entries(sd: dict[str, Any]) -> list[tuple[Any, Any]]:
    """(param key, state key) of every state entry, in a fixed order."""
    return [(index, key) for index, value in sorted(sd["state"].items(), key=lambda kv: repr(kv[0]))
            if isinstance(value, dict) for key in sorted(value, key=repr)]


def _is_plain(value: Any) -> bool:
    """A dense tensor with data: what mutations may read. (A hostile sparse tensor, one
    mutation's output, must not be read by the next: cloning it crashes the fuzzer itself.)"""
    return (isinstance(value, torch.Tensor) and value.layout == torch.strided
            and not value.is_meta and not value.is_quantized)


def _tensors(sd: dict[str, Any]) -> list[tuple[Any, Any]]:
    return [(i, k) for i, k in _entries(sd) if _is_plain(sd["state"][i][k])]


def _mutate_drop(r: _Reader, sd: dict[str, Any]) -> None:
    entry = r.pick(_entries(sd))
    if entry is not None:
        del sd["state"][entry[0]][entry[1]]


def _mutate_rename(r: _Reader, sd: dict[str, Any]) -> None:
    """Moves a value under another key that some optimizer uses (codes without scales, a
    momentum buffer in AdamW, ...)."""
    entry = r.pick(_entries(sd))
    names = ["exp_avg", "exp_avg_sq", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes",
             "exp_avg_sq_scales", "max_exp_avg_sq", "momentum_buffer", "momentum_buffer_codes",
             "master_residual", "exp_avg_sq_row", "exp_avg_sq_col", "step", "other"]
    target = r.pick(names)
    if entry is not None:
        state = sd["state"][entry[0]]
        value = state[entry[1]] if r.byte() % 2 else state.pop(entry[1])
        state[target] = value


def _hostile_sparse(like: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.sparse_coo_tensor(torch.tensor([[like.numel() + 1000]]),
                                       torch.tensor([1.0]), (max(like.numel(), 1),),
                                       check_invariants=False)


_REPLACEMENTS: list[Callable[[Any], Any]] = [
    lambda v: None,
    lambda v: 3,
    lambda v: 2.5,
    lambda v: "x",
    lambda v: [1, 2],
    lambda v: {},
    lambda v: float("nan"),
    lambda v: -1,
    lambda v: True,
    lambda v: v.float() if isinstance(v, torch.Tensor) else v,
    lambda v: v.to(torch.int64) if isinstance(v, torch.Tensor) else v,
    lambda v: v.to(torch.float16) if isinstance(v, torch.Tensor) else v,
    lambda v: v.bool() if isinstance(v, torch.Tensor) else v,
    lambda v: torch.complex(v.float(), v.float()) if isinstance(v, torch.Tensor) else v,
    lambda v: torch.empty(v.shape, dtype=v.dtype, device="meta")
    if isinstance(v, torch.Tensor) else v,
    lambda v: _hostile_sparse(v) if isinstance(v, torch.Tensor) else v,
    lambda v: v.float().to_sparse() if isinstance(v, torch.Tensor) and v.dim() > 0 else v,
    lambda v: torch.zeros(1, dtype=v.dtype).expand(1 << 40)
    if isinstance(v, torch.Tensor) else v,
    lambda v: torch.full_like(v, float("nan")) if isinstance(v, torch.Tensor)
    and v.is_floating_point() else v,
    lambda v: torch.full_like(v, float("-inf")) if isinstance(v, torch.Tensor)
    and v.is_floating_point() else v,
    lambda v: -v if isinstance(v, torch.Tensor) and v.dtype != torch.bool else v,
    lambda v: torch.quantize_per_tensor(v.float(), 0.1, 0, torch.qint8)
    if isinstance(v, torch.Tensor) else v,
    lambda v: torch.tensor([1.0, 2.0]),
    lambda v: torch.tensor(float("inf")),
]


def _mutate_retype(r: _Reader, sd: dict[str, Any]) -> None:
    entry = r.pick(_entries(sd))
    replace = r.pick(_REPLACEMENTS)
    if entry is not None:
        state = sd["state"][entry[0]]
        value = state[entry[1]]
        if _is_plain(value) or not isinstance(value, torch.Tensor):
            state[entry[1]] = replace(value)


def _mutate_flip_bits(r: _Reader, sd: dict[str, Any]) -> None:
    """Flips up to 4 bits of one tensor's bytes (byte offset and bit from the input)."""
    entry = r.pick(_tensors(sd))
    if entry is None:
        return
    state = sd["state"][entry[0]]
    tensor = state[entry[1]].detach().clone().contiguous()
    raw = tensor.reshape(-1).view(torch.uint8)
    for _ in range(1 + r.byte() % 4):
        if raw.numel():
            offset = (r.byte() * 256 + r.byte()) % raw.numel()
            raw[offset] ^= 1 << (r.byte() % 8)
    state[entry[1]] = tensor


def _mutate_shape(r: _Reader, sd: dict[str, Any]) -> None:
    entry = r.pick(_tensors(sd))
    if entry is None:
        return
    state = sd["state"][entry[0]]
    v = state[entry[1]]
    k = 1 + r.byte() % 40
    how = r.byte() % 6
    if how == 0 and v.numel():
        v = v.reshape(-1)[:-min(k, v.numel())]  # truncated
    elif how == 1:
        v = torch.cat([v.reshape(-1), v.reshape(-1)[:k]]) if v.numel() else v.reshape(k * 0)
    elif how == 2:
        v = v.reshape(-1)
    elif how == 3 and v.dim() >= 2:
        v = v.t()  # non-contiguous, same elements in another order
    elif how == 4 and v.numel() >= 2:
        v = v.reshape(-1)[::2]  # non-contiguous and half the size
    elif how == 5:
        v = v.reshape(1, *v.shape)
    state[entry[1]] = v


def _mutate_groups(r: _Reader, sd: dict[str, Any]) -> None:
    groups = sd["param_groups"]
    how = r.byte() % 7
    if how == 0 and len(groups) >= 2:
        groups[0], groups[1] = groups[1], groups[0]
    elif how == 1 and groups:
        groups.pop(r.byte() % len(groups))
    elif how == 2 and groups:
        groups.append(copy.deepcopy(groups[r.byte() % len(groups)]))
    elif how == 3 and groups:
        group = groups[r.byte() % len(groups)]
        group["params"] = group["params"] + group["params"]
    elif how == 4 and groups:
        groups[r.byte() % len(groups)]["params"] = [r.pick([99, -1, "p", None, 1.5, (0,)])]
    elif how == 5 and len(groups) >= 2:
        groups[0]["params"], groups[1]["params"] = groups[1]["params"], groups[0]["params"]
    elif how == 6:
        sd["param_groups"] = r.pick([None, {}, "x", [1], [{}]])


def _mutate_hyperparameter(r: _Reader, sd: dict[str, Any]) -> None:
    groups = [g for g in sd["param_groups"] if isinstance(g, dict)]
    group = r.pick(groups)
    if group is None:
        return
    key = r.pick(sorted(k for k in group if k != "params"))
    value = r.pick([None, -1.0, float("nan"), float("inf"), "x", (0.9,), (2.0, 0.5),
                    torch.tensor([1.0, 2.0]), True, 0, [], {"a": 1}, ("a", "b")])
    if key is not None:
        if r.byte() % 4 == 0:
            del group[key]
        else:
            group[key] = value


def _mutate_state_keys(r: _Reader, sd: dict[str, Any]) -> None:
    """Param entries swapped, moved to another index, dropped, or replaced whole."""
    state = sd["state"]
    keys = sorted(state, key=repr)
    how = r.byte() % 5
    if how == 0 and len(keys) >= 2:
        state[keys[0]], state[keys[1]] = state[keys[1]], state[keys[0]]
    elif how == 1 and keys:
        state[r.pick([7, -1, "w", 1.5])] = state.pop(r.pick(keys))
    elif how == 2 and keys:
        del state[r.pick(keys)]
    elif how == 3 and keys:
        state[r.pick(keys)] = r.pick([None, 3, "x", [], torch.zeros(3)])
    elif how == 4:
        sd["state"] = r.pick([None, [], "x", 5])


def _mutate_other_algorithm(r: _Reader, sd: dict[str, Any]) -> None:
    """The state (or the groups, or both) of another mode's optimizer."""
    other = _valid_state_dict(r.pick(MODE_NAMES))
    how = r.byte() % 3
    if how in (0, 2):
        sd["state"] = other["state"]
    if how in (1, 2):
        sd["param_groups"] = other["param_groups"]


def _mutate_structure(r: _Reader, sd: dict[str, Any]) -> None:
    how = r.byte() % 3
    if how == 0:
        sd.pop(r.pick(["state", "param_groups"]), None)
    elif how == 1:
        sd["extra"] = r.pick([1, None, torch.zeros(2)])
    else:
        sd["state"] = {**sd["state"], "not_a_param": r.pick([1, "x", torch.zeros(2)])}


MUTATIONS = [_mutate_drop, _mutate_rename, _mutate_retype, _mutate_flip_bits, _mutate_shape,
             _mutate_groups, _mutate_hyperparameter, _mutate_state_keys, _mutate_other_algorithm,
             _mutate_structure]
MAX_MUTATIONS = 6

_VALID: dict[str, dict[str, Any]] = {}


def _valid_state_dict(mode: str) -> dict[str, Any]:
    """A deep copy of mode's saved state_dict (made once per process)."""
    if mode not in _VALID:
        opt = state_dict_cases.make(mode, seed=1)
        _VALID[mode] = opt.state_dict()
        opt.close()
    return copy.deepcopy(_VALID[mode])


def decode(data: bytes) -> tuple[str, dict[str, Any]]:
    """The mode and the mutated state_dict that `data` stands for."""
    reader = _Reader(data)
    mode = reader.pick(MODE_NAMES)
    sd = _valid_state_dict(mode)
    for _ in range(MAX_MUTATIONS):
        if not reader.more():
            break
        mutation = MUTATIONS[reader.byte() % len(MUTATIONS)]
        try:
            mutation(reader, sd)
        except (KeyError, TypeError, AttributeError, IndexError, RuntimeError, ValueError):
            continue  # a mutation that does not apply to what earlier ones left
    return mode, sd


def _load_and_step(mode: str, what: str, load: Callable[[Any], None]) -> None:
    """The properties of the module doc for one load: `load(opt)` on a fresh, stepped
    optimizer of `mode` loads or raises an expected error; a refused load leaves the
    optimizer as it was; either way the optimizer then steps."""
    opt = state_dict_cases.make(mode, seed=2, steps=1)
    try:
        before = state_dict_cases.snapshot(opt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                load(opt)
            except EXPECTED_ERRORS:
                if state_dict_cases.snapshot(opt) != before:
                    raise FuzzFailure(f"{mode}: a refused {what} changed the optimizer")
            except Exception as error:
                raise FuzzFailure(f"{mode}: {what} raised {type(error).__name__}: "
                                  f"{error}") from error
            try:
                state_dict_cases.step(opt, seed=3)
            except Exception as error:
                raise FuzzFailure(f"{mode}: the step after {what} raised "
                                  f"{type(error).__name__}: {error}") from error
    finally:
        opt.close()


def check(data: bytes) -> None:
    """Loads decode(data) into a fresh, stepped optimizer of its mode: see the module doc."""
    mode, sd = decode(data)
    _load_and_step(mode, "load_state_dict", lambda opt: opt.load_state_dict(sd))


# -- load_checkpoint: a valid streaming checkpoint file, damaged by the input's bytes -------

_VALID_FILES: dict[str, bytes] = {}


def _valid_checkpoint(mode: str) -> bytes:
    """The bytes of mode's save_checkpoint file (made once per process)."""
    if mode not in _VALID_FILES:
        import tempfile
        opt = state_dict_cases.make(mode, seed=1)
        with tempfile.TemporaryDirectory() as scratch:
            path = pathlib.Path(scratch) / "checkpoint"
            opt.save_checkpoint(path)
            _VALID_FILES[mode] = path.read_bytes()
        opt.close()
    return _VALID_FILES[mode]


def _resealed(data: bytearray) -> bytearray:
    """`data` with its preamble-and-header crc recomputed, so that a damaged header reaches
    the parser behind the checksum (the damage a crc cannot see: a hostile writer's file)."""
    import struct

    from pagedoptim._native import native
    _, _, length = struct.unpack_from("<8sII", data, 0)
    end = 16 + length
    if end + 4 <= len(data):
        struct.pack_into("<I", data, end, native.crc32c(bytes(data[:end]), 0))
    return data


def decode_checkpoint(data: bytes) -> tuple[str, bytes]:
    """The mode and the damaged checkpoint file that `data` stands for: byte 0 picks the
    mode, then each damage takes a kind byte and a 16-bit position (0..65535, scaled to the
    file) and acts there: flip a bit, set a byte, truncate, insert a byte, or change a byte
    of the JSON header and reseal its crc."""
    reader = _Reader(data)
    mode = reader.pick(MODE_NAMES)
    file = bytearray(_valid_checkpoint(mode))
    for _ in range(MAX_MUTATIONS):
        if not reader.more() or not file:
            break
        kind = reader.byte() % 5
        at = ((reader.byte() << 8) | reader.byte()) * len(file) // 65536
        value = reader.byte()
        if kind == 0:
            file[at] ^= 1 << (value % 8)
        elif kind == 1:
            file[at] = value
        elif kind == 2:
            del file[at:]
        elif kind == 3:
            file.insert(at, value)
        elif len(file) >= 16:
            length = int.from_bytes(file[12:16], "little")
            header_at = 16 + at % max(length, 1)
            if header_at < min(16 + length, len(file)):
                file[header_at] = value
                file = _resealed(file)
    return mode, bytes(file)


def check_checkpoint(data: bytes) -> None:
    """Loads decode_checkpoint(data) into a fresh, stepped optimizer of its mode, with the
    properties of the module doc (CheckpointError is a ValueError)."""
    import tempfile
    mode, file = decode_checkpoint(data)
    with tempfile.TemporaryDirectory() as scratch:
        path = pathlib.Path(scratch) / "checkpoint"
        path.write_bytes(file)
        _load_and_step(mode, "load_checkpoint", lambda opt: opt.load_checkpoint(path))


# Each fuzz target: name -> check function; its corpus is tests/fuzz/corpus/<name>/.
TARGETS: dict[str, Callable[[bytes], None]] = {"load_state_dict": check,
                                               "load_checkpoint": check_checkpoint}
CORPUS = pathlib.Path(__file__).parent / "corpus"


def _random_inputs(seed: int, runs: int, max_seconds: float, target: Callable[[bytes], None]
                   ) -> int:
    rng = random.Random(seed)
    deadline = time.monotonic() + max_seconds
    done = 0
    while done < runs and time.monotonic() < deadline:
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
        try:
            target(data)
        except FuzzFailure:
            print(f"failing input: {data.hex()}", file=sys.stderr)
            raise
        done += 1
    return done


def _arm_watchdog(run_seconds: float) -> None:
    """A run still going two minutes after its time is up -- stuck between inputs or at
    exit, where libFuzzer's -timeout (per input) does not look -- prints every thread's
    stack and exits with an error, instead of waiting to be killed without a word."""
    faulthandler.dump_traceback_later(run_seconds + 120, exit=True)


def _libfuzzer_total_time(libfuzzer_args: list[str]) -> float | None:
    for arg in libfuzzer_args:
        if arg.startswith("-max_total_time="):
            return float(arg.split("=", 1)[1])
    return None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="load_state_dict", choices=sorted(TARGETS))
    parser.add_argument("--random", action="store_true",
                        help="random inputs even when atheris is installed")
    parser.add_argument("--runs", type=int, default=math.inf)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=60.0)
    parser.add_argument("--replay", nargs="+", type=pathlib.Path)
    args, libfuzzer_args = parser.parse_known_args(argv[1:])
    target = TARGETS[args.target]
    torch.set_num_threads(1)
    if args.replay:
        for path in args.replay:
            target(path.read_bytes())
        print(f"replayed {len(args.replay)} inputs")
        return 0
    if atheris is None or args.random:
        _arm_watchdog(args.max_seconds)
        runs = _random_inputs(args.seed, args.runs, args.max_seconds, target)
        print(f"{runs} random inputs, no failure")
        return 0
    total_time = _libfuzzer_total_time(libfuzzer_args)
    if total_time:
        _arm_watchdog(total_time)
    atheris.Setup([argv[0], *libfuzzer_args], target)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
