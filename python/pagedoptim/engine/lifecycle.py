"""What a closed optimizer is: `close()` drops the native engine (its io_uring ring, page
file descriptor and pinned buffers go with it, at that moment rather than whenever the
garbage collector gets to the optimizer), and every later use raises instead of silently
recreating empty state.

`open_only` guards a method; `ClosedState` takes the place of `optimizer.state`, so that
reading state through it raises too. docs/reliability.md ("Lifecycle") states the contract.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NoReturn, TypeVar

_Method = TypeVar("_Method", bound=Callable[..., Any])


def raise_closed(optimizer: Any, what: str) -> NoReturn:
    raise RuntimeError(f"this {type(optimizer).__name__} was closed: {what} cannot be used "
                       "after close() (or the end of its `with` block), because its state "
                       "and page file were released; create a new optimizer and load a "
                       "state_dict into it to keep training")


def open_only(method: _Method) -> _Method:
    """Makes `method` raise on a closed optimizer before it does anything."""

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_closed", False):
            raise_closed(self, f"{method.__name__}()")
        return method(self, *args, **kwargs)

    return guarded  # type: ignore[return-value]


class ClosedState:
    """`optimizer.state` once the optimizer is closed: any access says why it is gone."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer_name = type(optimizer).__name__

    def _raise(self, *_: Any, **__: Any) -> NoReturn:
        raise RuntimeError(f"this {self._optimizer_name} was closed: optimizer.state cannot "
                           "be used after close() (or the end of its `with` block), because "
                           "its state and page file were released")

    __getitem__ = __setitem__ = __delitem__ = __contains__ = __iter__ = __len__ = _raise
    keys = values = items = get = sync = _raise
