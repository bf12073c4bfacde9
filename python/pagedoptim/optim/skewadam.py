"""pagedoptim.SkewAdam: tiered optimizer state for Mixture-of-Experts models.

Per tier (pagedoptim.optim.tiers) and rank, a parameter keeps (docs/skewadam.md):

  tier      >= 2-D parameter                          1-D / 0-D parameter
  backbone  momentum + factored second moment         momentum + exact second moment
  experts   factored second moment (per expert, 3-D)  exact second moment
  router    momentum + exact second moment (2-D only) momentum + exact second moment

Momentum ("exp_avg") is companded 8-bit with state_bits=8 (fp32 with 32), exact second
moments ("exp_avg_sq") are fp32, and bf16/fp16 parameters carry the master residual of
master_bits. The factored second moment is Adafactor's: fp32 running means of g^2 + eps over
the rows and the columns of each matrix, kept in pages of their own (one slot per factored
parameter holding [E * rows] row means then [E * cols] column means, the stream
"exp_avg_sq_factors"), so all of SkewAdam's state is paged. state_dict() hands them out as
"exp_avg_sq_row" ([rows], or [E, rows]) and "exp_avg_sq_col" ([cols] or [E, cols]).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Union

import torch

from pagedoptim._validation import check_betas, check_non_negative
from pagedoptim.engine.lifecycle import open_only
from pagedoptim.engine.step_batch import StepBatch
from pagedoptim.optim import torch_flags
from pagedoptim.optim.optimizer import PagedOptimizer
from pagedoptim.optim.skewadam_store import SkewAdamStore
from pagedoptim.optim.tiers import (BACKBONE, EXPERTS, check_tier, compile_tier_patterns,
                                    names_by_param, tier_of_name)
from pagedoptim.paging.options import PagingOptions
from pagedoptim.state import format as state_format
from pagedoptim.state.format import Moment


def check_param_for_tier(p: torch.Tensor, tier: str, where: str, named: bool) -> None:
    if p.is_complex():
        raise ValueError(f"{where} is complex ({p.dtype}); SkewAdam's factored statistics are "
                         "for real params (pagedoptim.AdamW takes complex params)")
    if p.dim() > 3:
        raise ValueError(f"{where} has {p.dim()} dimensions; SkewAdam takes 0-D to 2-D "
                         "parameters and [experts, rows, cols] expert tensors")
    if p.dim() == 3 and tier != EXPERTS:
        if named:
            how = ("name it so the tier patterns see an 'experts' component, or give its "
                   "group tier='experts'")
        else:
            # A 3-D tensor is evidently an MoE model's, and then unnamed 2-D tensors are
            # ambiguous too: the router cannot be told from a dense weight by its shape.
            how = ("unnamed parameters (as Trainer passes them) cannot be put in tiers: pass "
                   "names_from=model so the tiers come from model.named_parameters(), give "
                   "model.named_parameters() itself, or give each group a tier")
        raise ValueError(f"{where} is 3-D {tuple(p.shape)} but in tier '{tier}': only the "
                         f"'experts' tier takes [experts, rows, cols] tensors ({how})")


class SkewAdam(PagedOptimizer):
    """Tiered Adam for Mixture-of-Experts models (see the module docstring).

    named_params_or_groups: model.named_parameters() (the default tier patterns read the
    names), plain parameters, or groups; a group may set tier='backbone'|'experts'|'router'
    for all of its parameters. tiers: None for the default name patterns, or a mapping
    {'router': patterns, 'experts': patterns} replacing them (pagedoptim.optim.tiers).
    names_from: the model the parameters belong to. Unnamed parameters (Trainer's and
    accelerate's groups of plain tensors) then take their names, and so their tiers, from
    model.named_parameters(), exactly as if those pairs had been given; a parameter the
    model does not have raises. Without it, unnamed parameters are backbone, and a 3-D one
    raises (see check_param_for_tier). (Not `model=`: Trainer takes a `model` keyword
    argument as the optimizer's params, LOMO's convention, and drops it.)
    eps is added to g^2 (Adafactor's eps1, hence the tiny default), not to the denominator.
    """

    _kind = "skewadam"
    _store_class = SkewAdamStore
    _FIRST = state_format.EXP_AVG
    _SECOND = state_format.EXP_AVG_SQ

    def __init__(
        self,
        named_params_or_groups: Iterable[Any],
        lr: Union[float, torch.Tensor] = 1e-3,
        betas: tuple[Union[float, torch.Tensor], Union[float, torch.Tensor]] = (0.9, 0.999),
        eps: float = 1e-30,
        weight_decay: float = 0.0,
        *,
        tiers: Optional[Mapping[str, Any]] = None,
        names_from: Optional[torch.nn.Module] = None,
        state_bits: int = 8,
        master_bits: Optional[int] = 24,
        min_8bit_size: int = state_format.DEFAULT_MIN_8BIT_SIZE,
        offload: Optional[str] = None,
        nvme_dir: Optional[str] = None,
        cache_bytes: Optional[int] = None,
        page_bytes: Optional[int] = None,
        prefetch: int = 4,
        policy: str = "auto",
        release_grads: bool = False,
        max_grad_norm: Optional[float] = None,
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        defaults.update(torch_flags.check_flags(
            type(self).__name__, foreach, fused, capturable, differentiable))
        self._check_group(defaults)
        self._tier_patterns = compile_tier_patterns(tiers)
        self._model_names = names_by_param(names_from)
        options = PagingOptions(state_bits=state_bits, master_bits=master_bits,
                                min_8bit_size=min_8bit_size,
                                offload=offload, nvme_dir=nvme_dir, cache_bytes=cache_bytes,
                                page_bytes=page_bytes, prefetch=prefetch, policy=policy,
                                release_grads=release_grads,
                                max_grad_norm=max_grad_norm)
        super().__init__(named_params_or_groups, defaults, options)

    # -- hyperparameters and tiers ---------------------------------------------------------

    @staticmethod
    def _check_group(group: dict[str, Any]) -> tuple:
        lr = check_non_negative(group["lr"], "lr")
        beta1, beta2 = check_betas(group["betas"])
        eps = check_non_negative(group["eps"], "eps")
        if eps == 0.0:
            raise ValueError("Invalid eps: 0.0 (eps must be > 0: it keeps the row and column "
                             "means of g^2 + eps of an all-zero gradient row away from 0/0)")
        weight_decay = check_non_negative(group["weight_decay"], "weight_decay")
        return (lr, beta1, beta2, eps, weight_decay)

    def _group_hyperparameters(self, group: dict[str, Any]) -> tuple:
        return self._check_group(group)

    @open_only
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        explicit = param_group.get("tier")
        if explicit is not None:
            check_tier(explicit)
        params = param_group["params"]
        entries = [params] if isinstance(params, torch.Tensor) else params
        resolved: list[str] = []
        if not isinstance(entries, (set, frozenset)):  # the base class rejects sets
            entries = self._named_from_model(list(entries))
            for index, entry in enumerate(entries):
                name, p = entry if isinstance(entry, tuple) else (None, entry)
                if explicit is not None:
                    tier = explicit
                elif name is not None:
                    tier = tier_of_name(name, self._tier_patterns)
                else:
                    tier = BACKBONE
                if isinstance(p, torch.Tensor):
                    where = f"param '{name}'" if name is not None else f"params[{index}]"
                    check_param_for_tier(p, tier, where, named=name is not None)
                resolved.append(tier)
        super().add_param_group({**param_group, "params": entries})
        # Kept in the group, so state_dict() records which layout the state has.
        self.param_groups[-1]["param_tiers"] = resolved
        self._store.groups_changed()

    def _named_from_model(self, entries: list[Any]) -> list[Any]:
        """The entries, with each unnamed parameter paired with its name in names_from."""
        names = self._model_names
        if names is None:
            return entries
        named = []
        for index, entry in enumerate(entries):
            if isinstance(entry, torch.Tensor):
                if entry not in names:
                    raise ValueError(f"params[{index}] (shape {tuple(entry.shape)}) is not a "
                                     "parameter of the module given as names_from=, so it has "
                                     "no name to take its tier from: give it as a (name, param) "
                                     "pair or in a group with a tier")
                entry = (names[entry], entry)
            named.append(entry)
        return named

    def param_tiers(self) -> dict[str, str]:
        """Every parameter's tier, by name (or 'params[i]' for unnamed parameters)."""
        return {name: self._store.layout(p).tier for name, p in self._store.named_params()}

    # -- state layout ----------------------------------------------------------------------

    def _moments(self) -> list[Moment]:
        return [self._FIRST, self._SECOND]

    # -- the step --------------------------------------------------------------------------

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # The statistics see the whole gradient before the step, so GradScaler unscales and
        # checks it first (on CUDA that costs GradScaler one sync); released gradients too,
        # through release_guard.
        return False

    def _native_step(self, batch: StepBatch) -> None:
        self._store.engine.step_skewadam(*batch.native_args(), batch.layouts)

    # -- state_dict ------------------------------------------------------------------------

    def _check_loaded_group(self, saved: dict[str, Any], group: dict[str, Any],
                            index: int) -> None:
        """The loaded group's param_tiers decide its params' state layout: one valid tier
        per param that the param's shape allows. A group saved without them keeps the
        tiers this optimizer gave its params."""
        super()._check_loaded_group(saved, group, index)
        tiers = saved.setdefault("param_tiers", list(group["param_tiers"]))
        where = f"loaded param_groups[{index}]['param_tiers']"
        if not isinstance(tiers, (list, tuple)) or len(tiers) != len(group["params"]):
            raise ValueError(f"{where} must be a list of {len(group['params'])} tiers (one per "
                             f"param), got {tiers!r}")
        for position, (p, tier) in enumerate(zip(group["params"], tiers)):
            check_param_for_tier(p, check_tier(tier, f"{where}[{position}]"),
                                 f"{where}[{position}]", named=True)

    def __getstate__(self) -> dict[str, Any]:
        # names_from is not kept: it named the parameters already in the groups.
        return {**super().__getstate__(), "_tier_patterns": self._tier_patterns}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        # The base class rebuilds the engine from the saved streams, which needs these.
        self._tier_patterns = state.pop("_tier_patterns")
        self._model_names = None
        super().__setstate__(state)
