"""PagedOptimizer: the torch.optim.Optimizer base class of every PagedOptim optimizer.

It owns what the optimizers share: parameter validation, the paging options, the native
engine (created at the first step, so no state exists before it), the single native call
per step (or, with release_grads, one per parameter inside backward), and the translation
between paged state and torch's state_dict format.

Where state lives: `self.state[p]` holds only the step counter ('step', a 0-dim float32
tensor, as in torch). The moments (and master residuals) live in the engine's pages;
`state_dict()` gathers them into per-parameter tensors and `load_state_dict()` scatters
them back, converting between fp32 and companded 8-bit formats where they differ.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional

import torch

from pagedoptim import compiled_step, paging, state_format
from pagedoptim._native import native
from pagedoptim.options import PagingOptions
from pagedoptim.state_format import Moment, StreamSpec

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOW_PRECISION = (torch.bfloat16, torch.float16)

# Page kinds: every parameter's state has the optimizer's moment streams; bf16/fp16
# parameters with master_bits on have the master residual too.
_KIND_PLAIN = 0
_KIND_WITH_RESIDUAL = 1


class PagedOptimizer(torch.optim.Optimizer):
    """Base class; subclasses set `_kind` and implement the hooks marked below."""

    _kind: str = ""

    def __init__(self, params: Any, defaults: dict[str, Any], options: PagingOptions) -> None:
        self._options = options
        self._engine: Any = None
        self._slots: dict[torch.Tensor, int] = {}
        self._device: Optional[torch.device] = None
        self._release_hooks: list[Any] = []
        self._released_this_round: set[int] = set()
        if isinstance(params, (set, frozenset)):
            raise TypeError("params must be an ordered collection (a list, a generator, "
                            "named_parameters()), not a set: a set's order changes between "
                            "runs, and the state_dict maps state to params by position")
        super().__init__(params, defaults)
        # What can be known wrong before the first step is reported here, not there.
        paging.check_before_first_step(options, self._device)

    # -- what each optimizer provides ------------------------------------------------------

    def _moments(self) -> list[Moment]:
        """The moments the current groups need (fixed once the engine exists)."""
        raise NotImplementedError

    def _all_moments(self) -> list[Moment]:
        """Every moment this optimizer may keep, whatever its hyperparameters."""
        raise NotImplementedError

    def _group_hyperparameters(self, group: dict[str, Any]) -> tuple:
        """The group's hyperparameters, validated, in the native tuple order."""
        raise NotImplementedError

    def _native_step(self, *args: Any) -> None:
        raise NotImplementedError

    # -- parameter groups ------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, (set, frozenset)):
            raise TypeError("optimizer parameters need to be organized in ordered collections, "
                            "but the ordering of tensors in sets will change between runs. "
                            "Please use a list instead.")
        params = list(params)
        # named_parameters() gives (name, tensor) pairs; torch unpacks them in its own
        # add_param_group, so look through them here.
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        seen: set[int] = set()
        for index, p in enumerate(tensors):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params[{index}] must be a Tensor, got {type(p).__name__}")
            if p.is_complex():
                raise ValueError(f"params[{index}] is complex ({p.dtype}); pagedoptim does not "
                                 "support complex params: optimize torch.view_as_real(p) instead")
            if p.dtype not in _SUPPORTED_DTYPES:
                raise ValueError(f"params[{index}] has dtype {p.dtype}; pagedoptim supports "
                                 "float32, bfloat16 and float16 params")
            if id(p) in seen:
                raise ValueError(f"params[{index}] appears more than once in one parameter "
                                 "group; each parameter may be given once")
            seen.add(id(p))
            if self._device is None:
                self._device = p.device
            elif p.device != self._device:
                raise ValueError(f"params must all be on one device: params[{index}] is on "
                                 f"{p.device}, earlier params are on {self._device}")
        super().add_param_group({**param_group, "params": params})
        if self._options.release_grads:
            for p in tensors:
                if p.requires_grad:
                    self._release_hooks.append(
                        p.register_post_accumulate_grad_hook(self._step_released))

    # -- the step --------------------------------------------------------------------------

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # CUDA state: GradScaler hands over its scale and found_inf as device tensors
        # (optimizer.grad_scale / optimizer.found_inf) and the kernels unscale and skip on
        # the device, as torch's fused optimizers do: no host sync. With release_grads
        # GradScaler must not try to unscale gradients that are already gone; claiming
        # support makes it hand them over too, and step() says so.
        return self._options.release_grads or self._on_cuda()

    def _on_cuda(self) -> bool:
        device = self._engine_device()
        return device is not None and device.type == "cuda"

    def _engine_device(self) -> Optional[torch.device]:
        """Where the state lives: fixed once the engine exists; before that, where the params
        are now (`opt = po.AdamW(model.parameters()); model.cuda()` is a torch idiom, so the
        device of the params at construction does not bind)."""
        if self._engine is not None:
            return self._device
        params = self._indexed_params()
        return params[0].device if params else None

    def _amp_arguments(self, given: Optional[dict[str, Any]] = None) -> dict[str, torch.Tensor]:
        """GradScaler's found_inf / grad_scale for this step (set on the optimizer by
        GradScaler.step, or `given`: what a compiled step passed its custom op), moved to
        the params' device without waiting."""
        amp: dict[str, torch.Tensor] = {}
        for name in ("found_inf", "grad_scale"):
            value = getattr(self, name, None) if given is None else given.get(name)
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(float(value))
            amp[name] = value.to(device=self._engine_device(), dtype=torch.float32,
                                 non_blocking=True).reshape(1)
        return amp

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        if self._options.release_grads:
            return self._finish_released_round(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():
            # The engine is opaque to the compiler: the step becomes one custom op.
            compiled_step.step_under_compile(self)
            return loss
        batch = _StepBatch()
        batch.amp = self._amp_arguments() if self._step_supports_amp_scaling else {}
        for group_id, group in enumerate(self.param_groups):
            batch.hyperparameters.append(self._group_hyperparameters(group))
            for p in group["params"]:
                if p.grad is not None:
                    self._add_to_batch(batch, p, p.grad, group_id)
        self._run(batch)
        return loss

    def _add_to_batch(self, batch: "_StepBatch", p: torch.Tensor, grad: torch.Tensor,
                      group_id: int, *, target: Optional[torch.Tensor] = None,
                      step: Optional[torch.Tensor] = None) -> None:
        """Adds param `p` to the batch. The step updates `target` and advances `step`,
        which are p and state[p]['step'] unless given: a compiled step hands over the
        tensors of its custom op, which may be functional copies of them."""
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients "
                               f"(param of shape {tuple(p.shape)} has one)")
        if p.device.type == "cuda":
            self._check_cuda_param(p)
        elif p.device.type != "cpu":
            raise NotImplementedError(
                f"{self._describe(p)} is on {p.device}; pagedoptim steps params on the CPU "
                "and on CUDA devices")
        if grad.device != p.device:
            raise ValueError(f"the grad of {self._describe(p)} is on {grad.device}, its param "
                             f"on {p.device}: they must be on one device")
        target = p if target is None else target
        work = target if target.is_contiguous() else target.contiguous()
        if work is not target:
            batch.write_back.append((target, work))
        batch.params.append(work)
        batch.grads.append(grad if grad.is_contiguous() else grad.contiguous())
        batch.steps.append(self._step_counter(p) if step is None else step)
        batch.slots.append(self._slot(p))
        batch.group_ids.append(group_id)

    def _check_cuda_param(self, p: torch.Tensor) -> None:
        if not native.cuda_built():
            raise RuntimeError(
                f"{self._describe(p)} is on {p.device}, but this build of pagedoptim has no "
                "CUDA kernels: rebuild it against a CUDA build of torch with a matching nvcc "
                "(`PAGEDOPTIM_WITH_CUDA=1 pip install --no-build-isolation -e .`)")

    def _describe(self, p: torch.Tensor) -> str:
        """'param N (shape (...), dtype)' with N its index in the optimizer's params."""
        for index, q in enumerate(self._indexed_params()):
            if q is p:
                return f"param {index} (shape {tuple(p.shape)}, {p.dtype})"
        return f"a param of shape {tuple(p.shape)} ({p.dtype})"

    def _run(self, batch: "_StepBatch") -> None:
        if not batch.params:
            return
        self._native_step(batch.params, batch.grads, batch.steps, batch.slots,
                          batch.group_ids, batch.hyperparameters, **batch.amp)
        for p, work in batch.write_back:
            p.copy_(work)

    def _step_counter(self, p: torch.Tensor) -> torch.Tensor:
        """state[p]['step']: a 0-dim float32 tensor on the CPU for CPU params, and on the
        param's device for CUDA params (where the kernels advance it, as torch's fused
        optimizers keep it)."""
        state = self.state[p]
        if "step" not in state:
            # zeros, not tensor(0.0): a CUDA tensor built from a Python number is a blocking
            # copy from the host, and the step must not wait for the device.
            state["step"] = torch.zeros((), dtype=torch.float32, device=self._step_device(p))
        return state["step"]

    @staticmethod
    def _step_device(p: torch.Tensor) -> torch.device:
        return p.device if p.device.type == "cuda" else torch.device("cpu")

    # -- gradient release ------------------------------------------------------------------

    @torch.no_grad()
    def _step_released(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: steps `p` as soon as its gradient is complete, then
        frees the gradient, so at most one parameter's gradient is alive at a time."""
        if p.grad is None:
            return
        if id(p) in self._released_this_round:
            raise RuntimeError(
                "release_grads=True steps each parameter inside backward and frees its "
                "gradient, so gradients cannot accumulate over several backward calls: call "
                "optimizer.step() after every backward (it ends the round), or use "
                "release_grads=False for gradient accumulation")
        batch = _StepBatch()
        batch.hyperparameters = [self._group_hyperparameters(self._group_of(p))]
        self._add_to_batch(batch, p, p.grad, 0)
        self._run(batch)
        self._released_this_round.add(id(p))
        p.grad = None

    def _group_of(self, p: torch.Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise RuntimeError("a released gradient belongs to no parameter group of this optimizer")

    def _finish_released_round(self, closure: Any) -> None:
        if closure is not None:
            raise RuntimeError("step(closure) cannot be used with release_grads=True: the "
                               "parameters were already stepped inside backward")
        if getattr(self, "found_inf", None) is not None:
            raise RuntimeError("GradScaler cannot be used with release_grads=True: it "
                               "unscales and checks gradients before the step, but with "
                               "gradient release they are applied and freed inside backward")
        self._released_this_round.clear()
        return None

    # -- the engine ------------------------------------------------------------------------

    def _stream_kinds(self) -> list[list[StreamSpec]]:
        moments = [spec for moment in self._moments()
                   for spec in state_format.moment_streams(moment, self._options.state_bits)]
        kinds = [moments, list(moments)]
        if self._options.master_bits is not None:
            kinds[_KIND_WITH_RESIDUAL].append(
                state_format.residual_stream(self._options.master_bits))
        return kinds

    def _kind_of(self, p: torch.Tensor) -> int:
        if self._options.master_bits is not None and p.dtype in _LOW_PRECISION:
            return _KIND_WITH_RESIDUAL
        return _KIND_PLAIN

    def _ensure_engine(self) -> Any:
        if self._engine is None:
            self._device = self._engine_device()
            for index, p in enumerate(self._indexed_params()):
                if p.device != self._device:
                    raise ValueError(f"params must all be on one device: param {index} is on "
                                     f"{p.device}, param 0 on {self._device}")
            self._kinds = self._stream_kinds()
            native_kinds = [[spec.as_native() for spec in kind] for kind in self._kinds]
            store = paging.store_options(self._options, self._device)
            device = paging.engine_device(store, self._device)
            self._engine = native.PagedState(self._kind, native_kinds, self._options.page_bytes,
                                             store=store, device=device)
            if store is not None:
                paging.warn_about_fallbacks(self._engine)
        return self._engine

    def _slot(self, p: torch.Tensor) -> int:
        """The parameter's slot in the engine; lays out its state on first use (-1: the
        parameter keeps no state, as in plain SGD)."""
        slot = self._slots.get(p)
        if slot is None:
            engine = self._ensure_engine()
            kind = self._kind_of(p)
            if self._kinds[kind]:
                # Pages start zeroed: a zero residual makes the master weight exactly the
                # 16-bit parameter, which is right for a weight never split before.
                slot = engine.register_param(p.numel(), kind)
            else:
                slot = -1
            self._slots[p] = slot
        return slot

    def _streams_of(self, p: torch.Tensor) -> list[StreamSpec]:
        return self._kinds[self._kind_of(p)]

    # -- state_dict ------------------------------------------------------------------------

    def _indexed_params(self, groups: Optional[list[dict[str, Any]]] = None
                        ) -> list[torch.Tensor]:
        groups = self.param_groups if groups is None else groups
        return list(itertools.chain.from_iterable(g["params"] for g in groups))

    def _gather_streams(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every parameter's page streams as tensors, by param index."""
        gathered: dict[int, dict[str, torch.Tensor]] = {}
        if self._engine is None:
            return gathered
        for index, p in enumerate(self._indexed_params()):
            slot = self._slots.get(p)
            if slot is None or slot < 0:
                continue
            gathered[index] = {
                spec.name: spec.tensor_from_bytes(self._engine.read_stream(slot, spec.name),
                                                  p.shape)
                for spec in self._streams_of(p)
            }
        return gathered

    def _scatter_streams(self, streams: dict[int, dict[str, torch.Tensor]]) -> None:
        """Replaces the engine by one holding exactly `streams` (param index -> tensors, in
        this optimizer's format or another: fp32 moments and codes convert both ways)."""
        self._engine = None
        self._slots = {}
        if not streams:
            return
        self._ensure_engine()
        params = self._indexed_params()
        moments = self._all_moments()
        for index in sorted(streams):
            p = params[index]
            given = streams[index]
            slot = self._slot(p)
            if slot < 0:
                continue
            for spec in self._streams_of(p):
                value = state_format.convert_for_stream(spec, moments, given, p.numel())
                if value is None:
                    if spec.name == state_format.RESIDUAL:
                        continue  # no residual saved: the master is the 16-bit weight
                    raise ValueError(
                        f"state for param {index} has no '{spec.name}' and nothing to convert "
                        f"it from; {type(self).__name__} with these hyperparameters keeps "
                        f"{[s.name for s in self._streams_of(p)]}")
                expected = state_format.expected_numel(spec, p.numel())
                if value.numel() != expected:
                    raise ValueError(f"state '{spec.name}' of param {index} has "
                                     f"{value.numel()} elements, expected {expected}")
                raw = value.detach().to(device="cpu", dtype=spec.dtype).contiguous()
                self._engine.write_stream(slot, spec.name, raw.view(-1).view(torch.uint8))

    def state_dict(self) -> dict[str, Any]:
        state_dict = super().state_dict()
        for index, streams in self._gather_streams().items():
            state_dict["state"][index] = {**state_dict["state"].get(index, {}), **streams}
        # The packed per-param dicts are this optimizer's own; hand out copies.
        state_dict["state"] = {index: dict(value)
                               for index, value in state_dict["state"].items()}
        return state_dict

    def torch_state_dict(self) -> dict[str, Any]:
        """This optimizer's state in torch.optim's format, loadable by the torch optimizer of
        the same algorithm: companded moments dequantized to fp32, master residuals dropped
        (torch keeps no master weight; the 16-bit parameter is the weight)."""
        state_dict = self.state_dict()
        moments = self._all_moments()
        params = self._indexed_params()
        for index, value in state_dict["state"].items():
            converted = {k: v for k, v in value.items()
                         if k not in state_format.all_stream_names(moments)}
            for moment in self._moments():
                spec = StreamSpec(moment.name, 4 * state_format.GROUP_SIZE, False, torch.float32)
                tensor = state_format.convert_for_stream(spec, moments, value,
                                                         params[index].numel())
                if tensor is not None:
                    converted[moment.name] = tensor.reshape(params[index].shape)
            state_dict["state"][index] = converted
        return state_dict

    def _state_stream_names(self) -> set[str]:
        """The state_dict keys that hold page streams (scattered into the engine on load)."""
        return state_format.all_stream_names(self._all_moments())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        names = self._state_stream_names()
        streams: dict[int, dict[str, torch.Tensor]] = {}
        stripped_state: dict[Any, dict[str, Any]] = {}
        for index, value in state_dict["state"].items():
            own = {k: v for k, v in value.items() if k in names and v is not None}
            if own:
                streams[index] = own
            stripped_state[index] = {k: v for k, v in value.items() if k not in names}
        super().load_state_dict({**state_dict, "state": stripped_state})
        # torch keeps 'step' as given; the engine needs a one-element float32 cpu tensor.
        params = self._indexed_params()
        index_of = {p: i for i, p in enumerate(params)}
        for p in list(self.state):
            value = {k: v for k, v in self.state[p].items() if k not in names}
            step = value.get("step")
            if step is None:
                value["step"] = torch.tensor(self._default_step(index_of[p] in streams),
                                             dtype=torch.float32, device=self._step_device(p))
            elif not (isinstance(step, torch.Tensor) and step.dtype == torch.float32
                      and step.device == self._step_device(p) and step.dim() == 0):
                value["step"] = torch.tensor(float(step), dtype=torch.float32,
                                             device=self._step_device(p))
            self.state[p] = value
        self._scatter_streams(streams)

    def _default_step(self, has_streams: bool) -> float:
        """Step of a param whose loaded state has none (torch.optim.SGD keeps no step)."""
        return 0.0

    # -- copies ----------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_options": self._options,
                "_saved_streams": self._gather_streams()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_options" not in state:
            # torch's load_state_dict ends with __setstate__({'state', 'param_groups'});
            # load_state_dict itself then rebuilds the engine.
            super().__setstate__(state)
            return
        state = dict(state)
        options = state.pop("_options")
        saved_streams = state.pop("_saved_streams")
        super().__setstate__(state)
        self._options = options
        self._engine = None
        self._slots = {}
        self._release_hooks = []
        self._released_this_round = set()
        params = self._indexed_params()
        self._device = params[0].device if params else None
        if options.release_grads:
            for p in params:
                if p.requires_grad:
                    self._release_hooks.append(
                        p.register_post_accumulate_grad_hook(self._step_released))
        self._scatter_streams(saved_streams)

    # -- reports ---------------------------------------------------------------------------

    def memory_report(self) -> dict[str, Any]:
        """Exact bytes of parameters, gradients and optimizer state by kind, and per param.

        state bytes split into 'moment_bytes' (fp32 moments or 8-bit codes), 'scale_bytes'
        (fp16 group scales), 'residual_bytes' (master residuals), 'step_bytes', and
        'page_slack_bytes' (page space not used by any stream: alignment and the unfilled
        end of the last pages); 'state_bytes' is their sum, what the pages and step counters
        occupy. 'state_placement' says where the page bytes are: 'device' (GPU memory the
        state holds: all of it, or the page cache when paged), 'pinned_host' (page-locked
        host memory under a GPU cache), 'host' (host memory: all of it, or the cache of a
        paged CPU state), 'host_tier' and 'nvme' (the tier below a CPU cache, the page
        file).
        """
        params = self._indexed_params()
        num_elements = sum(p.numel() for p in params)
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        grad_bytes = sum(p.grad.numel() * p.grad.element_size()
                         for p in params if p.grad is not None)
        moment_bytes = scale_bytes = residual_bytes = 0
        page_bytes = num_pages = 0
        placement: dict[str, int] = {}
        if self._engine is not None:
            usage = self._engine.memory_usage()
            page_bytes, num_pages = usage["state_bytes"], usage["num_pages"]
            placement = dict(usage["placement"])
            for p, slot in self._slots.items():
                if slot < 0:
                    continue
                for spec in self._streams_of(p):
                    size = self._engine.stream_bytes(slot, spec.name)
                    if spec.name == state_format.RESIDUAL:
                        residual_bytes += size
                    elif spec.per_group:
                        scale_bytes += size
                    else:
                        moment_bytes += size
        step_bytes = 4 * sum(1 for v in self.state.values() if "step" in v)
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
            "page_bytes": self._options.page_bytes,
            "num_elements": num_elements,
            "state_bytes_per_param": state_bytes / per_param,
            "total_bytes_per_param": (param_bytes + grad_bytes + state_bytes) / per_param,
        }

    def paging_stats(self) -> dict[str, Any]:
        """The pager's counters since the state was created: hits, misses, hit_rate, bytes
        read and written per tier, stall_seconds (time the step waited for I/O), evictions,
        errors, the io backend and why it fell back, the O_DIRECT status. offload is None
        when the state is not paged; everything counts zero before the first step."""
        if self._engine is None:
            return {"offload": paging.resolve_offload(self._options, self._engine_device()),
                    "hits": 0, "misses": 0, "hit_rate": 0.0, "bytes_read": {},
                    "bytes_written": {}, "stall_seconds": 0.0}
        return self._engine.paging_stats()


class _StepBatch:
    """The arguments of one native step call, collected parameter by parameter."""

    __slots__ = ("params", "grads", "steps", "slots", "group_ids", "hyperparameters",
                 "write_back", "amp")

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.steps: list[torch.Tensor] = []
        self.slots: list[int] = []
        self.group_ids: list[int] = []
        self.hyperparameters: list[tuple] = []
        self.write_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.amp: dict[str, torch.Tensor] = {}
