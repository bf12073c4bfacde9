"""DTensor params (FSDP2, tensor parallelism): the optimizer steps and keeps their local shard.

A DTensor param stands for one shard of a global tensor: its `data_ptr()` is not the shard's
and its `numel()` is the global count, so the engine must never see it. The optimizer steps
`p.to_local()` with `p.grad.to_local()` and keeps state for the local shard only, laid out
as the same elements of the unsharded param's state would be (docs/distributed.md):

* element streams (fp32 moments, 8-bit codes, master residuals) are shaped like the param,
  so their shard is the param's shard;
* per-group streams (the fp16 scale of each group of 32 elements of a row of the last
  dimension) have the shape `state_format.group_shape`: the param's with the last dimension
  d replaced by ceil(d / 32). A shard along any dimension but the last holds whole groups
  whatever the shapes and the world size (FSDP2's Shard(0) on 3 ranks included), and its
  scales are the same shard of the global scales. A shard along the last dimension
  (tensor parallelism's Shard(1) of a Linear weight) holds whole groups only where it is cut
  at a multiple of 32; `ShardLayout.scales` checks every rank's shard and raises otherwise,
  because a scale computed over part of a group would silently change the result. (Params
  of one dimension keep fp32 moments: state_format.keeps_8bit_state.)

state_dict() hands the state out as DTensors with the param's mesh and placements (the
scales' placements follow from their shape), so DCP saves, gathers (full_state_dict) and
reshards it as it does the param; loading takes DTensors, or plain tensors of the local or
the global shape.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import sys
from typing import Any, Callable, Optional

import torch

from pagedoptim.state.format import GROUP_SIZE, group_shape


# Neither is a DTensor: the usual case is answered by one type lookup (this runs for every
# param of every step).
_PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})


def is_dtensor(value: Any) -> bool:
    if type(value) in _PLAIN_TYPES:
        return False
    # No DTensor exists before torch.distributed.tensor is imported: no import here.
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    return dtensor is not None and isinstance(value, dtensor)


def check_param_type(p: torch.Tensor, where: str) -> None:
    """Raises for a tensor subclass whose elements the kernels cannot reach: a wrapper
    subclass other than DTensor (its data_ptr() is not its elements')."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    if is_dtensor(p):
        local = local_tensor(p)
        if is_traceable_wrapper_subclass(local):
            raise TypeError(f"{where} is a DTensor whose local shard is a "
                            f"{type(local).__name__}; pagedoptim steps DTensors over plain "
                            "local tensors")
        return
    if is_traceable_wrapper_subclass(p):
        raise TypeError(f"{where} is a {type(p).__name__}, a tensor subclass pagedoptim cannot "
                        "step: it steps plain tensors (and nn.Parameter) and DTensors "
                        "(FSDP2, tensor parallelism)")


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of its storage); any other tensor as it is."""
    if not is_dtensor(value):
        return value
    with torch.no_grad():  # a view for the kernels, not a node of the autograd graph
        return value.to_local()


def local_grad(p: torch.Tensor, grad: torch.Tensor, where: Callable[[], str]) -> torch.Tensor:
    """The gradient the kernels take for DTensor param `p`: the local shard of its grad,
    which must be a DTensor placed as `p` is. `where()` names the param in errors."""
    param_is_dtensor, grad_is_dtensor = is_dtensor(p), is_dtensor(grad)
    if param_is_dtensor != grad_is_dtensor:
        kind = {True: "a DTensor", False: "a plain tensor"}
        raise ValueError(f"the grad of {where()} is {kind[grad_is_dtensor]} and its param "
                         f"{kind[param_is_dtensor]}; they must be both DTensors placed "
                         "alike, or both plain tensors")
    if grad.device_mesh != p.device_mesh or tuple(grad.placements) != tuple(p.placements):
        raise ValueError(f"the grad of {where()} has placements {tuple(grad.placements)} on "
                         f"{grad.device_mesh}, its param {tuple(p.placements)} on "
                         f"{p.device_mesh}; they must match (a Partial grad has not been "
                         "reduced yet)")
    return local_tensor(grad)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, stride = [], 1
    for size in reversed(shape):
        strides.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(strides))


@dataclasses.dataclass(frozen=True)
class Box:
    """Where a local shard sits in a global tensor: its shape and its offset per dim."""

    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    offset: tuple[int, ...]

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.local_shape))

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)


def box_at(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple,
           coordinate: tuple[int, ...]) -> Box:
    """The shard of a tensor that the rank at `coordinate` of the mesh holds under Shard and
    Replicate placements: each Shard splits the current extent of its dim into torch.chunk's
    pieces (ceil-sized, the last ones short or empty), mesh dim after mesh dim, as DTensor
    does. Any rank's shard can be computed on every rank, so decisions made from it agree."""
    from torch.distributed.tensor import Shard
    local, offset = list(global_shape), [0] * len(global_shape)
    for ranks, placement, index in zip(mesh_shape, placements, coordinate):
        if isinstance(placement, Shard):
            dim = placement.dim % len(global_shape)
            chunk = -(-local[dim] // ranks)
            start = min(index * chunk, local[dim])
            offset[dim] += start
            local[dim] = min(chunk, local[dim] - start)
    return Box(tuple(global_shape), tuple(local), tuple(offset))


def group_placements(placements: tuple, natural: bool) -> tuple:
    """The placements of a per-group stream: the param's where the scales have its shape
    (state_format.group_shape; every param of two or more dimensions), else every Shard
    along the flat scales' only dim (the flat scales of old checkpoints)."""
    if natural:
        return placements
    from torch.distributed.tensor import Shard
    return tuple(Shard(0) if isinstance(pl, Shard) else pl for pl in placements)


def _groups_of(elements: Box) -> Optional[Box]:
    """The groups of 32 that a shard of the elements holds, as a box of the scales
    (groups run along the rows of the last dimension); None where the shard cuts a group:
    a cut of the last dimension off a multiple of 32, short of the row's end."""
    scale_shape = tuple(group_shape(torch.Size(elements.global_shape)))
    if elements.numel == 0:
        return Box(scale_shape, (0,) * len(scale_shape), (0,) * len(scale_shape))
    if len(elements.global_shape) < 2:  # one row: only a shard of whole groups keeps them
        (start,), (count,), (total,) = (elements.offset, elements.local_shape,
                                        elements.global_shape)
    else:
        start, count, total = (elements.offset[-1], elements.local_shape[-1],
                               elements.global_shape[-1])
    end = start + count
    if start % GROUP_SIZE or (end % GROUP_SIZE and end != total):
        return None
    first, last = start // GROUP_SIZE, -(-end // GROUP_SIZE)
    return Box(scale_shape, (*elements.local_shape[:-1], last - first),
               (*elements.offset[:-1], first))


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How the state of one DTensor param is sharded: the element streams' box (the
    param's, with a trailing [0, 2) for the real view of a complex param), and its mesh and
    placements."""

    mesh: Any
    placements: tuple
    elements: Box

    def scales(self, where: Callable[[], str]) -> tuple[Box, tuple]:
        """The per-group streams' box and placements on this rank. Raises where any rank's
        shard cuts a group (its scale would be computed over part of the group's
        elements), so that every rank raises alike. `where()` names the param in errors
        (called only then: naming it can take a search)."""
        outcome = self._scale_sharding
        if isinstance(outcome, str):
            raise ValueError(f"{where()} {outcome}")
        return outcome

    @functools.cached_property
    def _scale_sharding(self) -> "tuple[Box, tuple] | str":
        """(this rank's box of the scales, their placements), or why there are none."""
        from torch.distributed.tensor import Replicate, Shard
        if any(type(pl) not in (Shard, Replicate) for pl in self.placements):
            return (f"has placements {self.placements}; pagedoptim's 8-bit state shards "
                    "along Shard and Replicate placements only (use state_bits=32 for "
                    "others)")
        shape = self.elements.global_shape
        placements = group_placements(self.placements, natural=len(shape) > 1)
        scale_shape = tuple(group_shape(torch.Size(shape)))
        mesh_shape = tuple(self.mesh.shape)
        # Every rank's shard, not only this one's: a verdict from the local shard alone
        # could raise on one rank while the others went on into a collective.
        sharded = [range(n) if isinstance(pl, Shard) else range(1)
                   for n, pl in zip(mesh_shape, self.placements)]
        for coordinate in itertools.product(*sharded):
            elements = box_at(shape, mesh_shape, self.placements, coordinate)
            groups = _groups_of(elements)
            scales = box_at(scale_shape, mesh_shape, placements, coordinate)
            holds_its_groups = groups is not None and (
                groups.numel == scales.numel == 0
                or (groups.local_shape, groups.offset) == (scales.local_shape, scales.offset))
            if not holds_its_groups:
                return (f"is sharded {self.placements} on a mesh of {mesh_shape} so that "
                        f"a shard (shape {elements.local_shape} at offset "
                        f"{elements.offset} of {shape}) does not hold whole groups of "
                        f"{GROUP_SIZE} elements, which share one 8-bit scale: its 8-bit "
                        "state would differ from the unsharded param's. Use "
                        "state_bits=32, or shard its last dimension at multiples of "
                        f"{GROUP_SIZE} (a Shard of any other dimension keeps whole groups)")
        coordinate = tuple(self.mesh.get_coordinate())
        if box_at(shape, mesh_shape, self.placements, coordinate) != self.elements:
            return (f"has a local shard {self.elements.local_shape} at "
                    f"{self.elements.offset} that torch.chunk's split of {shape} does not "
                    "give: pagedoptim cannot place its 8-bit scales (use state_bits=32)")
        return box_at(scale_shape, mesh_shape, placements, coordinate), placements


def shard_layout(p: torch.Tensor) -> ShardLayout:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh,
                                                                p.placements)
    global_shape, local_shape, offset = tuple(p.shape), tuple(local_shape), tuple(offset)
    if local_shape != tuple(local_tensor(p).shape):
        raise ValueError(f"a DTensor param's local shard has shape "
                         f"{tuple(local_tensor(p).shape)}, but its placements "
                         f"{tuple(p.placements)} give {local_shape}: pagedoptim steps "
                         "DTensors whose shards follow their placements")
    if p.is_complex():  # the state is the real view: a trailing dim of 2
        global_shape, local_shape, offset = (*global_shape, 2), (*local_shape, 2), (*offset, 0)
    return ShardLayout(p.device_mesh, tuple(p.placements),
                       Box(global_shape, local_shape, offset))


def as_dtensor(layout: ShardLayout, local: torch.Tensor, per_group: bool,
               where: Callable[[], str]) -> torch.Tensor:
    """A stream of the local shard as a DTensor placed as the global stream would be. Its
    local tensor stays where the engine put it (host memory, as for plain CUDA params, so a
    checkpoint of offloaded state does not fill the GPU; torch's gather and broadcast move
    each tensor to the mesh's device one at a time).

    Built from its spec, as FSDP2 builds its CPU-offloaded params: DTensor.from_local would
    copy a local tensor on another device than the mesh's (host state on a CUDA mesh) to the
    mesh's device."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    if per_group:
        box, placements = layout.scales(where)
        shape = box.global_shape
    else:
        placements = layout.placements
        shape = layout.elements.global_shape
        if local.is_complex():  # the complex moment of a complex param: the param's shape
            shape = shape[:-1]
    spec = DTensorSpec(layout.mesh, tuple(placements),
                       tensor_meta=TensorMeta(torch.Size(shape), contiguous_strides(shape),
                                              local.dtype))
    return DTensor(local, spec, requires_grad=False)


def local_part(layout: ShardLayout, value: torch.Tensor, per_group: bool,
               where: Callable[[], str]) -> torch.Tensor:
    """The local shard's part of a loaded stream: a DTensor's local shard (redistributed
    first if it is placed otherwise on the same mesh), or a plain tensor as it is when it has
    the local shard's size, or sliced when it holds the whole global stream."""
    if per_group:
        box, placements = layout.scales(where)
    else:
        box, placements = layout.elements, layout.placements
    if is_dtensor(value):
        if value.device_mesh != layout.mesh:
            raise ValueError(f"{where()} is a DTensor on {value.device_mesh}, its param on "
                             f"{layout.mesh}")
        if tuple(value.placements) != tuple(placements):
            value = value.redistribute(layout.mesh, placements)
        return local_tensor(value)
    if value.is_complex():
        value = torch.view_as_real(value)
    local_numel, global_numel = math.prod(box.local_shape), math.prod(box.global_shape)
    if value.numel() == global_numel and global_numel != local_numel:
        return value.reshape(box.global_shape)[box.slices()]
    return value
