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

import dataclasses
from typing import Any, Iterable, Mapping, Optional, Union

import torch

from pagedoptim.optim import torch_flags

from pagedoptim.state import sharding as sharded_params, format as state_format
from pagedoptim._validation import check_betas, check_non_negative
from pagedoptim.optim.optimizer import LOW_PRECISION_DTYPES, PagedOptimizer
from pagedoptim.engine.lifecycle import open_only
from pagedoptim.paging.options import PagingOptions
from pagedoptim.state.param_state import where_written
from pagedoptim.state.format import Moment, StreamSpec
from pagedoptim.optim.tiers import (BACKBONE, EXPERTS, ROUTER, TIERS, check_tier,
                              compile_tier_patterns, names_by_param, tier_of_name)

FACTORS = "exp_avg_sq_factors"
ROW = "exp_avg_sq_row"
COL = "exp_avg_sq_col"

# Per-element stream sets, in kind order: (momentum, exact second moment); each with and
# without the master residual (kind = 2 * index + residual). The factors are the last kind.
_ELEMENT_LAYOUTS = ((True, False), (False, False), (True, True), (False, True))
_FACTOR_KIND = 2 * len(_ELEMENT_LAYOUTS)


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """How SkewAdam keeps one parameter's state."""

    tier: str
    factored: bool   # factored second moment (else exact)
    momentum: bool
    experts: int = 1  # the factored shape [experts, rows, cols]
    rows: int = 0
    cols: int = 0

    @property
    def factor_numel(self) -> int:
        return self.experts * (self.rows + self.cols) if self.factored else 0


def layout_of(p: torch.Tensor, tier: str) -> ParamLayout:
    """The state layout of a parameter of this tier (shape already validated); of its local
    shard for a DTensor param."""
    p = sharded_params.local_tensor(p)
    momentum = tier != EXPERTS
    if tier == ROUTER or p.dim() < 2 or p.numel() == 0:
        return ParamLayout(tier, False, momentum)
    experts, rows, cols = p.shape if p.dim() == 3 else (1, *p.shape)
    return ParamLayout(tier, True, momentum, int(experts), int(rows), int(cols))


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
        offload: Optional[str] = None,
        nvme_dir: Optional[str] = None,
        cache_bytes: Optional[int] = None,
        page_bytes: Optional[int] = None,
        prefetch: int = 4,
        policy: str = "auto",
        release_grads: bool = False,
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
        self._factor_slots: dict[torch.Tensor, int] = {}
        self._layouts: Optional[dict[torch.Tensor, ParamLayout]] = None
        self._batch_layouts: list[tuple[int, int, int, int, bool]] = []
        options = PagingOptions(state_bits=state_bits, master_bits=master_bits,
                                offload=offload, nvme_dir=nvme_dir, cache_bytes=cache_bytes,
                                page_bytes=page_bytes, prefetch=prefetch, policy=policy,
                                release_grads=release_grads)
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
        self._layouts = None

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

    def _layout(self, p: torch.Tensor) -> ParamLayout:
        if self._layouts is None:
            layouts = {}
            for group in self.param_groups:
                for q, tier in zip(group["params"], group["param_tiers"]):
                    layouts[q] = layout_of(q, check_tier(tier, "param_tiers entry"))
            self._layouts = layouts
        return self._layouts[p]

    def param_tiers(self) -> dict[str, str]:
        """Every parameter's tier, by name (or 'params[i]' for unnamed parameters)."""
        return {name: self._layout(p).tier for name, p in self._named_params()}

    def _named_params(self) -> list[tuple[str, torch.Tensor]]:
        named = []
        for group in self.param_groups:
            names = group.get("param_names")
            for q, p in enumerate(group["params"]):
                named.append((names[q] if names else f"params[{len(named)}]", p))
        return named

    # -- state layout ----------------------------------------------------------------------

    def _moments(self) -> list[Moment]:
        return [self._FIRST, self._SECOND]

    def _all_moments(self) -> list[Moment]:
        return [self._FIRST, self._SECOND]

    def _stream_kinds(self) -> list[list[StreamSpec]]:
        momentum = state_format.moment_streams(self._FIRST, self._options.state_bits)
        second = StreamSpec(self._SECOND.name, 4 * state_format.GROUP_SIZE, False, torch.float32)
        residual = ([state_format.residual_stream(self._options.master_bits)]
                    if self._options.master_bits is not None else [])
        kinds: list[list[StreamSpec]] = []
        for has_momentum, exact in _ELEMENT_LAYOUTS:
            streams = (momentum if has_momentum else []) + ([second] if exact else [])
            kinds += [list(streams), streams + residual]
        kinds.append([StreamSpec(FACTORS, 4 * state_format.GROUP_SIZE, False, torch.float32)])
        return kinds

    def _kind_of(self, p: torch.Tensor) -> int:
        layout = self._layout(p)
        index = _ELEMENT_LAYOUTS.index((layout.momentum, not layout.factored))
        with_residual = self._options.master_bits is not None and p.dtype in LOW_PRECISION_DTYPES
        return 2 * index + int(with_residual)

    def _slot(self, p: torch.Tensor) -> int:
        slot = super()._slot(p)
        if p not in self._factor_slots:
            layout = self._layout(p)
            if layout.factored:
                self._factor_layout(p)  # raises where a shard cuts a factored matrix
            self._factor_slots[p] = (self._engine.register_param(layout.factor_numel,
                                                                 _FACTOR_KIND)
                                     if layout.factored else -1)
        return slot

    # -- the step --------------------------------------------------------------------------

    def _add_to_batch(self, batch: Any, p: torch.Tensor, grad: torch.Tensor,
                      group_id: int, **tensors: Optional[torch.Tensor]) -> None:
        if not batch.params:
            self._batch_layouts = []
        super()._add_to_batch(batch, p, grad, group_id, **tensors)
        layout = self._layout(p)
        self._batch_layouts.append((self._factor_slots[p], layout.experts, layout.rows,
                                    layout.cols, layout.momentum))

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # The statistics see the whole gradient before the step, so GradScaler unscales and
        # checks it first (on CUDA that costs GradScaler one sync), except with
        # release_grads, where step() says why GradScaler cannot work.
        return self._options.release_grads

    def _native_step(self, *args: Any, **amp: Any) -> None:
        layouts, self._batch_layouts = self._batch_layouts, []
        self._engine.step_skewadam(*args, layouts)

    # -- state_dict ------------------------------------------------------------------------

    def _state_stream_names(self) -> set[str]:
        return super()._state_stream_names() | {ROW, COL}

    def _state_stream_keys(self, p: torch.Tensor) -> list[str]:
        keys = super()._state_stream_keys(p)
        if self._engine is not None and self._factor_slots.get(p, -1) >= 0:
            keys += [ROW, COL]
        return keys

    def _factor_layout(self, p: torch.Tensor) -> Optional[tuple[Any, Any]]:
        """How the row and the column means of DTensor param p are sharded (None: p is not a
        DTensor). They are exact only where each rank holds whole [rows, cols] matrices: the
        column means of a matrix split across ranks would need every rank's rows. Decided
        from the placements, so that every rank decides alike."""
        layout = self._shard_layout(p)
        if layout is None:
            return None
        from torch.distributed.tensor import Shard
        elements = layout.elements
        ndim = len(elements.global_shape)
        cuts = [pl.dim % ndim for ranks, pl in zip(layout.mesh.shape, layout.placements)
                if isinstance(pl, Shard) and ranks > 1]
        if any(dim != 0 or ndim != 3 for dim in cuts):
            raise ValueError(
                f"{self._describe(p)} is sharded {layout.placements} so that its "
                f"{elements.global_shape} matrices, whose second moment SkewAdam factors "
                "into row and column means, are split across ranks: the means need the "
                "whole matrix on one rank. Shard [experts, rows, cols] tensors along dim 0 "
                "(the experts) only, and keep 2-D params in the factored tiers whole (or use "
                "pagedoptim.AdamW under FSDP2)")
        experts, offset = elements.local_shape[0], elements.offset[0]
        boxes = []
        for n in elements.global_shape[-2:]:
            if ndim == 3:
                boxes.append(sharded_params.Box((elements.global_shape[0], n), (experts, n),
                                                (offset, 0)))
            else:
                boxes.append(sharded_params.Box((n,), (n,), (0,)))
        return tuple(sharded_params.ShardLayout(layout.mesh, layout.placements, box)
                     for box in boxes)

    def _factors(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The row and column means of p's factored second moment (new tensors), each
        [experts, n] for a 3-D expert tensor and flat otherwise."""
        layout = self._layout(p)
        values = self._engine.read_stream(self._factor_slots[p], FACTORS).view(torch.float32)
        split = layout.experts * layout.rows
        row, col = values[:split], values[split:]
        if p.dim() == 3:
            row, col = row.view(layout.experts, -1), col.view(layout.experts, -1)
        return row, col

    def _read_state_tensor(self, p: torch.Tensor, key: str) -> torch.Tensor:
        if key in (ROW, COL):
            row, col = self._factors(p)
            layouts = self._factor_layout(p)
            if layouts is not None:  # DTensors, placed as the param is
                row, col = (sharded_params.as_dtensor(layout, value, False,
                                                      lambda: self._describe(p))
                            for layout, value in zip(layouts, (row, col)))
            return row if key == ROW else col
        return super()._read_state_tensor(p, key)

    def _write_state_tensors(self, p: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        factors = {key: values[key] for key in (ROW, COL) if key in values}
        streams = {key: value for key, value in values.items() if key not in factors}
        if streams:
            super()._write_state_tensors(p, streams)
        if not factors:
            return
        where = where_written(factors)
        self._slot(p)
        if self._factor_slots.get(p, -1) < 0:
            raise ValueError(f"{where}: this param's '{self._layout(p).tier}' tier keeps no "
                             "factored second moment")
        row, col = self._factors(p)
        given = {ROW: row, COL: col, **factors}
        self._write_factors(p, given[ROW], given[COL], where)

    def _write_factors(self, p: torch.Tensor, row: torch.Tensor, col: torch.Tensor,
                       where: str) -> None:
        layouts = self._factor_layout(p)
        if layouts is not None:
            row, col = (sharded_params.local_part(layout, value, False, lambda: where)
                        for layout, value in zip(layouts, (row, col)))
        layout = self._layout(p)
        if (row.numel() != layout.experts * layout.rows
                or col.numel() != layout.experts * layout.cols):
            raise ValueError(f"{where}: '{ROW}' / '{COL}' have {row.numel()} / {col.numel()} "
                             f"elements, expected {layout.experts * layout.rows} / "
                             f"{layout.experts * layout.cols}")
        values = torch.cat([row.detach().reshape(-1).cpu(), col.detach().reshape(-1).cpu()])
        raw = values.to(dtype=torch.float32).contiguous()
        self._engine.write_stream(self._factor_slots[p], FACTORS, raw.view(torch.uint8))

    def _reset_param_state(self, p: torch.Tensor) -> None:
        super()._reset_param_state(p)
        slot = self._factor_slots.get(p, -1) if self._engine is not None else -1
        if slot >= 0:
            size = self._engine.stream_bytes(slot, FACTORS)
            self._engine.write_stream(slot, FACTORS, torch.zeros(size, dtype=torch.uint8))

    def _planned_state(self) -> list[tuple[int, int]]:
        planned = super()._planned_state()
        for p in dict.fromkeys(self._indexed_params()):
            layout = self._layout(p)
            if layout.factored:
                planned.append((_FACTOR_KIND, layout.factor_numel))
        return planned

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

    def _on_groups_loaded(self) -> None:
        self._layouts = None

    def _checkpoint_slots(self, p: torch.Tensor) -> list[tuple[str, int, int, list[StreamSpec]]]:
        slots = super()._checkpoint_slots(p)
        factor_slot = self._factor_slots.get(p, -1) if self._engine is not None else -1
        if factor_slot >= 0:
            slots.append(("factors", factor_slot, self._layout(p).factor_numel,
                          self._kinds[_FACTOR_KIND]))
        return slots

    def _forget_engine(self) -> None:
        super()._forget_engine()
        self._factor_slots = {}

    def _scatter_streams(self, streams: dict[int, dict[str, torch.Tensor]]) -> None:
        self._factor_slots = {}
        self._layouts = None
        element_streams = {index: {k: v for k, v in given.items() if k not in (ROW, COL)}
                           for index, given in streams.items()}
        super()._scatter_streams(element_streams)
        params = self._indexed_params()
        for index in sorted(streams):
            p = params[index]
            self._slot(p)
            if self._factor_slots[p] < 0:
                continue
            given = streams[index]
            if ROW not in given or COL not in given:
                raise ValueError(f"state for param {index} has no '{ROW}' / '{COL}': its "
                                 f"'{self._layout(p).tier}' tier keeps a factored second "
                                 "moment")
            self._write_factors(p, given[ROW], given[COL], f"state for param {index}")

    def __getstate__(self) -> dict[str, Any]:
        # names_from is not kept: it named the parameters already in the groups.
        return {**super().__getstate__(), "_tier_patterns": self._tier_patterns}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        # The base class rebuilds the engine from the saved streams, which needs these.
        self._tier_patterns = state.pop("_tier_patterns")
        self._batch_layouts = []
        self._model_names = None
        self._factor_slots = {}
        self._layouts = None
        super().__setstate__(state)

    # -- reports ---------------------------------------------------------------------------

    @open_only
    def memory_report(self) -> dict[str, Any]:
        """The base report plus 'factor_bytes' (the row and column means), 'tiers' (per
        tier: params, elements, state bytes) and 'params' (per parameter name: tier, shape,
        second-moment form, momentum, state bytes). Per-tier and per-parameter bytes are
        the streams' payload and the step counter; page slack is only in the totals."""
        report = super().memory_report()
        tiers = {tier: {"num_params": 0, "num_elements": 0, "state_bytes": 0} for tier in TIERS}
        params: dict[str, Any] = {}
        factor_total = 0
        for name, p in self._named_params():
            layout = self._layout(p)
            state_bytes = 0
            slot = self._slots.get(p, -1) if self._engine is not None else -1
            if slot >= 0:
                state_bytes += sum(self._engine.stream_bytes(slot, spec.name)
                                   for spec in self._streams_of(p))
            factor_slot = self._factor_slots.get(p, -1) if self._engine is not None else -1
            if factor_slot >= 0:
                factor_bytes = self._engine.stream_bytes(factor_slot, FACTORS)
                factor_total += factor_bytes
                state_bytes += factor_bytes
            if "step" in self.state.get(p, {}):  # dict.get: no entry is made for p
                state_bytes += 4
            params[name] = {"tier": layout.tier,
                            "shape": tuple(sharded_params.local_tensor(p).shape),
                            "second_moment": "factored" if layout.factored else "exact",
                            "momentum": layout.momentum, "state_bytes": state_bytes}
            tiers[layout.tier]["num_params"] += 1
            tiers[layout.tier]["num_elements"] += sharded_params.local_tensor(p).numel()
            tiers[layout.tier]["state_bytes"] += state_bytes
        report["factor_bytes"] = factor_total
        report["page_slack_bytes"] -= factor_total
        report["tiers"] = tiers
        report["params"] = params
        return report

