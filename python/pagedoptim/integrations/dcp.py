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
then the 16-bit param, as `load_state_dict` has it. Scales of an 8-bit checkpoint saved in
another layout (the flat groups of pagedoptim before 0.2) are asked for as saved, and
load_state_dict re-groups them in rows (state_format.group_shape, docs/compression.md).
Everything else loads as with DCP's default planner.

It works on the nested optimizer state dict (DCP's default). With
`flatten_optimizer_state_dict=True`, torch rebuilds the state from the optimizer's own
keys, so a checkpoint in the other format cannot be told apart there: load it nested. It
loads into pagedoptim's optimizers, whose load_state_dict converts; torch.optim's takes
the fp32 moments of exact mode, or of `torch_state_dict()`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pagedoptim.state import sharding as sharded_params
from pagedoptim.state.format import RESIDUAL

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
    holds in the other format by an empty tensor of the checkpoint's format, and flat
    scales of a checkpoint saved before scales took their param's shape by flat ones."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    saved = metadata.state_dict_metadata
    flat, paths = flatten_state_dict(state_dict)
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        path = paths[key]
        if key in saved:
            entry = saved[key]
            if (key.endswith(_SCALES) and _is_tensor(entry)
                    and tuple(entry.size) != tuple(value.shape)):
                # Scales in another layout: load_state_dict converts them (re-grouping the
                # flat groups of old checkpoints in rows; docs/compression.md).
                _set(state_dict, path, _empty_like_saved(value, entry, per_group=True))
            continue
        if key.endswith(_CODES):  # 8-bit wanted
            fp32 = key[: -len(_CODES)]
            if _is_tensor(saved.get(fp32)):
                _set(state_dict, path[:-1] + (path[-1][: -len(_CODES)],),
                     _empty_like_saved(value, saved[fp32], per_group=False))
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
                     _empty_like_saved(value, codes, per_group=False))
                _set(state_dict, path[:-1] + (path[-1] + _SCALES,),
                     _empty_like_saved(value, scales, per_group=True))
                _delete(state_dict, path)


def _is_tensor(entry: Any) -> bool:
    return isinstance(entry, TensorStorageMetadata)


def _empty_like_saved(like: torch.Tensor, saved: TensorStorageMetadata,
                      per_group: bool) -> torch.Tensor:
    """An empty tensor of the saved stream's shape and dtype, placed as `like` (an element
    stream of the same param) is: a DTensor on its mesh for a DTensor, else a plain tensor
    on its device. per_group: the saved stream holds scales (placed as
    sharded_params.group_placements says)."""
    dtype, shape = saved.properties.dtype, torch.Size(saved.size)
    if not sharded_params.is_dtensor(like):
        return torch.empty(shape, dtype=dtype, device=like.device)
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if per_group:  # scales with more than one dim have their param's shape
        placements = sharded_params.group_placements(tuple(like.placements), len(shape) > 1)
    else:
        placements = tuple(like.placements)
        # The param's shape; a complex param's fp32 moment is complex, its codes real [..., 2].
        if shape not in (like.shape, like.shape[:-1]) and shape[:-1] != like.shape:
            raise ValueError(f"the checkpoint's {tuple(shape)} stream does not match the "
                             f"{tuple(like.shape)} of the state it would load into")
    local_shape, _ = compute_local_shape_and_global_offset(shape, like.device_mesh, placements)
    local = torch.empty(local_shape, dtype=dtype,
                        device=sharded_params.local_tensor(like).device)
    return DTensor.from_local(local, like.device_mesh, placements, run_check=False,
                              shape=shape, stride=sharded_params.contiguous_strides(shape))


def _parent(root: Any, path: tuple) -> Any:
    for part in path[:-1]:
        root = root[part]
    return root


def _set(root: Any, path: tuple, value: Any) -> None:
    _parent(root, path)[path[-1]] = value


def _delete(root: Any, path: tuple) -> None:
    del _parent(root, path)[path[-1]]


__all__ = ["StateFormatLoadPlanner", "retarget_state_formats"]
