"""The classes that pagedoptim.patch() puts in place of torch.optim.AdamW, Adam and SGD.

Each takes the signature and defaults of the torch class it replaces and runs our
algorithm; AdamW is a subclass of Adam as in torch, so `isinstance` checks a script makes
against torch.optim's names answer as they would unpatched, and every one is a
torch.optim.Optimizer. Keyword arguments ours does not know are passed on, not dropped:
the optimizer raises for those it cannot honour.

The paging settings of the patch (environment or patch(**overrides)) are the defaults of
every stand-in built while it is active; arguments given to the constructor win.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from pagedoptim.optim.adamw import AdamW as PagedAdamW
from pagedoptim.integrations.owning_model import model_owning
from pagedoptim.optim.sgd import SGD as PagedSGD
from pagedoptim.optim.skewadam import SkewAdam as PagedSkewAdam

_session_settings: dict[str, Any] = {}


def use_paging_settings(settings: dict[str, Any]) -> None:
    """Sets the paging keyword arguments that stand-ins built from now on default to."""
    global _session_settings
    _session_settings = dict(settings)


def _with_session_settings(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {**_session_settings, **kwargs}


class _AdamWeightDecay:
    """What torch.optim.Adam's stand-ins share: Adam's weight decay is an L2 term added to
    the gradient (coupled); ours (AdamW's, SkewAdam's) is decoupled. The two agree only at
    weight_decay=0 (or with decoupled_weight_decay=True, which is AdamW), so any group with
    coupled weight decay raises, at construction, in add_param_group and at a step after
    the group was edited: the alternative would be training a different model without a
    word. Groups carry decoupled_weight_decay, as torch's do."""

    # Until the constructor has put it in defaults; copies and unpickled optimizers keep
    # only defaults, state and groups, so afterwards defaults is where it is read.
    _constructor_decoupling = False

    def _decoupled_weight_decay_default(self) -> bool:
        return self._constructor_decoupling

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        group.setdefault("decoupled_weight_decay",
                         self.defaults.get("decoupled_weight_decay", self._constructor_decoupling))
        self._check_weight_decay(
            {"weight_decay": self.defaults["weight_decay"], **group}, len(self.param_groups))
        super().add_param_group(group)  # type: ignore[misc]

    def _group_hyperparameters(self, group: dict[str, Any]) -> tuple:
        # a group being loaded (load_state_dict checks it first) is not in param_groups yet
        index = next((i for i, g in enumerate(self.param_groups) if g is group), None)
        self._check_weight_decay(group, index)
        return super()._group_hyperparameters(group)  # type: ignore[misc]

    @staticmethod
    def _check_weight_decay(group: dict[str, Any], index: Optional[int]) -> None:
        decoupled = group.get("decoupled_weight_decay", False)
        if not decoupled and float(group["weight_decay"]) != 0.0:
            where = "a loaded param group" if index is None else f"param group {index}"
            raise ValueError(
                f"torch.optim.Adam with weight_decay={float(group['weight_decay'])} ({where}) "
                "adds an L2 term to the gradient, which pagedoptim's AdamW and SkewAdam "
                "cannot express (their weight decay is decoupled). Use torch.optim.AdamW (a "
                "different, usually better, regularization), weight_decay=0, or run without "
                "PAGEDOPTIM / pagedoptim.patch() to keep torch's Adam")


class Adam(_AdamWeightDecay, PagedAdamW):
    """torch.optim.Adam on our AdamW (see _AdamWeightDecay for its weight decay)."""

    def __init__(self, params: Any, lr: Union[float, torch.Tensor] = 1e-3,
                 betas: tuple[Any, Any] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 decoupled_weight_decay: bool = False, **kwargs: Any) -> None:
        self._constructor_decoupling = bool(decoupled_weight_decay)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize,
                         **_with_session_settings(kwargs))


class AdamW(Adam):
    """torch.optim.AdamW on our AdamW (torch's AdamW is Adam with decoupled weight decay)."""

    def __init__(self, params: Any, lr: Union[float, torch.Tensor] = 1e-3,
                 betas: tuple[Any, Any] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         decoupled_weight_decay=True, **kwargs)


class SGD(PagedSGD):
    """torch.optim.SGD on our SGD (torch's maximize is keyword-only)."""

    def __init__(self, params: Any, lr: Union[float, torch.Tensor] = 1e-3,
                 momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, *, maximize: bool = False, **kwargs: Any) -> None:
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, maximize,
                         **_with_session_settings(kwargs))


class SkewAdamW(PagedSkewAdam):
    """torch.optim.AdamW on SkewAdam (PAGEDOPTIM_ALGORITHM=skewadam): Mixture-of-Experts
    scripts keep their `torch.optim.AdamW(model.parameters(), ...)`.

    The tiers come from parameter names, which the script does not pass: they are taken
    from the model that owns the parameters (pagedoptim.integrations.owning_model). torch's `eps` is
    not SkewAdam's (an epsilon added to g^2, default 1e-30), so the script's value is not
    passed on and SkewAdam's own applies (build po.SkewAdam directly to choose it).
    amsgrad and maximize have no SkewAdam form and raise."""

    def __init__(self, params: Any, lr: Union[float, torch.Tensor] = 1e-3,
                 betas: tuple[Any, Any] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 **kwargs: Any) -> None:
        for name, value in (("amsgrad", amsgrad), ("maximize", maximize)):
            if value:
                raise ValueError(f"{name}=True has no SkewAdam form "
                                 "(PAGEDOPTIM_ALGORITHM=skewadam): unset it, or the variable")
        kwargs = _with_session_settings(kwargs)
        params, tensors = _materialized(params)
        if "names_from" not in kwargs:
            kwargs["names_from"] = model_owning(tensors)
        super().__init__(params, lr, betas, weight_decay=weight_decay, **kwargs)


class SkewAdamAsAdam(_AdamWeightDecay, SkewAdamW):
    """torch.optim.Adam on SkewAdam: as SkewAdamW, with Adam's default weight_decay=0 and
    its weight decay checked as the Adam stand-in's (_AdamWeightDecay)."""

    def __init__(self, params: Any, lr: Union[float, torch.Tensor] = 1e-3,
                 betas: tuple[Any, Any] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 decoupled_weight_decay: bool = False, **kwargs: Any) -> None:
        self._constructor_decoupling = bool(decoupled_weight_decay)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         **kwargs)
        # torch keeps it in defaults and groups; state dicts round-trip through torch.Adam.
        self.defaults["decoupled_weight_decay"] = self._constructor_decoupling


def _materialized(params: Any) -> tuple[list[Any], list[torch.Tensor]]:
    """A params argument (tensors, (name, tensor) pairs, or param groups; maybe a generator,
    which can be read only once) as a list, and the tensors in it."""
    entries = [params] if isinstance(params, torch.Tensor) else list(params)
    listed, tensors = [], []
    for entry in entries:
        if isinstance(entry, dict):
            group = entry["params"]
            members = [group] if isinstance(group, torch.Tensor) else list(group)
            listed.append({**entry, "params": members})
        else:
            members = [entry]
            listed.append(entry)
        tensors += [m[1] if isinstance(m, tuple) else m for m in members]
    return listed, [t for t in tensors if isinstance(t, torch.Tensor)]
