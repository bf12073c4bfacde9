"""`optimizer.state`: torch's per-parameter state mapping, over state that lives in pages.

torch keeps `optimizer.state[p]` as a dict of tensors that *are* the state. Ours lives in the
engine's pages (companded, split across pages, maybe on NVMe), so a tensor cannot alias it.
`StateMap` and `ParamState` give the same mapping with these semantics (docs/drop_in.md):

- `state[p]` lists 'step' (where the algorithm keeps one, as torch does) and the state
  streams in this optimizer's format, the same keys `state_dict()` has: `exp_avg`,
  `exp_avg_sq` in exact mode; `exp_avg_codes`, `exp_avg_scales`, ... with 8-bit state. In
  8-bit mode the fp32 names (`exp_avg`, ...) are readable and writable too: reads decode,
  writes encode.
- Reading a stream returns a copy, *checked out*: reading the same key again returns the
  same tensor, and in-place changes to it are written back into the pages before the engine
  is next used (the next step, `state_dict()`, `load_state_dict()`).
- Assigning `state[p][key] = tensor` writes into the pages at once (converted to the stored
  format; a wrong size raises). Replacing or deleting `state[p]` resets that parameter's
  state, as it does in torch; the streams of an entry assigned whole are written together,
  so an entry in the other state format converts as load_state_dict converts it (torch's
  ZeroRedundancyOptimizer loads this way).
- A checked-out tensor changed in place *after* a step replaced the state it was read from
  cannot be written back without undoing the step: the next use of the engine raises
  instead of losing the write.

Keys that are not parameters (`optimizer.state["my_counter"] = 3`) are kept as plain
values, as torch keeps them.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Iterator, Optional

import torch

from pagedoptim.state import sharding as sharded_params


def where_written(values: dict[str, Any]) -> str:
    """How an error names what was written through optimizer.state[p]."""
    if len(values) == 1:
        return f"optimizer.state[param][{next(iter(values))!r}]"
    return "optimizer.state[param]"


class StaleStateWriteError(RuntimeError):
    """A tensor read from optimizer.state was changed in place after the state moved on."""


def _versions(tensor: torch.Tensor) -> tuple[int, ...]:
    """What changes when `tensor` is changed in place: its version counter, and for a
    DTensor (the state of a DTensor param) also its local tensor's, which an in-place
    change through `to_local()` bumps alone."""
    if sharded_params.is_dtensor(tensor):
        return tensor._version, sharded_params.local_tensor(tensor)._version
    return (tensor._version,)


class _CheckedOut:
    """A stream value handed out by `ParamState.__getitem__`, and its versions then."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = _versions(tensor)

    def changed(self) -> bool:
        return _versions(self.tensor) != self.version


class ParamState(collections.abc.MutableMapping):
    """`optimizer.state[p]` for one parameter: plain entries ('step', anything a user adds)
    plus the parameter's state streams, read from and written to the optimizer's pages."""

    def __init__(self, state_map: "StateMap", param: torch.Tensor) -> None:
        self._map = state_map
        self._param = param
        self._plain: dict[Any, Any] = {}
        self._hidden_step: Optional[torch.Tensor] = None
        self._checked_step: Optional[torch.Tensor] = None  # the step tensor last found right
        self._checked_out: dict[str, _CheckedOut] = {}

    @property
    def _store(self) -> Any:
        return self._map.store

    # -- the mapping -----------------------------------------------------------------------

    def __getitem__(self, key: Any) -> Any:
        if key in self._plain:
            return self._plain[key]
        checked_out = self._checked_out.get(key)
        if checked_out is not None:
            return checked_out.tensor
        if not self._store.has_tensor(self._param, key):
            raise KeyError(key)
        tensor = self._store.read(self._param, key)
        self._checked_out[key] = _CheckedOut(tensor)
        self._map._note_checked_out(self)
        return tensor

    def __setitem__(self, key: Any, value: Any) -> None:
        if self._store.is_stream_name(key):
            self.write_streams({key: value})
            return
        self._plain[key] = value
        if key == "step":
            self._store.step_counter_replaced()

    def __delitem__(self, key: Any) -> None:
        if key in self._plain:
            del self._plain[key]
            return
        if key in self._stream_keys() or self._store.is_stream_name(key):
            raise KeyError(f"{key!r} is part of this parameter's paged state and cannot be "
                           "deleted on its own: delete optimizer.state[param] to reset the "
                           "whole state, or assign a new value")
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        yield from self._plain
        yield from (key for key in self._stream_keys() if key not in self._plain)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, key: Any) -> bool:
        return key in self._plain or key in self._checked_out \
            or self._store.has_tensor(self._param, key)

    def __repr__(self) -> str:
        return f"ParamState({dict(self)!r})"

    def _stream_keys(self) -> list[str]:
        return self._store.stream_keys(self._param)

    def write_streams(self, values: dict[str, Any]) -> None:
        """Writes page streams into the pages at once, converted together to the stored
        format: a moment's codes and scales given together load into fp32 state, as
        load_state_dict converts them (`state[p] = {...}` is how torch's ZeRO loads)."""
        for key, value in values.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer.state[param][{key!r}] must be a Tensor, got "
                                f"{type(value).__name__}")
        # Other checked-out streams of this param are written back first, so the new
        # values are not overwritten by older copies; afterwards they are stale.
        self.write_back()
        self._store.write(self._param, values, where_written(values))
        self._retire_checked_out()

    # -- the step counter ------------------------------------------------------------------

    def step_counter(self, device: torch.device, public: bool) -> torch.Tensor:
        """This param's step count, a 0-dim float32 tensor on `device`, created at zero. It
        is `state['step']` when the algorithm keeps it in its state as torch does (public),
        else kept out of the mapping (torch.optim.SGD has no 'step')."""
        step = self._plain.get("step") if public else self._hidden_step
        if step is not None and step is self._checked_step:
            return step  # the usual case, checked when it was made (this runs every step)
        if not (isinstance(step, torch.Tensor) and step.dtype == torch.float32
                and step.dim() == 0 and step.device == device):
            value = 0.0 if step is None else float(step)
            # zeros + fill, not tensor(value): a CUDA tensor built from a Python number is
            # a blocking copy from the host, and the step must not wait for the device.
            step = torch.zeros((), dtype=torch.float32, device=device)
            if value:
                step.fill_(value)
            if public:
                self._plain["step"] = step
            else:
                self._hidden_step = step
        self._checked_step = step
        return step

    def set_hidden_step(self, value: Any) -> None:
        """The hidden count; step_counter() makes it a tensor of the right kind."""
        self._hidden_step = value

    def hidden_step(self) -> Optional[float]:
        return None if self._hidden_step is None else float(self._hidden_step)

    def plain_items(self) -> dict[Any, Any]:
        return dict(self._plain)

    # -- checked-out copies ----------------------------------------------------------------

    def write_back(self) -> None:
        """Writes the checked-out tensors changed in place into the pages."""
        changed = {key: c.tensor for key, c in self._checked_out.items() if c.changed()}
        if not changed:
            return
        self._store.check_write_back(list(changed))
        self._store.write(self._param, changed, where_written(changed))
        for key, tensor in changed.items():
            self._checked_out[key].version = _versions(tensor)

    def _retire_checked_out(self) -> None:
        """The pages are about to change (or have): copies handed out become stale."""
        for key, checked_out in self._checked_out.items():
            self._map._note_stale(self._param, key, checked_out)
        self._checked_out.clear()


class StateMap(collections.defaultdict):
    """`optimizer.state`: a defaultdict like torch's, whose parameter entries are
    `ParamState`s. Replacing or removing a parameter's entry resets its paged state."""

    def __init__(self, owner: Any) -> None:
        super().__init__(dict)
        self._owner_ref = weakref.ref(owner)
        self._with_checked_out: dict[int, ParamState] = {}
        self._stale: list[tuple[weakref.ref, int, str]] = []

    @property
    def owner(self) -> Any:
        owner = self._owner_ref()
        if owner is None:
            raise RuntimeError("the optimizer this state belongs to no longer exists")
        return owner

    @property
    def store(self) -> Any:
        """The owner's StateStore (pagedoptim/engine/state_store.py), looked up on every use:
        a load replaces it, and this map may outlive the load."""
        return self.owner.state_store

    def __missing__(self, key: Any) -> Any:
        value = ParamState(self, key) if isinstance(key, torch.Tensor) else {}
        dict.__setitem__(self, key, value)
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        if not isinstance(key, torch.Tensor):
            dict.__setitem__(self, key, value)
            return
        if isinstance(value, ParamState) and value._param is key and value._map is self:
            dict.__setitem__(self, key, value)
            return
        entries = dict(value)  # read before the reset: `state[p] = dict(state[p])` keeps values
        previous = dict.get(self, key)
        # What to put back if the new entry cannot be written (a wrong size, say): a failed
        # assignment must not leave the param's state reset. It costs a read of the previous
        # state (pages on NVMe included) per whole-entry assignment, which torch's ZeRO makes
        # once per param per load, never per step.
        kept = dict(previous) if isinstance(previous, ParamState) else None
        self._reset(key)
        try:
            self._fill(key, entries)
        except BaseException as error:
            self._reset(key)
            if kept is not None:
                try:
                    self._fill(key, kept)
                except BaseException as restore_error:  # report the first failure
                    raise error from restore_error
            raise

    def _fill(self, key: torch.Tensor, entries: dict[Any, Any]) -> None:
        """Writes `entries` into the (freshly reset) state of param `key`."""
        fresh = self[key]
        streams = {}
        for name, entry in entries.items():
            if self.store.is_stream_name(name):
                streams[name] = entry
            else:
                fresh[name] = entry
        if streams:
            # Together, so that a whole entry in another state format converts.
            fresh.write_streams(streams)

    def __delitem__(self, key: Any) -> None:
        if key not in self:
            raise KeyError(key)
        self._reset(key)

    def pop(self, key: Any, *default: Any) -> Any:
        if key not in self:
            if default:
                return default[0]
            raise KeyError(key)
        value = self[key]
        snapshot = dict(value) if isinstance(value, ParamState) else value
        del self[key]
        return snapshot

    def popitem(self) -> tuple[Any, Any]:
        if not self:
            raise KeyError("popitem(): optimizer state is empty")
        key = next(reversed(list(dict.keys(self))))
        return key, self.pop(key)

    def clear(self) -> None:
        for key in list(dict.keys(self)):
            del self[key]

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = {} if default is None and isinstance(key, torch.Tensor) else default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __reduce__(self) -> Any:
        raise TypeError("optimizer.state of a pagedoptim optimizer is not picklable on its "
                        "own: pickle the optimizer, or its state_dict()")

    def _reset(self, key: Any) -> None:
        value = dict.get(self, key)
        if isinstance(value, ParamState):
            value._retire_checked_out()
            self._with_checked_out.pop(id(value), None)
            self.store.reset(key)
            self.store.step_counter_replaced()
        if key in self:
            dict.__delitem__(self, key)

    # -- bookkeeping of checked-out copies -------------------------------------------------

    def _note_checked_out(self, param_state: ParamState) -> None:
        self._with_checked_out[id(param_state)] = param_state

    def _note_stale(self, param: torch.Tensor, key: str, checked_out: _CheckedOut) -> None:
        self._stale.append((weakref.ref(checked_out.tensor), _versions(checked_out.tensor),
                            key))

    def sync(self) -> None:
        """Before the engine is used: raises if a stale copy was changed in place, then
        writes changed copies back into the pages (they stay checked out)."""
        self._check_stale()
        for param_state in list(self._with_checked_out.values()):
            param_state.write_back()

    def take_over(self, previous: "StateMap") -> None:
        """This map replaces `previous` (a load): copies handed out from it are stale."""
        previous.retire_all()
        self._stale = previous._stale + self._stale

    def retire_all(self) -> None:
        """After the pages changed (a step, a load): every copy handed out is stale."""
        for param_state in self._with_checked_out.values():
            param_state._retire_checked_out()
        self._with_checked_out.clear()

    def _check_stale(self) -> None:
        kept, offending = [], None
        for entry in self._stale:
            tensor = entry[0]()
            if tensor is None:
                continue  # the copy is gone, and with it any change to it
            if offending is None and _versions(tensor) != entry[1]:
                offending = entry[2]  # reported once, then forgotten
                continue
            kept.append(entry)
        self._stale = kept
        if offending is not None:
            raise StaleStateWriteError(
                f"a tensor read from optimizer.state[param][{offending!r}] was changed in "
                "place after a step (or a load) had replaced the state it was read from; the "
                "change was not applied. Read optimizer.state[param][key] again after each "
                "step, or assign the new value to it")
