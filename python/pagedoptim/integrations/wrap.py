"""pagedoptim.wrap(): an existing torch optimizer, groups, hyperparameters and state
included, as the pagedoptim optimizer of the same algorithm."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from pagedoptim.paging import kwargs as paging_kwargs
from pagedoptim.optim.adamw import AdamW
from pagedoptim.optim.optimizer import PagedOptimizer
from pagedoptim.integrations.patch import torch_class
from pagedoptim.optim.sgd import SGD
from pagedoptim.integrations.stand_ins import Adam

# torch.optim name -> (our class, the constructor arguments taken from torch's defaults).
# Adam becomes the stand-in that refuses coupled (L2) weight decay, which AdamW cannot do.
_ADAM_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
_CONVERSIONS: dict[str, tuple[type, tuple[str, ...]]] = {
    "AdamW": (AdamW, _ADAM_HYPERPARAMETERS),
    "Adam": (Adam, _ADAM_HYPERPARAMETERS + ("decoupled_weight_decay",)),
    "SGD": (SGD, ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")),
}


def wrap(optimizer: torch.optim.Optimizer, **kwargs: Any) -> PagedOptimizer:
    """The pagedoptim equivalent of `optimizer`, with its param groups, hyperparameters and
    state (moments, steps), taking the paging keyword arguments `kwargs` (state_bits=...,
    offload=...; the optimizers' defaults for the rest, whatever patch() set).

    Supported: torch.optim.AdamW, torch.optim.Adam (weight_decay=0 or
    decoupled_weight_decay=True) and torch.optim.SGD, exactly those classes (a subclass may
    change the algorithm). A pagedoptim optimizer is returned as it is, when no kwargs are
    given. The torch optimizer is left as it was; step only the returned one from now on,
    and build LR schedulers on it (a scheduler built on the torch optimizer keeps changing
    that one's learning rate).
    """
    if isinstance(optimizer, PagedOptimizer):
        if kwargs:
            raise ValueError(
                f"wrap() got an optimizer that is already a pagedoptim {type(optimizer).__name__}"
                f" together with {', '.join(sorted(kwargs))}: its paging settings are fixed at "
                "construction; build a new one and load_state_dict(optimizer.state_dict())")
        return optimizer
    name = next((name for name in _CONVERSIONS if type(optimizer) is torch_class(name)), None)
    if name is None:
        raise TypeError(
            f"wrap() supports torch.optim.AdamW, torch.optim.Adam (weight_decay=0) and "
            f"torch.optim.SGD; got {type(optimizer).__module__}.{type(optimizer).__qualname__}")
    paged_cls, hyperparameter_names = _CONVERSIONS[name]
    if any("initial_lr" in group for group in optimizer.param_groups):
        # LR schedulers set 'initial_lr' in the groups of the optimizer they drive.
        warnings.warn(
            f"The torch.optim.{name} given to wrap() has been driven by an LR scheduler; that "
            "scheduler keeps driving the torch optimizer, not the wrapped one: build the "
            "scheduler on the optimizer wrap() returns (last_epoch= continues its schedule)",
            stacklevel=2)
    hyperparameters = {key: optimizer.defaults[key] for key in hyperparameter_names}
    # Explicit paging arguments: settings of an active patch() apply to scripts' torch
    # names, not to wrap().
    paging_kwargs.check_names(kwargs, "wrap()")
    paging = paging_kwargs.with_defaults(kwargs)
    groups = [{**group, "params": list(group["params"])} for group in optimizer.param_groups]
    paged = paged_cls(groups, **hyperparameters, **paging)
    paged.load_state_dict(optimizer.state_dict())
    return paged
