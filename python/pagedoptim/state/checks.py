"""Checks on a state_dict given to load_state_dict, made before the optimizer changes.

load_state_dict is all or nothing: what these checks refuse raises before anything is
replaced, and whatever fails later (a size that only the engine's layout knows, a disk
error while the new pages are written) is undone by load_state_dict's rollback. Both give
the same kind of message: which param (its index in the state_dict), which key, what was
expected.

What is refused, and why where torch.optim would take it (docs/reliability.md, "Bad files"):

- state of another algorithm: a param whose state has another algorithm's keys (SGD's
  momentum_buffer in AdamW's state, SkewAdam's exp_avg_sq_row in Lion's). torch keeps them
  and fails with a KeyError at the next step; checkpoint_algorithms refuses most such
  checkpoints by their param_groups already.
- not a state_dict's shape: 'state' a mapping of param index -> dict, 'param_groups' a
  list of dicts whose 'params' is a list of param indices. torch fails on these with a
  KeyError or AttributeError from deep inside; here the message says what was expected.
- a 'step' that is not a non-negative finite number (a float, an int or a one-element real
  tensor). torch keeps any value and fails or computes garbage bias corrections at the next
  step; no optimizer ever saves such a step.
- tensors no optimizer saves and the engine cannot read: meta tensors (no data), layouts
  other than strided and sparse COO, quantized dtypes (bool only outside streams), and
  sparse tensors whose indices point outside their size (torch.sparse_coo_tensor does not
  check them by default, and densifying such a tensor writes out of bounds: it crashed the
  process).
- pagedoptim's own 8-bit streams with values their encoder never writes: codes of the
  wrong dtype (X_codes is int8, second moments' uint8), int8 codes of -128, scales that are
  negative or infinite (a scale is a group's absmax, saturated at 65504; NaN is what a group
  holding a non-finite moment is stored as, and loads, as torch loads a NaN moment), and
  master residuals that are not int8/int16 or lie outside [-K, K].
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from pagedoptim.state import sharding as sharded_params, format as state_format

# The master residual's code range per dtype (state_format.residual_stream).
RESIDUAL_LIMITS = {torch.int8: 127, torch.int16: 32767}
_NUMERIC_LAYOUTS = (torch.strided, torch.sparse_coo)
_STEP_MAX = torch.finfo(torch.float32).max
# The state keys of every algorithm pagedoptim runs, in every format: one algorithm's in
# another's state means the checkpoint is not of this optimizer's algorithm.
_ALGORITHM_STREAMS = state_format.all_stream_names([
    state_format.Moment(name, second=False)
    for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")]) | {
    "exp_avg_sq_row", "exp_avg_sq_col"}


def check_structure(state_dict: Any) -> None:
    """The containers of a state_dict: 'state' and 'param_groups' as torch saves them."""
    if not isinstance(state_dict, Mapping):
        raise TypeError("state_dict must be a dict with 'state' and 'param_groups' (what "
                        f"optimizer.state_dict() returns), got {type(state_dict).__name__}")
    for key, kind in (("state", Mapping), ("param_groups", list)):
        if key not in state_dict:
            raise ValueError(f"state_dict has no {key!r} (its keys: "
                             f"{sorted(map(str, state_dict))}); expected 'state' and "
                             "'param_groups'")
        if not isinstance(state_dict[key], kind):
            raise TypeError(f"state_dict[{key!r}] must be a "
                            f"{'dict' if kind is Mapping else 'list'}, got "
                            f"{type(state_dict[key]).__name__}")
    for index, group in enumerate(state_dict["param_groups"]):
        if not isinstance(group, Mapping):
            raise TypeError(f"state_dict['param_groups'][{index}] must be a dict, got "
                            f"{type(group).__name__}")
        if "params" not in group:
            raise ValueError(f"state_dict['param_groups'][{index}] has no 'params'")
        params = group["params"]
        if not isinstance(params, (list, tuple)):
            raise TypeError(f"state_dict['param_groups'][{index}]['params'] must be a list of "
                            f"param indices, got {type(params).__name__}")
        for position, key in enumerate(params):
            if isinstance(key, bool) or not isinstance(key, (int, str)):
                raise TypeError(f"state_dict['param_groups'][{index}]['params'][{position}] "
                                "must be a param index (an int, or a name), got "
                                f"{type(key).__name__}")
    for key, value in state_dict["state"].items():
        try:
            hash(key)
        except TypeError:  # a mapping cannot hold it; a hostile Mapping could
            raise TypeError(f"state_dict['state'] has an unhashable key of type "
                            f"{type(key).__name__}") from None


def check_param_state(index: Any, value: Any, moments: list[state_format.Moment],
                      stream_names: set[str], max_numel: int) -> None:
    """One param's loaded state: a dict of a valid step, sound tensors, and 8-bit streams
    whose values their encoder can have written. `max_numel`: the elements of the param's
    whole (global) state; no stream is larger, and checking it first keeps the value checks
    from reading a huge tensor (an expanded one has no memory of its own). Exact sizes are
    checked where the param's layout is known (StateStore.write_streams)."""
    where = f"state for param {index!r}"
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a dict of state names to tensors, got "
                        f"{type(value).__name__}")
    foreign = sorted(key for key in value if key in _ALGORITHM_STREAMS and key not in stream_names)
    if foreign:
        raise ValueError(f"{where} has {foreign}, state of another algorithm; this optimizer "
                         f"keeps {sorted(stream_names)}")
    for key, entry in value.items():
        at = f"{where}[{key!r}]"
        if key == "step":
            check_step(entry, at)
        elif key in stream_names:
            if entry is None:
                continue  # load_state_dict skips a stream given as None, as it always has
            if not isinstance(entry, torch.Tensor):
                raise TypeError(f"{at} must be a Tensor, got {type(entry).__name__}")
            check_tensor(entry, at)
            numel = entry.numel() * (2 if entry.is_complex() else 1)
            if numel > max_numel:
                raise ValueError(f"{at} has {numel} elements; the param's state has "
                                 f"{max_numel}")
            check_stream_values(key, entry, moments, at)
        else:
            _check_nested_tensors(entry, at)


def check_step(value: Any, where: str) -> None:
    if isinstance(value, torch.Tensor):
        check_tensor(value, where)
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{where} must be a one-element real tensor (a step count), got "
                             f"shape {tuple(value.shape)} and dtype {value.dtype}")
        number = float(_dense_local(value).reshape(()).item())
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        raise TypeError(f"{where} must be a number or a one-element tensor (a step count), "
                        f"got {type(value).__name__}")
    if not math.isfinite(number) or number < 0 or number > _STEP_MAX:
        raise ValueError(f"{where} is {number}; a step count is a finite number >= 0 that "
                         "a float32 holds (the step counter is a float32, as torch's)")


def check_tensor(value: torch.Tensor, where: str) -> None:
    """A tensor the engine can read: real data, a dense or valid sparse COO layout, and a
    numeric dtype."""
    local = sharded_params.local_tensor(value) if sharded_params.is_dtensor(value) else value
    if local.is_meta:
        raise ValueError(f"{where} is a meta tensor, which has no data to load")
    if local.layout not in _NUMERIC_LAYOUTS:
        raise TypeError(f"{where} has layout {local.layout}; expected a dense (strided) "
                        "tensor")
    if local.is_quantized or not (local.dtype.is_floating_point or local.dtype.is_complex
                                  or _is_integer(local.dtype) or local.dtype == torch.bool):
        raise TypeError(f"{where} has dtype {local.dtype}; expected a float, integer, bool or "
                        "complex tensor")
    if local.layout == torch.sparse_coo:
        _check_sparse_indices(local, where)


def check_stream_values(name: str, value: torch.Tensor, moments: list[state_format.Moment],
                        where: str) -> None:
    """8-bit codes, scales and residuals hold only values their encoder writes."""
    dense = _dense_local(value)
    if name == state_format.RESIDUAL:
        limit = RESIDUAL_LIMITS.get(dense.dtype)
        if limit is None:
            raise TypeError(f"{where} must be int8 (master_bits=24) or int16 (master_bits=32), "
                            f"got {dense.dtype}")
        largest = int(dense.to(torch.int32).abs().max()) if dense.numel() else 0
        if largest > limit:
            raise ValueError(f"{where} holds {largest} in magnitude; {dense.dtype} master "
                             f"residuals lie in [-{limit}, {limit}]")
        return
    for moment in moments:
        if name == f"{moment.name}_codes":
            expected = torch.uint8 if moment.second else torch.int8
            if dense.dtype != expected:
                raise TypeError(f"{where} must be {expected} (the 8-bit codes of "
                                f"'{moment.name}'), got {dense.dtype}")
            if not moment.second and dense.numel() and int(dense.min()) < -127:
                raise ValueError(f"{where} holds -128; int8 moment codes lie in [-127, 127]")
        elif name == f"{moment.name}_scales":
            if not dense.dtype.is_floating_point:
                raise TypeError(f"{where} must be float16 (one scale per group of "
                                f"{state_format.GROUP_SIZE}), got {dense.dtype}")
            scales = dense.to(torch.float16).float()
            if bool((scales < 0).any()) or bool(scales.isinf().any()):
                raise ValueError(f"{where} holds a negative or infinite scale; a scale is its "
                                 "group's absmax (>= 0, at most 65504; NaN for a group whose "
                                 "moment is not finite)")
        elif name == moment.name:
            if dense.dtype == torch.bool:
                raise TypeError(f"{where} must be a float tensor, got {dense.dtype}")


def _check_nested_tensors(value: Any, where: str) -> None:
    """Tensors inside a param's other entries: torch casts each to the param's dtype and
    device (recursing into dicts, lists and tuples), which must not crash either."""
    if isinstance(value, torch.Tensor):
        check_tensor(value, where)
    elif isinstance(value, Mapping):
        for key, entry in value.items():
            _check_nested_tensors(entry, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for position, entry in enumerate(value):
            _check_nested_tensors(entry, f"{where}[{position}]")


def _check_sparse_indices(value: torch.Tensor, where: str) -> None:
    indices = value._indices()
    if indices.numel() == 0:
        return
    sizes = torch.tensor(value.shape[:value.sparse_dim()], dtype=indices.dtype,
                         device=indices.device)
    if bool((indices < 0).any()) or bool((indices >= sizes[:, None]).any()):
        raise ValueError(f"{where} is a sparse tensor with indices outside its size "
                         f"{tuple(value.shape)}")


def _dense_local(value: torch.Tensor) -> torch.Tensor:
    local = sharded_params.local_tensor(value) if sharded_params.is_dtensor(value) else value
    return local.to_dense() if local.layout == torch.sparse_coo else local


def _is_integer(dtype: torch.dtype) -> bool:
    return dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
