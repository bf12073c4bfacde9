"""PagedOptimizer: the torch.optim.Optimizer base class of every PagedOptim optimizer.

It owns what the optimizers share: parameter validation, the paging options, the native
engine (created at the first step, so no state exists before it), the single native call
per step, and the translation between paged state and torch's state_dict format.

Where state lives: `self.state[p]` holds only the step counter ('step', a 0-dim float32
tensor, as in torch). The moments live in the engine's pages; `state_dict()` gathers them
into torch's per-parameter tensors and `load_state_dict()` scatters them back.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Optional

import torch

from pagedoptim._native import native
from pagedoptim.options import PagingOptions

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP32_BYTES_PER_GROUP = 32 * 4  # one fp32 value per element, 32 elements per group


class PagedOptimizer(torch.optim.Optimizer):
    """Base class; subclasses set `_kind` and implement the three hooks below."""

    _kind: str = ""
    # Every state_dict key this optimizer may keep in pages, whatever its hyperparameters.
    _possible_streams: tuple[str, ...] = ()

    def __init__(self, params: Any, defaults: dict[str, Any], options: PagingOptions) -> None:
        self._options = options
        self._engine: Any = None
        self._slots: dict[torch.Tensor, int] = {}
        self._device: Optional[torch.device] = None
        if isinstance(params, (set, frozenset)):
            raise TypeError("params must be an ordered collection (a list, a generator, "
                            "named_parameters()), not a set: a set's order changes between "
                            "runs, and the state_dict maps state to params by position")
        super().__init__(params, defaults)

    # -- what each optimizer provides ------------------------------------------------------

    def _stream_names(self) -> list[str]:
        """State streams (torch's state_dict key names) for the current groups."""
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
        elif isinstance(params, set):
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

    # -- the step --------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        steps: list[torch.Tensor] = []
        slots: list[int] = []
        group_ids: list[int] = []
        hyperparameters: list[tuple] = []
        write_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        for group_id, group in enumerate(self.param_groups):
            hyperparameters.append(self._group_hyperparameters(group))
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse "
                                       f"gradients (param of shape {tuple(p.shape)} has one)")
                if p.device.type != "cpu":
                    raise NotImplementedError(
                        f"params on {p.device} cannot be stepped by this build of pagedoptim: "
                        "its step kernels run on the CPU only")
                work = p if p.is_contiguous() else p.contiguous()
                if work is not p:
                    write_back.append((p, work))
                params.append(work)
                grads.append(grad if grad.is_contiguous() else grad.contiguous())
                steps.append(self._step_counter(p))
                slots.append(self._slot(p))
                group_ids.append(group_id)
        if params:
            self._native_step(params, grads, steps, slots, group_ids, hyperparameters)
            for p, work in write_back:
                p.copy_(work)
        return loss

    def _step_counter(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        return state["step"]

    def _ensure_engine(self) -> Any:
        if self._engine is None:
            streams = [(name, _FP32_BYTES_PER_GROUP, False) for name in self._stream_names()]
            self._engine = native.PagedState(self._kind, streams, self._options.page_bytes)
        return self._engine

    def _slot(self, p: torch.Tensor) -> int:
        """The parameter's slot in the engine; lays out its state on first use."""
        slot = self._slots.get(p)
        if slot is None:
            engine = self._ensure_engine()
            slot = engine.register_param(p.numel()) if engine.stream_names else -1
            self._slots[p] = slot
        return slot

    # -- state_dict in torch's format ------------------------------------------------------

    def _indexed_params(self, groups: Optional[list[dict[str, Any]]] = None
                        ) -> list[torch.Tensor]:
        groups = self.param_groups if groups is None else groups
        return list(itertools.chain.from_iterable(g["params"] for g in groups))

    def _gather_streams(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every parameter's state streams as fp32 tensors shaped like it, by param index."""
        gathered: dict[int, dict[str, torch.Tensor]] = {}
        if self._engine is None:
            return gathered
        names = self._engine.stream_names
        for index, p in enumerate(self._indexed_params()):
            slot = self._slots.get(p)
            if slot is None or slot < 0:
                continue
            gathered[index] = {
                name: self._engine.read_stream(slot, s).view(torch.float32).view(p.shape)
                for s, name in enumerate(names)
            }
        return gathered

    def _scatter_streams(self, streams: dict[int, dict[str, torch.Tensor]]) -> None:
        """Replaces the engine by one holding exactly `streams` (param index -> tensors)."""
        self._engine = None
        self._slots = {}
        if not streams:
            return
        engine = self._ensure_engine()
        params = self._indexed_params()
        for index in sorted(streams):
            p = params[index]
            tensors = streams[index]
            missing = [name for name in engine.stream_names if name not in tensors]
            if missing:
                raise ValueError(f"state for param {index} lacks {missing}; an optimizer "
                                 f"state_dict for {type(self).__name__} with these "
                                 f"hyperparameters needs {engine.stream_names}")
            slot = self._slot(p)
            for s, name in enumerate(engine.stream_names):
                value = tensors[name]
                if value.numel() != p.numel():
                    raise ValueError(f"state '{name}' of param {index} has {value.numel()} "
                                     f"elements, the param has {p.numel()}")
                raw = value.detach().to(device="cpu", dtype=torch.float32).contiguous()
                engine.write_stream(slot, s, raw.view(-1).view(torch.uint8))

    def state_dict(self) -> dict[str, Any]:
        state_dict = super().state_dict()
        for index, streams in self._gather_streams().items():
            state_dict["state"][index] = {**state_dict["state"].get(index, {}), **streams}
        # The packed per-param dicts are this optimizer's own; hand out copies.
        state_dict["state"] = {index: dict(value)
                               for index, value in state_dict["state"].items()}
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        names = set(self._possible_streams)
        streams: dict[int, dict[str, torch.Tensor]] = {}
        stripped_state: dict[Any, dict[str, Any]] = {}
        for index, value in state_dict["state"].items():
            own = {k: v for k, v in value.items() if k in names and v is not None}
            if own:
                streams[index] = own
            stripped_state[index] = {k: v for k, v in value.items() if k not in names}
        super().load_state_dict({**state_dict, "state": stripped_state})
        # torch keeps 'step' as given; the engine needs a one-element float32 cpu tensor.
        for p, value in self.state.items():
            step = value.get("step")
            if step is None:
                value["step"] = torch.tensor(self._default_step(p, streams), dtype=torch.float32)
            elif not (isinstance(step, torch.Tensor) and step.dtype == torch.float32
                      and step.device.type == "cpu" and step.dim() == 0):
                value["step"] = torch.tensor(float(step), dtype=torch.float32)
        index_of = {p: i for i, p in enumerate(self._indexed_params())}
        for p in list(self.state):
            self.state[p] = {k: v for k, v in self.state[p].items() if k not in names}
            if index_of.get(p) is None:
                del self.state[p]
        self._scatter_streams(streams)

    def _default_step(self, p: torch.Tensor, streams: dict[int, dict[str, torch.Tensor]]
                      ) -> float:
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
        params = self._indexed_params()
        self._device = params[0].device if params else None
        self._scatter_streams(saved_streams)

    # -- reports ---------------------------------------------------------------------------

    def memory_report(self) -> dict[str, Any]:
        """Bytes of parameters, gradients and optimizer state, and state bytes per param."""
        params = self._indexed_params()
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        grad_bytes = sum(p.grad.numel() * p.grad.element_size()
                         for p in params if p.grad is not None)
        usage = self._engine.memory_usage() if self._engine is not None else {
            "state_bytes": 0, "resident_bytes": 0, "payload_bytes": 0,
            "num_pages": 0, "num_params": 0}
        step_bytes = 4 * sum(1 for v in self.state.values() if "step" in v)
        num_elements = sum(p.numel() for p in params)
        return {
            "param_bytes": param_bytes,
            "grad_bytes": grad_bytes,
            "state_bytes": usage["state_bytes"] + step_bytes,
            "state_payload_bytes": usage["payload_bytes"],
            "state_resident_bytes": usage["resident_bytes"],
            "num_pages": usage["num_pages"],
            "page_bytes": self._options.page_bytes,
            "num_elements": num_elements,
            "state_bytes_per_param": (usage["state_bytes"] + step_bytes) / max(num_elements, 1),
        }
