"""SkewAdamStore: SkewAdam's state in pages (docs/skewadam.md).

Each param keeps the element streams its tier gives it (momentum, exact second moment,
master residual: one of the kinds below) and, where its second moment is factored, a second
slot of the factor kind: [experts * rows] row means then [experts * cols] column means, fp32,
the stream "exp_avg_sq_factors". optimizer.state and state_dict() show them as
"exp_avg_sq_row" ([rows] or [experts, rows]) and "exp_avg_sq_col".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from pagedoptim.engine.state_store import LOW_PRECISION_DTYPES, StateStore
from pagedoptim.optim.tiers import EXPERTS, ROUTER, TIERS, check_tier
from pagedoptim.paging.state_plan import STEP_COUNTER_BYTES
from pagedoptim.state import format as state_format
from pagedoptim.state import sharding as sharded_params
from pagedoptim.state.format import StreamSpec

FACTORS = "exp_avg_sq_factors"
ROW = "exp_avg_sq_row"
COL = "exp_avg_sq_col"

# Per-element stream sets, in kind order: (momentum, exact second moment); each with and
# without the master residual (kind = 2 * index + residual). The factors are the last kind.
_ELEMENT_LAYOUTS = ((True, False), (False, False), (True, True), (False, True))
FACTOR_KIND = 2 * len(_ELEMENT_LAYOUTS)


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


class SkewAdamStore(StateStore):
    """StateStore with SkewAdam's tiered layout; each param's tier is read from its group's
    'param_tiers' (kept in the group, so state_dict() records which layout the state has)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._factor_slots: dict[torch.Tensor, int] = {}
        self._layouts: Optional[dict[torch.Tensor, ParamLayout]] = None

    def groups_changed(self) -> None:
        """A group was added (SkewAdam.add_param_group, once its 'param_tiers' are set): the
        tiers are read again."""
        self._layouts = None

    def layout(self, p: torch.Tensor) -> ParamLayout:
        if self._layouts is None:
            layouts = {}
            for group in self.optimizer.param_groups:
                for q, tier in zip(group["params"], group["param_tiers"]):
                    layouts[q] = layout_of(q, check_tier(tier, "param_tiers entry"))
            self._layouts = layouts
        return self._layouts[p]

    # -- the layout of the pages -----------------------------------------------------------

    def layout_kinds(self) -> list[list[StreamSpec]]:
        first, second = self.all_moments()
        momentum = state_format.moment_streams(first, self.options.state_bits)
        exact = StreamSpec(second.name, 4 * state_format.GROUP_SIZE, False, torch.float32)
        residual = ([state_format.residual_stream(self.options.master_bits)]
                    if self.options.master_bits is not None else [])
        kinds: list[list[StreamSpec]] = []
        for has_momentum, has_exact in _ELEMENT_LAYOUTS:
            streams = (momentum if has_momentum else []) + ([exact] if has_exact else [])
            kinds += [list(streams), streams + residual]
        kinds.append([StreamSpec(FACTORS, 4 * state_format.GROUP_SIZE, False, torch.float32)])
        return kinds

    def layout_kind_of(self, p: torch.Tensor) -> int:
        layout = self.layout(p)
        index = _ELEMENT_LAYOUTS.index((layout.momentum, not layout.factored))
        with_residual = (self.options.master_bits is not None
                         and p.dtype in LOW_PRECISION_DTYPES)
        return 2 * index + int(with_residual)

    def planned_state(self) -> list[tuple[int, int, int]]:
        planned = super().planned_state()
        for p in dict.fromkeys(self.params()):
            layout = self.layout(p)
            if layout.factored:
                planned.append((FACTOR_KIND, layout.factor_numel, 0))
        return planned

    def slot(self, p: torch.Tensor) -> int:
        slot = super().slot(p)
        if p not in self._factor_slots:
            layout = self.layout(p)
            if layout.factored:
                self._factor_sharding(p)  # raises where a shard cuts a factored matrix
            self._factor_slots[p] = (self.engine.register_param(layout.factor_numel,
                                                                FACTOR_KIND)
                                     if layout.factored else -1)
        return slot

    def factor_slot_of(self, p: torch.Tensor) -> int:
        return self._factor_slots.get(p, -1) if self.engine is not None else -1

    def checkpoint_slots(self, p: torch.Tensor
                         ) -> list[tuple[str, int, int, list[StreamSpec], int]]:
        slots = super().checkpoint_slots(p)
        factor_slot = self.factor_slot_of(p)
        if factor_slot >= 0:
            slots.append(("factors", factor_slot, self.layout(p).factor_numel,
                          self._kinds[FACTOR_KIND], 0))
        return slots

    def batch_layout(self, p: torch.Tensor) -> tuple[int, int, int, int, bool]:
        """Where the factors of p are and their shape: the native step's layout entry."""
        layout = self.layout(p)
        return (self._factor_slots[p], layout.experts, layout.rows, layout.cols,
                layout.momentum)

    def _factor_sharding(self, p: torch.Tensor) -> Optional[tuple[Any, Any]]:
        """How the row and the column means of DTensor param p are sharded (None: p is not a
        DTensor). They are exact only where each rank holds whole [rows, cols] matrices: the
        column means of a matrix split across ranks would need every rank's rows. Decided
        from the placements, so that every rank decides alike."""
        layout = self.shard_layout(p)
        if layout is None:
            return None
        from torch.distributed.tensor import Shard
        elements = layout.elements
        ndim = len(elements.global_shape)
        cuts = [pl.dim % ndim for ranks, pl in zip(layout.mesh.shape, layout.placements)
                if isinstance(pl, Shard) and ranks > 1]
        if any(dim != 0 or ndim != 3 for dim in cuts):
            raise ValueError(
                f"{self.describe(p)} is sharded {layout.placements} so that its "
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

    # -- state in pages --------------------------------------------------------------------

    def stream_names(self) -> set[str]:
        return super().stream_names() | {ROW, COL}

    def stream_keys(self, p: torch.Tensor) -> list[str]:
        keys = super().stream_keys(p)
        if self.factor_slot_of(p) >= 0:
            keys += [ROW, COL]
        return keys

    def _factors(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The row and column means of p's factored second moment (new tensors), each
        [experts, n] for a 3-D expert tensor and flat otherwise."""
        layout = self.layout(p)
        values = self.engine.read_stream(self._factor_slots[p], FACTORS).view(torch.float32)
        split = layout.experts * layout.rows
        row, col = values[:split], values[split:]
        if p.dim() == 3:
            row, col = row.view(layout.experts, -1), col.view(layout.experts, -1)
        return row, col

    def read(self, p: torch.Tensor, key: str) -> torch.Tensor:
        if key in (ROW, COL):
            row, col = self._factors(p)
            shardings = self._factor_sharding(p)
            if shardings is not None:  # DTensors, placed as the param is
                row, col = (sharded_params.as_dtensor(sharding, value, False,
                                                      lambda: self.describe(p))
                            for sharding, value in zip(shardings, (row, col)))
            return row if key == ROW else col
        return super().read(p, key)

    def write(self, p: torch.Tensor, values: dict[str, torch.Tensor], where: str) -> None:
        factors = {key: values[key] for key in (ROW, COL) if key in values}
        streams = {key: value for key, value in values.items() if key not in factors}
        if streams:
            super().write(p, streams, where)
        if not factors:
            return
        self.slot(p)
        if self._factor_slots.get(p, -1) < 0:
            raise ValueError(f"{where}: this param's '{self.layout(p).tier}' tier keeps no "
                             "factored second moment")
        row, col = self._factors(p)
        given = {ROW: row, COL: col, **factors}
        self._write_factors(p, given[ROW], given[COL], where)

    def _write_factors(self, p: torch.Tensor, row: torch.Tensor, col: torch.Tensor,
                       where: str) -> None:
        shardings = self._factor_sharding(p)
        if shardings is not None:
            row, col = (sharded_params.local_part(sharding, value, False, lambda: where)
                        for sharding, value in zip(shardings, (row, col)))
        layout = self.layout(p)
        if (row.numel() != layout.experts * layout.rows
                or col.numel() != layout.experts * layout.cols):
            raise ValueError(f"{where}: '{ROW}' / '{COL}' have {row.numel()} / {col.numel()} "
                             f"elements, expected {layout.experts * layout.rows} / "
                             f"{layout.experts * layout.cols}")
        values = torch.cat([row.detach().reshape(-1).cpu(), col.detach().reshape(-1).cpu()])
        raw = values.to(dtype=torch.float32).contiguous()
        self.engine.write_stream(self._factor_slots[p], FACTORS, raw.view(torch.uint8))

    def reset(self, p: torch.Tensor) -> None:
        super().reset(p)
        slot = self.factor_slot_of(p)
        if slot >= 0:
            self._zero_stream(slot, FACTORS)

    def write_all(self, streams: dict[int, dict[str, torch.Tensor]]) -> None:
        element_streams = {index: {k: v for k, v in given.items() if k not in (ROW, COL)}
                           for index, given in streams.items()}
        super().write_all(element_streams)
        params = self.params()
        for index in sorted(streams):
            p = params[index]
            self.slot(p)
            if self._factor_slots[p] < 0:
                continue
            given = streams[index]
            if ROW not in given or COL not in given:
                raise ValueError(f"state for param {index} has no '{ROW}' / '{COL}': its "
                                 f"'{self.layout(p).tier}' tier keeps a factored second "
                                 "moment")
            self._write_factors(p, given[ROW], given[COL], f"state for param {index}")

    # -- reports ---------------------------------------------------------------------------

    def named_params(self) -> list[tuple[str, torch.Tensor]]:
        """(name, param) of every param: its name in its group's param_names, or
        'params[i]' for unnamed params."""
        named = []
        for group in self.optimizer.param_groups:
            names = group.get("param_names")
            for q, p in enumerate(group["params"]):
                named.append((names[q] if names else f"params[{len(named)}]", p))
        return named

    def memory_report(self, state_map: Any) -> dict[str, Any]:
        """The base report plus 'factor_bytes' (the row and column means), 'tiers' (per
        tier: params, elements, state bytes) and 'params' (per parameter name: tier, shape,
        second-moment form, momentum, state bytes). Per-tier and per-parameter bytes are
        the streams' payload and the step counter; page slack is only in the totals."""
        report = super().memory_report(state_map)
        tiers = {tier: {"num_params": 0, "num_elements": 0, "state_bytes": 0} for tier in TIERS}
        params: dict[str, Any] = {}
        factor_total = 0
        for name, p in self.named_params():
            layout = self.layout(p)
            factor_slot = self.factor_slot_of(p)
            factor_bytes = self.engine.stream_bytes(factor_slot, FACTORS) if factor_slot >= 0 else 0
            factor_total += factor_bytes
            state_bytes = self.param_stream_bytes(p) + factor_bytes
            if "step" in state_map.get(p, {}):  # dict.get: no entry is made for p
                state_bytes += STEP_COUNTER_BYTES
            local = sharded_params.local_tensor(p)
            params[name] = {"tier": layout.tier, "shape": tuple(local.shape),
                            "second_moment": "factored" if layout.factored else "exact",
                            "momentum": layout.momentum, "state_bytes": state_bytes}
            tiers[layout.tier]["num_params"] += 1
            tiers[layout.tier]["num_elements"] += local.numel()
            tiers[layout.tier]["state_bytes"] += state_bytes
        report["factor_bytes"] = factor_total
        report["page_slack_bytes"] -= factor_total
        report["tiers"] = tiers
        report["params"] = params
        return report
