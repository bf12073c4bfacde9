"""Which optimizer algorithm saved an optimizer state_dict, told from the state_dict alone.

Loading one algorithm's checkpoint into another fails late and obscurely (the groups replace
the optimizer's hyperparameters, so the first step misses 'amsgrad' or 'momentum'), or not at
all (a torch.optim.Adam checkpoint's coupled L2 weight decay would silently become AdamW's
decoupled decay). `check_algorithm` refuses such a checkpoint up front with a message that
names both algorithms.

What identifies an algorithm, first by the param_groups keys (hyperparameters are saved
even before the first step, when the state is still empty), then by the state keys:

  algorithm  param_groups keys                       state keys (any format)
  sgd        momentum, dampening, nesterov           momentum_buffer*
  skewadam   param_tiers (or tier), betas, eps       exp_avg_sq_row / exp_avg_sq_col
  adamw      amsgrad (or betas and eps)              exp_avg*, exp_avg_sq*, max_exp_avg_sq*
  adam       as adamw, decoupled_weight_decay=False
  lion       betas without eps                       exp_avg* only
  other      a key only another torch.optim optimizer has (RMSprop's centered, Adagrad's
             lr_decay, ...), or betas and eps without amsgrad (RAdam, Adamax, SparseAdam)

torch 2.x saves 'decoupled_weight_decay' in both Adam's and AdamW's groups (AdamW is Adam
with it True). Checkpoints without the key (pagedoptim's, older torch's) are taken as AdamW:
older torch's Adam cannot be told apart from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

# The `_kind` of each pagedoptim optimizer, plus torch.optim.Adam's coupled-decay variant.
ADAMW, ADAM, SGD, LION, SKEWADAM = "adamw", "adam", "sgd", "lion", "skewadam"
KINDS = (ADAMW, SGD, LION, SKEWADAM)  # what pagedoptim's optimizers are

_SAVED_BY = {
    ADAMW: "AdamW",
    ADAM: "torch.optim.Adam",
    SGD: "SGD",
    LION: "Lion",
    SKEWADAM: "pagedoptim.SkewAdam",
}

# torch.optim's other optimizers, by a param_groups key only they have (RMSprop also has
# SGD's momentum, so these are looked at first). Another Adam-family optimizer without
# amsgrad (RAdam, Adamax, SparseAdam) is told by betas and eps without amsgrad: torch's
# Adam and AdamW, and ours, always save amsgrad.
OTHER = "other"
_OTHER_TORCH_KEYS = {
    "centered": "torch.optim.RMSprop", "alpha": "torch.optim.RMSprop or ASGD",
    "lr_decay": "torch.optim.Adagrad", "initial_accumulator_value": "torch.optim.Adagrad",
    "rho": "torch.optim.Adadelta", "momentum_decay": "torch.optim.NAdam",
    "etas": "torch.optim.Rprop", "step_sizes": "torch.optim.Rprop", "lambd": "torch.optim.ASGD",
    "t0": "torch.optim.ASGD", "history_size": "torch.optim.LBFGS",
    "tolerance_grad": "torch.optim.LBFGS",
}
_ADAM_VARIANT = "an Adam variant without amsgrad (torch.optim.RAdam, Adamax or SparseAdam)"

# Keys every optimizer may carry, which say nothing about the algorithm.
_NEUTRAL_GROUP_KEYS = {"params", "param_names", "lr", "initial_lr", "weight_decay", "maximize",
                       "foreach", "fused", "capturable", "differentiable"}


def is_optimizer_state_dict(candidate: Any) -> bool:
    """Whether `candidate` has the shape of torch.optim.Optimizer.state_dict()'s result."""
    return (isinstance(candidate, Mapping)
            and isinstance(candidate.get("state"), Mapping)
            and isinstance(candidate.get("param_groups"), list)
            and all(isinstance(group, Mapping) and "params" in group
                    for group in candidate["param_groups"]))


def _check_is_state_dict(state_dict: Any, argument: str) -> None:
    if not is_optimizer_state_dict(state_dict):
        got = (f"a dict with keys {sorted(map(str, state_dict))}"
               if isinstance(state_dict, Mapping) else type(state_dict).__name__)
        raise ValueError(f"{argument} must be an optimizer state_dict (a dict with 'state': "
                         f"{{param index: {{name: tensor}}}} and 'param_groups': a list of "
                         f"dicts with 'params'), got {got}")


def _group_keys(state_dict: Mapping) -> set[str]:
    return {key for group in state_dict["param_groups"] for key in group}


def _state_keys(state_dict: Mapping) -> set[str]:
    return {key for value in state_dict["state"].values() if isinstance(value, Mapping)
            for key in value}


def _other_torch_algorithm(state_dict: Mapping) -> Optional[str]:
    """The name of a torch.optim optimizer none of ours runs, when its groups show one."""
    keys = _group_keys(state_dict)
    for key, name in _OTHER_TORCH_KEYS.items():
        if key in keys:
            return name
    if {"betas", "eps"} <= keys and not {"amsgrad", "param_tiers", "tier"} & keys:
        return _ADAM_VARIANT
    return None


def _from_group_keys(state_dict: Mapping) -> Optional[str]:
    keys = _group_keys(state_dict)
    if _other_torch_algorithm(state_dict) is not None:
        return OTHER
    if {"momentum", "dampening", "nesterov"} & keys:
        return SGD
    if {"param_tiers", "tier"} & keys:
        return SKEWADAM
    if "amsgrad" in keys:
        coupled = any(group.get("decoupled_weight_decay") is False
                      for group in state_dict["param_groups"])
        return ADAM if coupled else ADAMW
    if "betas" in keys:
        return LION
    return None


def _from_state_keys(state_dict: Mapping) -> Optional[str]:
    keys = _state_keys(state_dict)
    if any(key.startswith("momentum_buffer") for key in keys):
        return SGD
    if {"exp_avg_sq_row", "exp_avg_sq_col"} & keys:
        return SKEWADAM
    if any(key.startswith(("exp_avg_sq", "max_exp_avg_sq")) for key in keys):
        return ADAMW
    if any(key.startswith("exp_avg") for key in keys):
        return LION
    return None


def identify_algorithm(state_dict: Any) -> Optional[str]:
    """The algorithm that saved `state_dict`: 'adamw', 'adam' (torch.optim.Adam: coupled L2
    weight decay), 'sgd', 'lion' or 'skewadam'; 'other' for another torch.optim optimizer
    (RMSprop, Adagrad, RAdam, ...); None when neither its param_groups nor its state tell
    (for example groups with only lr and an empty state).

    Raises ValueError when `state_dict` is not an optimizer state_dict.
    """
    _check_is_state_dict(state_dict, "state_dict")
    return _from_group_keys(state_dict) or _from_state_keys(state_dict)


def _has_weight_decay(state_dict: Mapping) -> bool:
    return any(float(group.get("weight_decay", 0.0)) != 0.0
               for group in state_dict["param_groups"])


def _evidence(state_dict: Mapping) -> str:
    group_keys = sorted(_group_keys(state_dict) - _NEUTRAL_GROUP_KEYS)
    state_keys = sorted(_state_keys(state_dict) - {"step"})
    return f"it has param_groups keys {group_keys} and state keys {state_keys}"


def algorithm_mismatch(expected: str, state_dict: Any) -> Optional[str]:
    """Why an optimizer of kind `expected` (one of KINDS) must not load `state_dict`, as a
    sentence about the state_dict; None when it may.

    A state_dict whose algorithm cannot be told is let through. A torch.optim.Adam
    state_dict suits AdamW only where no group has weight decay: there the two algorithms
    are the same; elsewhere Adam's decay is an L2 term added to the gradient (it passes
    through the moments), AdamW's is applied to the weight directly.
    """
    if expected not in KINDS:
        raise ValueError(f"expected must be one of {list(KINDS)}, got {expected!r}")
    saved_by = identify_algorithm(state_dict)
    if saved_by is None or saved_by == expected:
        return None
    if saved_by == ADAM and expected == ADAMW:
        if not _has_weight_decay(state_dict):
            return None
        return ("this state_dict was saved by torch.optim.Adam with weight_decay != 0 "
                "(decoupled_weight_decay=False: an L2 term added to the gradient), which "
                "AdamW would apply to the weight directly instead, a different algorithm "
                "(set weight_decay=0 in its param_groups to accept the change, or resume "
                "with torch.optim.Adam)")
    saved_by_name = (_other_torch_algorithm(state_dict) if saved_by == OTHER
                     else _SAVED_BY[saved_by])
    return f"this state_dict was saved by {saved_by_name} ({_evidence(state_dict)})"


def check_algorithm(expected: str, state_dict: Any, optimizer_name: str) -> None:
    """Raises ValueError unless an optimizer of kind `expected` (one of KINDS) may load
    `state_dict` (see algorithm_mismatch). `optimizer_name` names it in the message; a bare
    class name ('AdamW') is shown as pagedoptim's ('pagedoptim.AdamW'), so it is not taken
    for torch's.
    """
    mismatch = algorithm_mismatch(expected, state_dict)
    if mismatch is not None:
        if "." not in optimizer_name:
            optimizer_name = f"pagedoptim.{optimizer_name}"
        raise ValueError(f"{mismatch}; {optimizer_name} cannot load it")
