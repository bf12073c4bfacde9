"""Argument checks shared by the optimizers.

Each message starts with what torch.optim says for the same mistake ("Invalid learning
rate: -1.0"), so code and searches written against torch's messages still match, and goes
on to name the argument and what was expected.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# torch.optim's words for each hyperparameter in its "Invalid ..." messages.
_TORCH_LABELS = {
    "lr": "learning rate",
    "eps": "epsilon value",
    "weight_decay": "weight_decay value",
    "momentum": "momentum value",
    "dampening": "dampening value",
}


def as_float(value: Any, name: str) -> float:
    """A hyperparameter as a Python float; a 0-dim tensor (lr from a scheduler) is allowed."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element ({name} is a tensor of shape "
                             f"{tuple(value.shape)})")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def as_flag(value: Any, name: str) -> bool:
    """An on/off hyperparameter (amsgrad, maximize, nesterov) as a bool. torch tests its
    truth; here only values whose truth means on/off are taken: a string ("False" is true)
    or a container would silently turn the flag on."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"{name} must be a bool, got a tensor of shape {tuple(value.shape)}")
        return bool(value.item())
    if not isinstance(value, (bool, int, float)) and type(value).__name__ != "bool_":
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_non_negative(value: Any, name: str) -> float:
    number = as_float(value, name)
    if math.isnan(number) or number < 0.0 or math.isinf(number):
        label = _TORCH_LABELS.get(name, name)
        raise ValueError(f"Invalid {label}: {number} ({name} must be a finite number >= 0)")
    return number


def check_betas(betas: Any, name: str = "betas") -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid {name}: {betas!r} ({name} must be a pair of numbers)")
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ValueError(f"betas must be either both floats or both Tensors (got {name}="
                         f"({type(betas[0]).__name__}, {type(betas[1]).__name__}))")
    checked = []
    for index, beta in enumerate(betas):
        number = as_float(beta, f"{name}[{index}]")
        if not (0.0 <= number < 1.0):
            raise ValueError(f"Invalid beta parameter at index {index}: {number} "
                             f"({name}[{index}] must be in [0, 1))")
        checked.append(number)
    return checked[0], checked[1]
