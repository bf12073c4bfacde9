"""StateStore: the Python face of one native `PagedState`, the pages an optimizer's state
lives in.

An optimizer (pagedoptim/optim/optimizer.py) keeps one store. The store owns the native
engine (created at the first step, so no state exists before it), the params' slots in it,
the stream layout of each kind of param (which moments, codes and scales, master residual),
the shard layouts of DTensor params, and the translation between the bytes in the pages and
the tensors that `optimizer.state`, state_dict() and checkpoints hand out. Algorithms with
state laid out otherwise subclass it (SkewAdam's factored second moments:
pagedoptim/optim/skewadam_store.py).

A store never changes what it holds behind the optimizer's back: a load builds a new store
(`fresh()`) and the optimizer swaps it in only once all of the loaded state checked out
(`replacing_state`), so a failed load leaves the old store, engine and pages untouched.

The store holds its optimizer weakly (the optimizer holds the store): it reads the
optimizer's param_groups for the params, and asks the algorithm which moments its groups
need (`_moments`, the one hook it calls).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import weakref
from typing import Any, Iterator, Optional

import torch

from pagedoptim import paging
from pagedoptim._native import native
from pagedoptim.engine import compiled_step, gradient_store, interrupted_step, lifecycle
from pagedoptim.paging import state_plan
from pagedoptim.paging.state_plan import STEP_COUNTER_BYTES
from pagedoptim.paging.options import PagingOptions
from pagedoptim.state import checks as state_dict_checks
from pagedoptim.state import format as state_format
from pagedoptim.state import sharding as sharded_params
from pagedoptim.state.format import Moment, StreamSpec
from pagedoptim.state.param_state import ParamState

LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)

# Page kinds: every parameter's state has the optimizer's moment streams; bf16/fp16
# parameters with master_bits on have the master residual too.
KIND_PLAIN = 0
KIND_WITH_RESIDUAL = 1

# A model split over several GPUs (device_map="auto", a QLoRA split over two cards).
ONE_OPTIMIZER_PER_DEVICE = (
    "An optimizer keeps its state in one engine on one device (its pages, cache and copy "
    "streams); for a model split over devices, build one optimizer per device, e.g. "
    "[po.AdamW([p for p in model.parameters() if p.device == d]) for d in devices] and step "
    "each, or shard the model with FSDP2 (docs/drop_in.md, 'Params on several devices')")


class StateStore:
    """The paged state of one optimizer (see the module docstring).

    algorithm: the native algorithm ('adamw', 'sgd', 'lion', 'skewadam'); its moments are
    `state_format.MOMENTS[algorithm]`. device: where the params were when the optimizer
    was built (None: no params yet); the engine's device is decided at its creation."""

    def __init__(self, optimizer: Any, algorithm: str, options: PagingOptions,
                 device: Optional[torch.device] = None) -> None:
        self._optimizer_ref = weakref.ref(optimizer)
        self.algorithm = algorithm
        self.options = options
        self.device = device
        self.engine: Any = None           # the native PagedState, from the first step on
        self.page_bytes: Optional[int] = None  # chosen when the engine is created
        # What the last step did before it raised (engine/interrupted_step.py); a new
        # store's engine has no step to finish.
        self.interrupted: Optional[interrupted_step.Interrupted] = None
        self.closed = False
        self._kinds: list[list[StreamSpec]] = []
        self._slots: dict[torch.Tensor, int] = {}
        self._shard_layouts: dict[torch.Tensor, sharded_params.ShardLayout] = {}

    def fresh(self) -> "StateStore":
        """An empty store of the same algorithm, settings and device: what a load fills
        before it replaces this one."""
        return type(self)(self.optimizer, self.algorithm, self.options, self.device)

    def close(self) -> None:
        """The optimizer was closed: drops the engine (the last reference to it: the native
        destructors drain in-flight I/O, then close the ring and the page file's
        descriptor), and any use that would create a new one raises."""
        self.closed = True
        self.engine = None
        self.interrupted = None
        self._slots.clear()

    @property
    def optimizer(self) -> Any:
        optimizer = self._optimizer_ref()
        if optimizer is None:
            raise RuntimeError("the optimizer this state belongs to no longer exists")
        return optimizer

    # -- the params ------------------------------------------------------------------------

    def params(self) -> list[torch.Tensor]:
        """Every param of the optimizer's groups, in state_dict order (a param given twice
        appears twice)."""
        return list(itertools.chain.from_iterable(
            g["params"] for g in self.optimizer.param_groups))

    def describe(self, p: torch.Tensor) -> str:
        """'param N (shape (...), dtype)' with N its index in the optimizer's params."""
        for index, q in enumerate(self.params()):
            if q is p:
                return f"param {index} (shape {tuple(p.shape)}, {p.dtype})"
        return f"a param of shape {tuple(p.shape)} ({p.dtype})"

    def engine_device(self) -> Optional[torch.device]:
        """Where the state lives: fixed once the engine exists; before that, where the params
        are now (`opt = po.AdamW(model.parameters()); model.cuda()` is a torch idiom, so the
        device of the params at construction does not bind)."""
        if self.engine is not None:
            return self.device
        params = self.params()
        return params[0].device if params else None

    def steps_on_a_device(self) -> bool:
        """Whether the table kernels step this state: on a CUDA device, or on the simulated
        device (tests) that emulates them, with GradScaler's tensors as the CUDA ones take."""
        if self.engine is not None:
            return self.engine.device != "cpu"
        device = self.engine_device()
        if device is None:
            return False
        return paging.engine_device(paging.store_options(self.options), device) != "cpu"

    def check_page_file_fits(self, device: Optional[torch.device]) -> None:
        """Raises now where the page file of the state on `device` cannot fit its disk."""
        # Meta params (`python -m pagedoptim plan` sizes a 70B model's state with them) never
        # get a page file.
        if device is None or device.type == "meta" \
                or paging.resolve_offload(self.options) != "nvme":
            return
        plan = state_plan.plan_state(self, device)
        needed = plan.num_pages * plan.page_bytes
        if self.options.release_grads:  # the gradient streams' page file goes there too
            needed += gradient_store.payload_bytes(self.params())
        paging.check_page_file_fits(self.options, needed)

    # -- the layout of the pages -----------------------------------------------------------

    def all_moments(self) -> list[Moment]:
        """Every moment the algorithm may keep, whatever its hyperparameters."""
        return list(state_format.MOMENTS[self.algorithm])

    def stream_kinds(self) -> list[list[StreamSpec]]:
        """The streams of each kind of param, in native kind order (fixed once the engine
        exists: the moments come from the groups' hyperparameters at that time)."""
        if self.engine is not None:
            return self._kinds
        return self.build_stream_kinds()

    def build_stream_kinds(self) -> list[list[StreamSpec]]:
        """The stream layout of each kind of param for the groups as they are now: the
        algorithm's `layout_kinds()`, then, with 8-bit state, an fp32 twin of each kind with
        8-bit moments for the params that keep fp32 moments (`state_format.keeps_8bit_state`:
        1-D, small and complex params)."""
        kinds = self.layout_kinds()
        if self.options.state_bits == 8:
            kinds += [state_format.full_precision(kind) for kind in kinds]
        return kinds

    def layout_kinds(self) -> list[list[StreamSpec]]:
        """The streams of each kind of param in the optimizer's state format (the one to
        override for another layout)."""
        moments = [spec for moment in self.optimizer._moments()
                   for spec in state_format.moment_streams(moment, self.options.state_bits)]
        kinds = [moments, list(moments)]
        if self.options.master_bits is not None:
            kinds[KIND_WITH_RESIDUAL].append(state_format.residual_stream(self.options.master_bits))
        return kinds

    def layout_kind_of(self, p: torch.Tensor) -> int:
        """p's kind among `layout_kinds()` (the one to override with them)."""
        if self.options.master_bits is not None and p.dtype in LOW_PRECISION_DTYPES:
            return KIND_WITH_RESIDUAL
        return KIND_PLAIN

    def kind_of(self, p: torch.Tensor) -> int:
        """p's kind: its layout kind, or that kind's fp32 twin where p keeps fp32 moments."""
        kind = self.layout_kind_of(p)
        if self.options.state_bits == 8 and not self.keeps_8bit_state(p):
            kind += len(self.stream_kinds()) // 2
        return kind

    def keeps_8bit_state(self, p: torch.Tensor) -> bool:
        """Whether p's moments are 8-bit (with state_bits=8): see state_format.keeps_8bit_state."""
        return state_format.keeps_8bit_state(p, self.options.min_8bit_size)

    def streams_of(self, p: torch.Tensor) -> list[StreamSpec]:
        return self.stream_kinds()[self.kind_of(p)]

    def planned_state(self) -> list[tuple[int, int, int]]:
        """(kind, elements, row length) of the state every param of the groups will have:
        what the page size is chosen for."""
        return [(self.kind_of(p), state_numel(p), state_format.row_length(state_shape(p)))
                for p in dict.fromkeys(self.params())]

    def ensure_engine(self) -> Any:
        """The native engine, created on first use with a page size chosen for every param
        of the groups."""
        if self.engine is None:
            if self.closed:
                lifecycle.raise_closed(self.optimizer, "its state")
            device = self.engine_device()
            if device != self.device:
                # The params moved after construction (`opt = po.AdamW(model.parameters());
                # model.cuda()`): the paging checks of construction judged another device
                # (the offload tier chosen, the cache against the GPU's free memory).
                paging.check_before_first_step(self.options, device)
                self.check_page_file_fits(device)
                self.device = device
            for index, p in enumerate(self.params()):
                if p.device != self.device:
                    raise ValueError(f"params must all be on one device: param {index} is on "
                                     f"{p.device}, param 0 on {self.device}. "
                                     f"{ONE_OPTIMIZER_PER_DEVICE}")
            kinds = self.stream_kinds()
            store = paging.store_options(self.options)
            device = paging.engine_device(store, self.device)
            self.page_bytes = paging.choose_page_bytes(self.options, store, kinds,
                                                       self.planned_state())
            self.engine = native.PagedState(
                self.algorithm, [[spec.as_native() for spec in kind] for kind in kinds],
                self.page_bytes, store=store, device=device)
            self._kinds = kinds
            if store is not None:
                paging.warn_about_fallbacks(self.engine)
                paging.warn_about_host_offload_on_cpu(store, device)
        return self.engine

    def slot(self, p: torch.Tensor) -> int:
        """The param's slot in the engine; lays out its state on first use (-1: the param
        keeps no state, as in plain SGD)."""
        slot = self._slots.get(p)
        if slot is None:
            engine = self.ensure_engine()
            kind = self.kind_of(p)
            if self._kinds[kind]:
                if any(spec.per_group for spec in self._kinds[kind]):
                    self._check_shard_keeps_groups(p)
                # Pages start zeroed: a zero residual makes the master weight exactly the
                # 16-bit parameter, which is right for a weight never split before.
                slot = engine.register_param(state_numel(p), kind,
                                             state_format.row_length(state_shape(p)))
            else:
                slot = -1
            self._slots[p] = slot
        return slot

    def slot_of(self, p: torch.Tensor) -> int:
        """The param's slot, without laying out state for it (-1: none yet, or none kept)."""
        return self._slots.get(p, -1) if self.engine is not None else -1

    def stepped_params(self) -> list[torch.Tensor]:
        """The params with state in the pages, in the order they got it."""
        return [p for p, slot in self._slots.items() if slot >= 0]

    def checkpoint_slots(self, p: torch.Tensor
                         ) -> list[tuple[str, int, int, list[StreamSpec], int]]:
        """(role, engine slot, elements, streams, row length) of each slot holding p's paged
        state (the row length its 8-bit groups follow: state_format.row_length)."""
        slot = self.slot_of(p)
        if slot < 0:
            return []
        return [("state", slot, state_numel(p), self.streams_of(p),
                 state_format.row_length(state_shape(p)))]

    def batch_layout(self, p: torch.Tensor) -> Any:
        """What the algorithm's native step needs of `p` beside its slot (SkewAdam: where its
        factors are); None for the algorithms that need nothing."""
        return None

    # -- DTensor params: state of the local shard (see pagedoptim/state/sharding.py) --------

    def shard_layout(self, p: torch.Tensor) -> Optional[sharded_params.ShardLayout]:
        """How p's state is sharded (None: p is not a DTensor)."""
        if not sharded_params.is_dtensor(p):
            return None
        layout = self._shard_layouts.get(p)
        if layout is None:
            layout = self._shard_layouts[p] = sharded_params.shard_layout(p)
        return layout

    def _check_shard_keeps_groups(self, p: torch.Tensor) -> None:
        layout = self.shard_layout(p)
        if layout is not None:  # raises where a shard would cut a scale group
            layout.scales(lambda: self.describe(p))

    def as_public(self, p: torch.Tensor, value: torch.Tensor, per_group: bool) -> torch.Tensor:
        """A stream of p's state as optimizer.state and state_dict() show it: a DTensor placed
        as the global stream would be for a DTensor param, else the local tensor itself."""
        layout = self.shard_layout(p)
        if layout is None:
            return value
        return sharded_params.as_dtensor(layout, value, per_group, lambda: self.describe(p))

    def as_local(self, p: torch.Tensor, name: str, value: Any, where: str) -> Any:
        """A given stream of p (loaded, or assigned to optimizer.state) as p's local shard."""
        layout = self.shard_layout(p)
        if layout is None or not isinstance(value, torch.Tensor):
            return value
        return sharded_params.local_part(layout, value, state_format.is_group_stream(name),
                                         lambda: where)

    # -- state in pages, as optimizer.state shows it (pagedoptim/state/param_state.py) -----

    def stream_names(self) -> set[str]:
        """Every key a page stream can have in state[p] or a state dict, in any format."""
        return state_format.all_stream_names(self.all_moments())

    def is_stream_name(self, key: Any) -> bool:
        return isinstance(key, str) and key in self.stream_names()

    def stream_keys(self, p: torch.Tensor) -> list[str]:
        """The streams `p` has in the pages now, in the stored format ([] before its first
        step, and for a param that keeps no state)."""
        if self.slot_of(p) < 0:
            return []
        return [spec.name for spec in self.streams_of(p)]

    def decoded_names(self, p: torch.Tensor) -> set[str]:
        """fp32 moment names readable beside their stored 8-bit codes."""
        stored = set(self.stream_keys(p))
        return {m.name for m in self.all_moments() if f"{m.name}_codes" in stored}

    def has_tensor(self, p: torch.Tensor, key: Any) -> bool:
        return key in self.stream_keys(p) or key in self.decoded_names(p)

    def read(self, p: torch.Tensor, key: str) -> torch.Tensor:
        """A new tensor holding stream `key` of `p` (or the fp32 decoding of its codes),
        shaped like the param; fp32 moments of a complex param are complex, as torch's."""
        slot = self._slots[p]
        stored = {spec.name: spec for spec in self.streams_of(p)}
        shape = state_shape(p)
        if key in stored:
            value = stored[key].tensor_from_bytes(self.engine.read_stream(slot, key), shape)
        else:
            given = {name: stored[name].tensor_from_bytes(self.engine.read_stream(slot, name),
                                                          shape)
                     for name in (f"{key}_codes", f"{key}_scales")}
            fp32 = StreamSpec(key, 4 * state_format.GROUP_SIZE, False, torch.float32)
            value = state_format.convert_for_stream(fp32, self.all_moments(), given,
                                                    shape).reshape(shape)
        if p.is_complex() and value.dtype == torch.float32 and value.shape == shape:
            value = torch.view_as_complex(value)
        return self.as_public(p, value, state_format.is_group_stream(key))

    def write(self, p: torch.Tensor, values: dict[str, torch.Tensor], where: str) -> None:
        """Streams written through optimizer.state[p] (one key, or a whole entry), converted
        together: one moment's codes and scales become fp32 state and fp32 becomes codes."""
        self.write_streams(p, values, complete=False, where=where)

    def write_streams(self, p: torch.Tensor, given: dict[str, torch.Tensor], complete: bool,
                      where: str) -> None:
        """Writes what `given` holds of `p`'s streams (in any format: fp32 moments and
        codes convert both ways) into the pages. Everything is converted and checked before
        anything is written. complete: every stream must be given (a loaded state)."""
        name = type(self.optimizer).__name__
        slot = self.slot(p)
        if slot < 0:
            if not given:
                return
            raise ValueError(f"{where}: {name} keeps no state for this param with these "
                             "hyperparameters")
        for moment in self.all_moments():
            if moment.name in given and ({f"{moment.name}_codes", f"{moment.name}_scales"}
                                         & given.keys()):
                # Which one holds the state is not for us to guess (DCP's full_state_dict
                # load keeps this optimizer's own stale entries beside a checkpoint's).
                raise ValueError(f"{where} holds '{moment.name}' both as fp32 and as 8-bit "
                                 "codes or scales; give one format only (a checkpoint of the "
                                 "other format loads through pagedoptim.dcp."
                                 "StateFormatLoadPlanner)")
        given = {key: as_real(self.as_local(p, key, value, where), where)
                 for key, value in self._in_row_groups(p, given).items()}
        shape = state_shape(p)
        kept = [s.name for s in self.streams_of(p)]
        converted = []
        for spec in self.streams_of(p):
            try:
                value = state_format.convert_for_stream(spec, self.all_moments(), given, shape)
            except ValueError as error:  # the codec's checks, which cannot name the param
                raise ValueError(f"{where}: {error}") from None
            if value is None:
                if complete and spec.name != state_format.RESIDUAL:
                    # no residual saved: the master is the 16-bit weight
                    raise ValueError(f"{where} has no '{spec.name}' and nothing to convert it "
                                     f"from; {name} with these hyperparameters keeps {kept}")
                continue
            if spec.name == state_format.RESIDUAL and value.dtype != spec.dtype:
                value = rescaled_residual(value, spec.dtype, where)
            expected = state_format.expected_numel(spec, shape)
            if value.numel() != expected:
                raise ValueError(f"{where}: '{spec.name}' has {value.numel()} elements, "
                                 f"expected {expected}")
            raw = value.detach().to(device="cpu", dtype=spec.dtype).contiguous()
            converted.append((spec.name, raw.view(-1).view(torch.uint8)))
        if not converted and given:
            raise ValueError(f"{where}: {sorted(given)} cannot be stored: {name} with these "
                             f"settings keeps {kept} for this param")
        for stream, raw in converted:
            self.engine.write_stream(slot, stream, raw)

    def _in_row_groups(self, p: torch.Tensor, given: dict[str, Any]) -> dict[str, Any]:
        """`given` with the 8-bit moments of a DTensor param that a checkpoint holds in
        another group layout (the flat groups of pagedoptim before 0.2, as a shard of the
        flat scales), or that p now keeps in fp32 (a 1-D param saved 8-bit), made whole
        first: a rank's part cannot be cut out of groups that its shard cuts, so the whole
        stream is gathered and decoded to fp32 (or, where the groups are the same, only
        reshaped), and each rank takes, and encodes, its own part. Every rank loads every
        param, so the gathers match up. A plain param's are converted by
        state_format.convert_for_stream."""
        layout = self.shard_layout(p)
        if layout is None:
            return given
        shape = torch.Size(layout.elements.global_shape)
        scale_shape = tuple(state_format.group_shape(shape))
        kept = {spec.name for spec in self.streams_of(p)}
        for moment in self.all_moments():
            codes_name, scales_name = f"{moment.name}_codes", f"{moment.name}_scales"
            codes, scales = given.get(codes_name), given.get(scales_name)
            if not isinstance(codes, torch.Tensor) or not isinstance(scales, torch.Tensor):
                continue
            eight_bit = codes_name in kept
            if eight_bit and tuple(scales.shape) == scale_shape:
                continue  # today's layout: sharded like the param
            codes, scales = (value.full_tensor() if sharded_params.is_dtensor(value) else value
                             for value in (codes, scales))
            if codes.numel() != shape.numel():
                continue  # write_streams names the mismatch
            given = {key: value for key, value in given.items()
                     if key not in (codes_name, scales_name)}
            if (eight_bit and not state_format.is_flat_layout(scales, shape)
                    and scales.numel() == math.prod(scale_shape)):
                given[codes_name] = codes.reshape(shape)  # the same groups, flat scales
                given[scales_name] = scales.reshape(scale_shape)
            else:
                given[moment.name] = state_format.decode(moment, codes, scales, shape)
        return given

    @staticmethod
    def check_write_back(keys: list[str]) -> None:
        """Changed copies of one moment in two formats cannot both be written back."""
        for key in keys:
            if f"{key}_codes" in keys or f"{key}_scales" in keys:
                raise ValueError(f"optimizer.state[param][{key!r}] and its 8-bit codes or "
                                 "scales were both changed in place; change one format only")

    def reset(self, p: torch.Tensor) -> None:
        """Back to the state of a param never stepped: zero pages (what new pages hold)."""
        slot = self.slot_of(p)
        if slot < 0:
            return
        for spec in self.streams_of(p):
            self._zero_stream(slot, spec.name)

    def _zero_stream(self, slot: int, name: str) -> None:
        size = self.engine.stream_bytes(slot, name)
        self.engine.write_stream(slot, name, torch.zeros(size, dtype=torch.uint8))

    def step_counter_replaced(self) -> None:
        """A param's step counter was replaced or reset: a compiled step holding the old
        one must trace again."""
        compiled_step.forget_plan(self.optimizer)

    def gather(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every param's page streams as new tensors, by param index."""
        gathered: dict[int, dict[str, torch.Tensor]] = {}
        for index, p in enumerate(self.params()):
            keys = self.stream_keys(p)
            if keys:
                gathered[index] = {key: self.read(p, key) for key in keys}
        return gathered

    def write_all(self, streams: dict[int, dict[str, torch.Tensor]]) -> None:
        """Fills this (fresh) store with exactly `streams` (param index -> tensors, in this
        store's format or another: fp32 moments and codes convert both ways)."""
        params = self.params()
        for index in sorted(streams):
            self.write_streams(params[index], streams[index], complete=True,
                               where=f"state for param {index}")

    # -- reports ---------------------------------------------------------------------------

    def memory_report(self, state_map: Any) -> dict[str, Any]:
        """optimizer.memory_report() (see its docstring), with `state_map` the optimizer's
        state (its step counters count in 'step_bytes')."""
        # A DTensor param counts its local shard: what this rank holds.
        params = [sharded_params.local_tensor(p) for p in self.params()]
        num_elements = sum(p.numel() for p in params)
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        grads = [sharded_params.local_tensor(p.grad) for p in self.params()
                 if p.grad is not None]
        grad_bytes = sum(g.numel() * g.element_size() for g in grads)
        page_bytes = num_pages = 0
        placement: dict[str, int] = {}
        if self.engine is not None:
            usage = self.engine.memory_usage()
            page_bytes, num_pages = usage["state_bytes"], usage["num_pages"]
            placement = dict(usage["placement"])
        stream_bytes = {"moment_bytes": 0, "scale_bytes": 0, "residual_bytes": 0}
        for p in self.stepped_params():
            for spec in self.streams_of(p):
                stream_bytes[state_format.report_field(spec)] += \
                    self.engine.stream_bytes(self._slots[p], spec.name)
        moment_bytes, scale_bytes, residual_bytes = stream_bytes.values()
        # With state_bits=8, the elements of the params that keep fp32 moments (1-D, small,
        # complex: state_format.keeps_8bit_state), stepped or not.
        fp32_state_elements = 0 if self.options.state_bits != 8 else sum(
            state_numel(p) for p in dict.fromkeys(self.params())
            if not self.keeps_8bit_state(p))
        step_bytes = STEP_COUNTER_BYTES * sum(1 for value in state_map.values()
                                              if _counts_steps(value))
        state_bytes = page_bytes + step_bytes
        per_param = max(num_elements, 1)
        return {
            "param_bytes": param_bytes,
            "grad_bytes": grad_bytes,
            "state_bytes": state_bytes,
            "moment_bytes": moment_bytes,
            "scale_bytes": scale_bytes,
            "residual_bytes": residual_bytes,
            "step_bytes": step_bytes,
            "page_slack_bytes": page_bytes - moment_bytes - scale_bytes - residual_bytes,
            "num_pages": num_pages,
            "state_placement": placement,
            "page_bytes": self.page_bytes if self.page_bytes is not None
            else self.options.page_bytes,
            "num_elements": num_elements,
            "fp32_state_elements": fp32_state_elements,
            "state_bytes_per_param": state_bytes / per_param,
            "total_bytes_per_param": (param_bytes + grad_bytes + state_bytes) / per_param,
        }

    def param_stream_bytes(self, p: torch.Tensor) -> int:
        """Payload bytes of p's streams in the pages (0 before its first step)."""
        slot = self.slot_of(p)
        if slot < 0:
            return 0
        return sum(self.engine.stream_bytes(slot, spec.name) for spec in self.streams_of(p))

    def paging_stats(self) -> dict[str, Any]:
        if self.engine is None:
            return paging.stats_before_first_step(self.options)
        return self.engine.paging_stats()


@contextlib.contextmanager
def replacing_state(optimizer: Any) -> Iterator[None]:
    """A load's transaction: whatever the body rebinds on `optimizer` (its groups, its store,
    its `state` map) is put back as it was if the body raises, so a failed load changes
    nothing: the body builds the new state beside the old (a fresh store, a new StateMap)
    and never writes to the old store's pages. On success, copies handed out from the old
    `optimizer.state` become stale."""
    before = dict(optimizer.__dict__)
    try:
        yield
    except BaseException:
        optimizer.__dict__.clear()
        optimizer.__dict__.update(before)
        raise
    optimizer.state.take_over(before["state"])


def _counts_steps(value: Any) -> bool:
    """Whether a state entry holds a param's step counter (in sight or hidden)."""
    return isinstance(value, ParamState) and (value.hidden_step() is not None
                                              or "step" in value.plain_items())


def state_numel(p: torch.Tensor) -> int:
    """Elements of state per param: a complex param has two per element (its real view);
    a DTensor param keeps state for its local shard."""
    return sharded_params.local_tensor(p).numel() * (2 if p.is_complex() else 1)


def state_numel_global(p: torch.Tensor) -> int:
    """Elements of the whole state of p (of every shard, for a DTensor param)."""
    return p.numel() * (2 if p.is_complex() else 1)


def state_shape(p: torch.Tensor) -> torch.Size:
    shape = sharded_params.local_tensor(p).shape
    return torch.Size([*shape, 2]) if p.is_complex() else shape


def rescaled_residual(value: torch.Tensor, dtype: torch.dtype, where: str) -> torch.Tensor:
    """A master residual saved with the other master_bits, in `dtype`'s code range: the
    residual is r / K half-ulps of the 16-bit weight, so r scales by K_new / K_old (int8 to
    int16 exactly; int16 to int8 rounded, within the int8 residual's own error)."""
    limits = state_dict_checks.RESIDUAL_LIMITS
    if value.dtype not in limits:
        raise TypeError(f"{where}: '{state_format.RESIDUAL}' must be int8 (master_bits=24) or "
                        f"int16 (master_bits=32), got {value.dtype}")
    scaled = value.to(torch.float64) * (limits[dtype] / limits[value.dtype])
    return torch.round(scaled).clamp_(-limits[dtype], limits[dtype]).to(dtype)


def as_real(value: Any, where: str) -> torch.Tensor:
    """A state tensor as the kernels hold it: dense, and real (a complex moment as its real
    view, as torch.optim steps complex params)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} must be a Tensor, got {type(value).__name__}")
    # What optimizer.state[p][key] = value writes is checked as a loaded stream is: a sparse
    # tensor with indices outside its size must not be densified.
    state_dict_checks.check_tensor(value, where)
    if value.is_sparse:
        value = value.to_dense()  # torch.optim.SGD's momentum for sparse gradients
    return torch.view_as_real(value) if value.is_complex() else value
