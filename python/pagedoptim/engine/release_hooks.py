"""The post-accumulate-grad hooks of gradient release, owned weakly.

A param keeps its hooks as long as it lives. A hook that were the optimizer's bound method
would keep a deleted optimizer alive through its own params: it went on stepping with its
old hyperparameters and freeing each gradient inside backward, so a new optimizer built on
the same params found every gradient gone and never stepped, and on a GPU the old state's
pages were never freed. Here a hook holds its optimizer through a weak reference, the hooks
are removed when the optimizer is collected or closed, and each param is released by one
optimizer at a time: the newest built on it (`claim`). An older one that is still alive
when a newer one claims its params is told so with a warning, once.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any, Callable

import torch

# id(param) -> (param, the optimizer that releases its gradient), both held weakly. Keyed by
# id: tensors compare elementwise, so they cannot be the keys of a WeakKeyDictionary.
_owners: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def owner_of(param: torch.Tensor) -> Any:
    """The optimizer that releases `param`'s gradient now, or None."""
    entry = _owners.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def _set_owner(param: torch.Tensor, optimizer: Any) -> None:
    known = id(param) in _owners and _owners[id(param)][0]() is param
    _owners[id(param)] = (weakref.ref(param), weakref.ref(optimizer))
    if not known:
        weakref.finalize(param, _owners.pop, id(param), None)


class _Hook:
    """Calls `step(param)` on the optimizer while it is alive and still owns the param."""

    def __init__(self, optimizer: Any, step: Callable[[Any, torch.Tensor], None]) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._step = step

    def __call__(self, param: torch.Tensor) -> None:
        optimizer = self._optimizer()
        if optimizer is None or owner_of(param) is not optimizer:
            return  # collected, or a newer optimizer releases this param
        self._step(optimizer, param)


def _previous_owner_alive(param: torch.Tensor, optimizer: Any) -> bool:
    previous = owner_of(param)
    return previous is not None and previous is not optimizer \
        and not getattr(previous, "closed", False)


def claim(optimizer: Any, params: list[torch.Tensor],
          step: Callable[[Any, torch.Tensor], None]) -> list[Any]:
    """Registers the release hooks of `optimizer` on `params` (once per param) and makes it
    the param's releasing optimizer. Returns the hook handles; they are removed when the
    optimizer is collected (and by its close())."""
    params = [p for p in dict.fromkeys(params) if p.requires_grad]
    if any(_previous_owner_alive(p, optimizer) for p in params):
        gc.collect()  # an optimizer deleted by the user may wait in a reference cycle
        if any(_previous_owner_alive(p, optimizer) for p in params):
            warnings.warn(
                f"{type(optimizer).__name__} with release_grads=True takes over releasing "
                "the gradients of params that another optimizer, still alive, released: "
                "from now on only the new one steps them inside backward. close() or delete "
                "the old optimizer to say you meant it", RuntimeWarning, stacklevel=4)
    hook = _Hook(optimizer, step)
    handles = []
    for p in params:
        _set_owner(p, optimizer)
        handles.append(p.register_post_accumulate_grad_hook(hook))
    weakref.finalize(optimizer, _remove, list(handles))
    return handles


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
