"""torch.optim's implementation flags: `foreach`, `fused`, `capturable`, `differentiable`.

Scripts pass them, and torch's param groups and state dicts carry them, so every pagedoptim
optimizer accepts them and its groups carry the same keys. What they mean here:

- `foreach` and `fused` choose between torch's implementations of one algorithm. Ours has a
  single one, always fused (one native call per step), so any value is accepted and has no
  effect. Groups record `None` ("the implementation's default"), whatever was passed or
  loaded: a torch state dict saying `fused=True` must not leave a flag behind that claims
  an implementation that is not running, and a state dict of ours loaded into torch then
  lets torch pick its own default on any device.
- `capturable=True` asks for a step that can be captured in a CUDA graph, and
  `differentiable=True` for a step autograd can differentiate through. Neither holds for
  the native step, so both raise. A loaded state dict's `capturable` flag describes how the
  run that saved it executed, not its state, and is reset to False.
"""

from __future__ import annotations

from typing import Any, Optional

from pagedoptim._validation import as_flag

# The group entries torch's optimizers keep, with the values ours always hold.
GROUP_FLAGS = {"foreach": None, "fused": None, "capturable": False, "differentiable": False}


def check_flags(optimizer_name: str, foreach: Optional[bool], fused: Optional[bool],
                capturable: bool, differentiable: bool,
                with_capturable: bool = True) -> dict[str, Any]:
    """Validates the flags as torch would and returns the group entries they become
    (without 'capturable' where torch's optimizer of the algorithm has none: SGD)."""
    for name, value, allow_none in (("foreach", foreach, True), ("fused", fused, True),
                                    ("capturable", capturable, False),
                                    ("differentiable", differentiable, False)):
        if not (isinstance(value, bool) or (allow_none and value is None)):
            expected = "a bool or None" if allow_none else "a bool"
            raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if capturable:
        raise ValueError(f"capturable=True is not supported by pagedoptim.{optimizer_name}: "
                         "its step is one native call that the pager drives from the host "
                         "(page loads, evictions), which a CUDA graph cannot capture. Use "
                         "capturable=False (the default); on CUDA the step already runs "
                         "without a host sync")
    if differentiable:
        raise ValueError(f"differentiable=True is not supported by pagedoptim.{optimizer_name}: "
                         "the native step updates parameters and state outside autograd. "
                         "Use torch.optim with differentiable=True to differentiate through "
                         "an optimizer step")
    flags = dict(GROUP_FLAGS)
    if not with_capturable:
        del flags["capturable"]
    return flags


def normalize_loaded_group(group: dict[str, Any], defaults: dict[str, Any]) -> None:
    """A loaded param group's flags, set to what this library runs (see module doc): those
    the optimizer's defaults have, whatever the saved group said."""
    if as_flag(group.get("differentiable", False), "differentiable"):
        raise ValueError("the state dict was saved by an optimizer with differentiable=True, "
                         "whose param groups pagedoptim cannot take over: its step is not "
                         "differentiable")
    for name, value in GROUP_FLAGS.items():
        if name in defaults:
            group[name] = value
