"""The bodies of PagedOptimizer's state_dict(), torch_state_dict(), load_state_dict() and
pickling: torch's formats over state that lives in pages (engine/state_store.py).

state_dict() follows torch's (hooks included), with every page stream of a param in its
state as a new tensor (a snapshot, unlike torch's references to the live state).
load_state_dict() takes page streams in any format (fp32 moments and 8-bit codes convert
both ways) and changes nothing if anything in the state dict is wrong: the loaded state is
built in a fresh store and swapped in by the one transaction (`replacing_state`).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch

from pagedoptim.checkpoint.algorithms import check_algorithm
from pagedoptim.engine.state_store import as_real, state_numel, state_numel_global, state_shape
from pagedoptim.state import checks as state_dict_checks
from pagedoptim.state import format as state_format
from pagedoptim.state.format import StreamSpec
from pagedoptim.state.param_state import ParamState


def pack(opt: Any) -> dict[str, Any]:
    """opt.state_dict()."""
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    opt.state.sync()
    store = opt.state_store
    index_of: dict[int, int] = {}
    param_groups = []
    start = 0
    for group in opt.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        for offset, p in enumerate(group["params"]):
            index_of.setdefault(id(p), start + offset)
        packed["params"] = [index_of[id(p)] for p in group["params"]]
        start += len(group["params"])
        param_groups.append(packed)
    packed_state: dict[Any, Any] = {}
    for key, value in opt.state.items():
        if not isinstance(key, torch.Tensor):
            packed_state[key] = value
            continue
        entry = dict(value.plain_items()) if isinstance(value, ParamState) else dict(value)
        if isinstance(entry.get("step"), torch.Tensor):
            # A snapshot, like the streams, on the CPU where the state is on a device: as
            # torch's AdamW keeps it (unless fused or capturable), which reads a device
            # step back with a sync per param per step after loading it.
            entry["step"] = entry["step"].detach().to("cpu", copy=True)
        entry.update({name: store.read(key, name) for name in store.stream_keys(key)})
        if entry:  # torch keeps no entry for a param without state
            packed_state[index_of[id(key)]] = entry
    state_dict = {"state": packed_state, "param_groups": param_groups}
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        result = post_hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def as_torch_format(opt: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """opt.torch_state_dict(), from opt.state_dict(): companded moments dequantized to
    fp32, master residuals dropped."""
    store = opt.state_store
    moments = store.all_moments()
    params = store.params()
    for index, value in state_dict["state"].items():
        if not isinstance(index, int):
            continue
        converted = {k: v for k, v in value.items()
                     if k not in state_format.all_stream_names(moments)}
        p = params[index]
        for moment in opt._moments():
            spec = StreamSpec(moment.name, 4 * state_format.GROUP_SIZE, False, torch.float32)
            tensor = state_format.convert_for_stream(
                spec, moments, {k: as_real(store.as_local(p, k, v, moment.name), moment.name)
                                for k, v in value.items() if isinstance(v, torch.Tensor)},
                state_shape(p))
            if tensor is not None:
                tensor = tensor.reshape(state_shape(p))
                if p.is_complex():
                    tensor = torch.view_as_complex(tensor.contiguous())
                converted[moment.name] = store.as_public(p, tensor, per_group=False)
        state_dict["state"][index] = converted
    return state_dict


def load(opt: Any, state_dict: dict[str, Any]) -> None:
    """opt.load_state_dict(state_dict)."""
    opt.state.sync()
    state_dict_checks.check_structure(state_dict)
    state_dict = dict(state_dict)
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(opt, state_dict)
        if result is not None:
            state_dict = result
    state_dict_checks.check_structure(state_dict)  # as the hooks left it
    check_algorithm(opt._kind, state_dict, type(opt).__name__)
    groups = opt.param_groups
    saved_groups = copy.deepcopy(state_dict["param_groups"])
    if len(groups) != len(saved_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
        raise ValueError("loaded state dict contains a parameter group that doesn't match "
                         "the size of optimizer's group")
    id_map = dict(zip(itertools.chain.from_iterable(g["params"] for g in saved_groups),
                      itertools.chain.from_iterable(g["params"] for g in groups)))
    store = opt.state_store
    index_of = {p: index for index, p in enumerate(store.params())}
    stream_names = store.stream_names()
    moments = store.all_moments()
    streams: dict[int, dict[str, torch.Tensor]] = {}
    plain: dict[torch.Tensor, dict[Any, Any]] = {}
    other: dict[Any, Any] = {}
    for key, value in state_dict["state"].items():
        if key not in id_map:
            other[key] = value  # not a param's state: kept as is, as torch keeps it
            continue
        p = id_map[key]
        state_dict_checks.check_param_state(key, value, moments, stream_names,
                                            state_numel_global(p))
        # Sparse streams (torch.optim.SGD's momentum for sparse gradients; their indices
        # were checked above) are stored dense.
        own = {k: (v.to_dense() if isinstance(v, torch.Tensor) and v.is_sparse else v)
               for k, v in value.items() if k in stream_names and v is not None}
        if own:
            streams[index_of[p]] = own
        plain[p] = {k: (v if k == "step" or not isinstance(v, torch.Tensor) else
                        _cast_like_torch(p, v, key, state_dict["param_groups"], k))
                    for k, v in value.items() if k not in stream_names}
    param_groups = [opt._loaded_group(group, saved, index)
                    for index, (group, saved) in enumerate(zip(groups, saved_groups))]
    with opt._replacing_state(param_groups) as new_store:
        for key, value in other.items():
            opt.state[key] = value
        new_store.write_all(streams)
        for p, entries in plain.items():
            opt._load_plain_state(p, entries, index_of[p] in streams)
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


def pickled(opt: Any) -> dict[str, Any]:
    """opt.__getstate__(): the torch attributes, the settings and every stream as tensors
    (the engine itself cannot be pickled; unpickling builds a new one)."""
    opt.state.sync()
    param_plain, hidden_steps, other = {}, {}, {}
    for key, value in opt.state.items():
        if isinstance(value, ParamState):
            param_plain[key] = value.plain_items()
            if value.hidden_step() is not None:
                hidden_steps[key] = value.hidden_step()
        else:
            other[key] = value
    return {"defaults": opt.defaults, "param_groups": opt.param_groups,
            "_options": opt._options, "_param_plain": param_plain,
            "_hidden_steps": hidden_steps, "_other_state": other,
            "_saved_streams": opt.state_store.gather()}


def restore_pickled(opt: Any, saved: dict[str, Any]) -> None:
    """The rest of opt.__setstate__: `saved` (what pickled() added to torch's attributes)
    written into opt's fresh store and state."""
    opt.state_store.write_all(saved["_saved_streams"])
    for p, entries in saved["_param_plain"].items():
        opt.state[p].update(entries)
    for p, step in saved["_hidden_steps"].items():
        opt.state[p].set_hidden_step(step)
    for key, value in saved["_other_state"].items():
        opt.state[key] = value


PICKLED_FIELDS = ("_options", "_saved_streams", "_param_plain", "_hidden_steps",
                  "_other_state")


def _cast_like_torch(p: torch.Tensor, value: torch.Tensor, index: Any,
                     param_groups: list[dict[str, Any]], key: Any) -> torch.Tensor:
    """A loaded state tensor other than a stream, cast to p's dtype and device as torch's
    load_state_dict casts it; a cast that fails (a tensor too large to copy) names it."""
    try:
        return torch.optim.Optimizer._process_value_according_to_param_policy(
            p, value, index, param_groups, key)
    except RuntimeError as error:
        raise ValueError(f"state for param {index!r}[{key!r}] could not be cast to its "
                         f"param's dtype and device ({p.dtype}, {p.device}): {error}") from None
