"""Converting an optimizer state_dict between pagedoptim's state formats and torch.optim's,
without the model.

A moment X is saved as fp32 "X" (torch.optim's format, and pagedoptim's with
state_bits=32) or as companded "X_codes" + "X_scales" (state_bits=8); bf16/fp16 parameters
may add a "master_residual" (state_format). No parameter is needed: element streams (fp32
moments, codes, residuals) are saved shaped like their parameter, and the scales, one per
group of 32 elements of a row of the last dimension, follow from the codes' shape (or, from
pagedoptim before 0.2, one per 32 elements in flat order). With state_bits=8, the params that
pagedoptim keeps in fp32 (1-D, fewer than min_8bit_size elements, complex:
state_format.keeps_8bit_state) keep fp32 moments here too. The moments are converted with
state_format's codec, the one the kernels and load_state_dict use; everything else (step,
SkewAdam's factored second moments, param_groups) is kept as it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

import torch

from pagedoptim.checkpoint import algorithms as checkpoint_algorithms

from pagedoptim.state import format as state_format
from pagedoptim.state.format import Moment

# The moments each algorithm may compand (state_format.MOMENTS). SkewAdam's exact second
# moment is fp32 in every format, so only its momentum converts.
COMPANDED_MOMENTS: dict[str, list[Moment]] = {
    algorithm: [m for m in moments if not (algorithm == checkpoint_algorithms.SKEWADAM
                                           and m.second)]
    for algorithm, moments in state_format.MOMENTS.items()}
STATE_BITS = (8, 32)


class AlreadyInTargetFormat(ValueError):
    """The state_dict needs no conversion: it can be used as it is."""


def to_torch_format(state_dict: Mapping[str, Any], algorithm: str) -> dict[str, Any]:
    """`state_dict` in torch.optim's format, as PagedOptimizer.torch_state_dict() gives it:
    companded moments dequantized to fp32, master residuals dropped (torch keeps no master
    weight: the 16-bit parameter is the weight). fp32 moments keep their dtype.

    Raises AlreadyInTargetFormat when there is nothing to dequantize or drop.
    """
    return _convert(state_dict, algorithm, state_bits=32, keep_residual=False,
                    target="torch.optim's format")


def to_pagedoptim_format(state_dict: Mapping[str, Any], algorithm: str, state_bits: int,
                         min_8bit_size: int = state_format.DEFAULT_MIN_8BIT_SIZE
                         ) -> dict[str, Any]:
    """`state_dict` (torch.optim's format or pagedoptim's) with its moments in the format of
    pagedoptim's `state_bits` (8: companded codes + scales, 32: fp32); master residuals are
    kept. A torch.optim.Adam state_dict with weight decay is refused: pagedoptim.AdamW's
    decay is decoupled (checkpoint_algorithms).

    Raises AlreadyInTargetFormat when every moment already has that format.
    """
    if state_bits not in STATE_BITS:
        raise ValueError(f"state_bits must be one of {list(STATE_BITS)}, got {state_bits!r}")
    if algorithm == checkpoint_algorithms.ADAM:
        mismatch = checkpoint_algorithms.algorithm_mismatch(checkpoint_algorithms.ADAMW,
                                                            state_dict)
        if mismatch is not None:
            raise ValueError(f"{mismatch}; pagedoptim has no Adam with coupled weight decay")
    return _convert(state_dict, algorithm, state_bits=state_bits, keep_residual=True,
                    target=f"pagedoptim's state_bits={state_bits} format",
                    min_8bit_size=min_8bit_size)


def _moments_of(algorithm: str) -> list[Moment]:
    if algorithm == checkpoint_algorithms.ADAM:
        return COMPANDED_MOMENTS[checkpoint_algorithms.ADAMW]
    moments = COMPANDED_MOMENTS.get(algorithm)
    if moments is None:
        raise ValueError(f"algorithm must be one of {list(COMPANDED_MOMENTS)}, got "
                         f"{algorithm!r}")
    return moments


def _convert(state_dict: Mapping[str, Any], algorithm: str, *, state_bits: int,
             keep_residual: bool, target: str,
             min_8bit_size: int = state_format.DEFAULT_MIN_8BIT_SIZE) -> dict[str, Any]:
    moments = _moments_of(algorithm)
    checkpoint_algorithms.identify_algorithm(state_dict)  # raises if not a state_dict
    converted_state: dict[Any, Any] = {}
    changed = False
    for index, given in state_dict["state"].items():
        if not isinstance(given, Mapping):
            converted_state[index] = given  # not a parameter's state; nothing to convert
            continue
        converted_state[index], param_changed = _convert_param(
            index, given, moments, state_bits=state_bits, keep_residual=keep_residual,
            min_8bit_size=min_8bit_size)
        changed |= param_changed
    if not changed:
        raise AlreadyInTargetFormat(f"the state_dict is already in {target}: nothing to "
                                    "convert, use it as it is")
    return {**state_dict, "state": converted_state}


def _convert_param(index: Any, given: Mapping[str, Any], moments: list[Moment], *,
                   state_bits: int, keep_residual: bool,
                   min_8bit_size: int) -> tuple[dict[str, Any], bool]:
    """One parameter's state in the target format, and whether that changed anything.

    A stream already in the target format is kept as it is, dtype included: torch keeps
    bf16 parameters' moments in bf16, and pagedoptim's load_state_dict casts them itself.
    """
    # A complex param's moments are coded as their real view (as the optimizer steps them);
    # kept as they are where no conversion is needed.
    complex_moments = {key for key, value in given.items()
                       if isinstance(value, torch.Tensor) and value.is_complex()}
    given = {key: (torch.view_as_real(value) if isinstance(value, torch.Tensor)
                   and value.is_complex() and f"{key}_codes" not in given else value)
             for key, value in given.items()}
    moment_keys = state_format.all_stream_names(moments) - {state_format.RESIDUAL}
    drop_residual = not keep_residual and state_format.RESIDUAL in given
    replaced = moment_keys | ({state_format.RESIDUAL} if drop_residual else set())
    converted = {key: value for key, value in given.items() if key not in replaced}
    changed = drop_residual
    for moment in moments:
        shape = _element_shape(index, moment, given)
        if shape is None:
            continue
        # With state_bits=8, the params pagedoptim keeps in fp32 keep fp32 moments (a complex
        # param's shape here is its real view's).
        bits = state_bits if state_bits == 32 or state_format.shape_keeps_8bit_state(
            shape, moment.name in complex_moments, min_8bit_size) else 32
        for spec in state_format.moment_streams(moment, bits):
            if spec.name in given:
                converted[spec.name] = given[spec.name]
                continue
            value = state_format.convert_for_stream(spec, moments, given, shape)
            converted[spec.name] = value.reshape(state_format.group_shape(shape) if spec.per_group
                                                  else shape)
            changed = True
    return converted, changed


def _element_shape(index: Any, moment: Moment, given: Mapping[str, Any]
                   ) -> Optional[torch.Size]:
    """The shape of the parameter behind `moment`, from its fp32 tensor or its codes (None:
    the parameter has no such moment)."""
    fp32, codes, scales = (given.get(moment.name), given.get(f"{moment.name}_codes"),
                           given.get(f"{moment.name}_scales"))
    for name, value in ((moment.name, fp32), (f"{moment.name}_codes", codes),
                        (f"{moment.name}_scales", scales)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise ValueError(f"state '{name}' of param {index} must be a tensor, got "
                             f"{type(value).__name__}")
    if fp32 is not None:
        return fp32.shape
    if codes is None and scales is None:
        return None
    if codes is None or scales is None:
        raise ValueError(f"state of param {index} has only one of '{moment.name}_codes' and "
                         f"'{moment.name}_scales': both are needed to dequantize "
                         f"'{moment.name}'")
    expected_scales = math.prod(state_format.group_shape(codes.shape))
    flat_scales = math.prod(state_format.flat_group_shape(codes.shape))  # before 0.2
    if scales.numel() not in (expected_scales, flat_scales):
        raise ValueError(f"state '{moment.name}_scales' of param {index} has {scales.numel()} "
                         f"elements, expected {expected_scales} (one per group of "
                         f"{state_format.GROUP_SIZE} of each row of the {tuple(codes.shape)} "
                         "codes)")
    return codes.shape
