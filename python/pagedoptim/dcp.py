"""torch.distributed.checkpoint (DCP) across optimizer state formats.

`dcp.load(state_dict, ...)` fills the tensors of the state dict it is given, key by key, so
it can only load a checkpoint whose keys that state dict has: an 8-bit optimizer's (whose
moments are `exp_avg_codes` + `exp_avg_scales`) cannot load a checkpoint of torch.optim or
of exact mode (`exp_avg`), nor the reverse, although `load_state_dict` converts between
them. `StateFormatLoadPlanner` closes that gap:

    sd = get_optimizer_state_dict(model, optimizer)
    dcp.load({"optimizer": sd}, checkpoint_id=path, planner=po.dcp.StateFormatLoadPlanner())
    set_optimizer_state_dict(model, optimizer, sd)      # load_state_dict converts

Before DCP plans the reads, it looks up each optimizer state stream the state dict asks for
in the checkpoint. Where the checkpoint has the moment in the other format, the planner
puts a tensor of that format in the state dict instead (a DTensor placed as the one it
replaces, so DCP reshards it); `load_state_dict` then converts with its usual rules. A
master residual the checkpoint lacks is dropped from the request: the master weight is
then the 16-bit param, as `load_state_dict` has it. Everything else loads as with DCP's
default planner.

It works on the nested optimizer state dict (DCP's default). With
`flatten_optimizer_state_dict=True`, torch rebuilds the state from the optimizer's own
keys, so a checkpoint in the other format cannot be told apart there: load it nested.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pagedoptim import sharded_params
from pagedoptim.state_format import RESIDUAL

_CODES, _SCALES = "_codes", "_scales"


class StateFormatLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus loading optimizer state saved in another format
    (fp32 moments into 8-bit state and the reverse; see the module doc)."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Optional[Metadata] = None,
                       is_coordinator: bool = False) -> None:
        if metadata is not None:
            retarget_state_formats(state_dict, metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)


def retarget_state_formats(state_dict: dict[str, Any], metadata: Metadata) -> None:
    """Replaces, in place, each state stream of `state_dict` that `metadata` (a checkpoint's)
    holds in the other format by an empty tensor of the checkpoint's format."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    saved = metadata.state_dict_metadata
    flat, paths = flatten_state_dict(state_dict)
    for key, value in flat.items():
        if key in saved or not isinstance(value, torch.Tensor):
            continue
        path = paths[key]
        if key.endswith(_CODES):  # 8-bit wanted
            fp32 = key[: -len(_CODES)]
            if _is_tensor(saved.get(fp32)):
                _set(state_dict, path[:-1] + (path[-1][: -len(_CODES)],),
                     _empty_like_saved(value, saved[fp32], same_shape=True))
                scales = paths.get(fp32 + _SCALES)
                if scales is not None:
                    _delete(state_dict, scales)
                _delete(state_dict, path)
        elif key.endswith(RESIDUAL):
            _delete(state_dict, path)
        elif not key.endswith(_SCALES):  # fp32 wanted
            codes, scales = saved.get(key + _CODES), saved.get(key + _SCALES)
            if _is_tensor(codes) and _is_tensor(scales):
                _set(state_dict, path[:-1] + (path[-1] + _CODES,),
                     _empty_like_saved(value, codes, same_shape=True))
                _set(state_dict, path[:-1] + (path[-1] + _SCALES,),
                     _empty_like_saved(value, scales, same_shape=False))
                _delete(state_dict, path)


def _is_tensor(entry: Any) -> bool:
    return isinstance(entry, TensorStorageMetadata)


def _empty_like_saved(like: torch.Tensor, saved: TensorStorageMetadata,
                      same_shape: bool) -> torch.Tensor:
    """An empty tensor of the saved stream's shape and dtype, placed as `like` (a stream of
    the same param) is: a DTensor on its mesh for a DTensor, else a plain tensor on its
    device."""
    dtype, shape = saved.properties.dtype, torch.Size(saved.size)
    if not sharded_params.is_dtensor(like):
        return torch.empty(shape, dtype=dtype, device=like.device)
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    placements = tuple(like.placements)
    if not same_shape and len(shape) != like.dim():
        # Flat scales of 32-element groups: sharded along their only dim
        # (state_format.group_shape, sharded_params.ShardLayout.scales).
        placements = tuple(Shard(0) if isinstance(pl, Shard) else pl for pl in placements)
    elif same_shape and shape != like.shape:
        raise ValueError(f"the checkpoint's {tuple(shape)} stream does not match the "
                         f"{tuple(like.shape)} of the state it would load into")
    local_shape, _ = compute_local_shape_and_global_offset(shape, like.device_mesh, placements)
    local = torch.empty(local_shape, dtype=dtype, device=sharded_params.local_tensor(like).device)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, like.device_mesh, placements, run_check=False,
                              shape=shape, stride=stride)


def _parent(root: Any, path: tuple) -> Any:
    for part in path[:-1]:
        root = root[part]
    return root


def _set(root: Any, path: tuple, value: Any) -> None:
    _parent(root, path)[path[-1]] = value


def _delete(root: Any, path: tuple) -> None:
    del _parent(root, path)[path[-1]]


__all__ = ["StateFormatLoadPlanner", "retarget_state_formats"]
