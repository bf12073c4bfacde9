"""Argument checks shared by the optimizers: each error names the argument it is about."""

from __future__ import annotations

import math
from typing import Any

import torch


def as_float(value: Any, name: str) -> float:
    """A hyperparameter as a Python float; a 0-dim tensor (lr from a scheduler) is allowed."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, "
                             f"got a tensor of shape {tuple(value.shape)}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def check_non_negative(value: Any, name: str) -> float:
    number = as_float(value, name)
    if math.isnan(number) or number < 0.0 or math.isinf(number):
        raise ValueError(f"Invalid {name}: {number} ({name} must be a finite number >= 0)")
    return number


def check_unit_interval(value: Any, name: str) -> float:
    """A decay rate: 0 <= value < 1."""
    number = as_float(value, name)
    if not (0.0 <= number < 1.0):
        raise ValueError(f"Invalid {name}: {number} ({name} must be in [0, 1))")
    return number


def check_betas(betas: Any, name: str = "betas") -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid {name}: {betas!r} ({name} must be a pair of numbers)")
    return (check_unit_interval(betas[0], f"{name}[0]"),
            check_unit_interval(betas[1], f"{name}[1]"))
