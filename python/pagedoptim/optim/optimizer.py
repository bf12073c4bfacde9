"""PagedOptimizer: the torch.optim.Optimizer base class of every PagedOptim optimizer.

It owns what the optimizers share: parameter validation, the paging options, the native
engine (created at the first step, so no state exists before it), the single native call
per step (or, with release_grads, one per parameter inside backward), and the translation
between paged state and torch's state_dict format.

Where state lives: the moments (and master residuals) live in the engine's pages.
`self.state[p]` is a `ParamState` (pagedoptim/state/param_state.py): the step counter ('step', a
0-dim float32 tensor, as in torch) and the page streams, read and written through the
engine. `state_dict()` and `load_state_dict()` follow torch's, hooks included; tensors
convert between fp32 and companded 8-bit formats where the formats differ.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any, Callable, Optional

import torch

from pagedoptim import paging

from pagedoptim.checkpoint import stream as checkpoint_stream

from pagedoptim.engine import compiled_step, interrupted_step, release_guard, release_hooks

from pagedoptim.optim import torch_flags, trainer_route_check

from pagedoptim.paging import state_plan

from pagedoptim.state import (sharding as sharded_params, checks as state_dict_checks,
                               format as state_format)
from pagedoptim._native import native
from pagedoptim.checkpoint.algorithms import check_algorithm
from pagedoptim.engine.lifecycle import ClosedState, open_only
from pagedoptim.paging.options import PagingOptions
from pagedoptim.state.param_state import ParamState, StateMap, where_written
from pagedoptim.state.format import Moment, StreamSpec

# complex64 params are stepped as their float32 real view, as torch.optim does.
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.complex64)
LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)

# Page kinds: every parameter's state has the optimizer's moment streams; bf16/fp16
# parameters with master_bits on have the master residual too.
_KIND_PLAIN = 0
_KIND_WITH_RESIDUAL = 1

_CPU = torch.device("cpu")


# A model split over several GPUs (device_map="auto", a QLoRA split over two cards).
_ONE_OPTIMIZER_PER_DEVICE = (
    "An optimizer keeps its state in one engine on one device (its pages, cache and copy "
    "streams); for a model split over devices, build one optimizer per device, e.g. "
    "[po.AdamW([p for p in model.parameters() if p.device == d]) for d in devices] and step "
    "each, or shard the model with FSDP2 (docs/drop_in.md, 'Params on several devices')")


def _refuse_cuda_graph_capture() -> None:
    """A step cannot be captured in a CUDA graph: its work tables reach the GPU through
    pinned host buffers that are reused once copied, paging moves pages between steps, and
    CPU params' steps are not GPU work at all. A replay would read memory rewritten since,
    or silently skip the step, so a capture is refused before anything changes. A process
    that never initialized CUDA captures nothing, and asking would initialize it."""
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "pagedoptim's step cannot be captured in a CUDA graph (torch.cuda.graph, "
            "CUDAGraph.capture_begin): a replay would reuse host buffers and pages that have "
            "changed since the capture. Run optimizer.step() outside the captured region; "
            "torch.compile(mode='reduce-overhead') already leaves it out")

class PagedOptimizer(torch.optim.Optimizer):
    """Base class; subclasses set `_kind` and implement the hooks marked below."""

    _kind: str = ""
    # Whether state[p] shows 'step', as torch's optimizer of the algorithm does (torch.optim.SGD
    # keeps none; ours still counts steps, out of sight).
    _step_in_state: bool = True
    # What torch's error for a sparse gradient adds (AdamW: where to go instead).
    _sparse_gradient_hint: str = ""

    def __init__(self, params: Any, defaults: dict[str, Any], options: PagingOptions) -> None:
        self._options = options
        self._engine: Any = None
        self._slots: dict[torch.Tensor, int] = {}
        self._device: Optional[torch.device] = None
        self._page_bytes: Optional[int] = None  # chosen when the engine is created
        self._shard_layouts: dict[torch.Tensor, sharded_params.ShardLayout] = {}
        self._release_hooks: list[Any] = []
        self._released_this_round: set[int] = set()
        self._interrupted: Optional[interrupted_step.Interrupted] = None
        self._closed = False
        if isinstance(params, (set, frozenset)):
            raise TypeError("params must be an ordered collection (a list, a generator, "
                            "named_parameters()), not a set: a set's order changes between "
                            "runs, and the state_dict maps state to params by position")
        super().__init__(params, defaults)
        self.state: StateMap = StateMap(self)
        # What can be known wrong before the first step is reported here, not there.
        paging.check_before_first_step(options, self._device)
        self._check_page_file_fits(self._device)
        if options.release_grads:
            release_guard.watch(self)
        trainer_route_check.warn_if_trainer_learning_rate_unused(self)

    def _check_page_file_fits(self, device: Optional[torch.device]) -> None:
        # Meta params (`python -m pagedoptim plan` sizes a 70B model's state with them) never
        # get a page file.
        if device is None or device.type == "meta" \
                or paging.resolve_offload(self._options) != "nvme":
            return
        plan = state_plan.plan_state(self, device)
        paging.check_page_file_fits(self._options, plan.num_pages * plan.page_bytes)

    # -- lifecycle (pagedoptim/engine/lifecycle.py) -----------------------------------------------

    def close(self) -> None:
        """Releases the state now: the page file (its descriptor, and so its disk space),
        the io_uring ring and pinned buffers. Every later use of the optimizer raises;
        closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        for handle in self._release_hooks:  # backward must no longer step a closed optimizer
            handle.remove()
        self._release_hooks.clear()
        compiled_step.forget_plan(self)
        self._slots.clear()
        self._interrupted = None
        self.state = ClosedState(self)  # type: ignore[assignment]
        # The last reference: the native destructors drain in-flight I/O, then close the
        # ring and the page file's descriptor.
        self._engine = None

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "PagedOptimizer":
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} was closed: it cannot be entered "
                               "as a context manager again")
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

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

    @property
    def settings(self) -> dict[str, Any]:
        """The state-format and paging settings this optimizer runs with (from its keyword
        arguments, Trainer's optim_args or the PAGEDOPTIM_* environment, whichever gave
        them): state_bits, master_bits, offload, nvme_dir, cache_bytes, page_bytes,
        prefetch, policy, release_grads. A copy: changing it changes nothing."""
        return dataclasses.asdict(self._options)

    def __repr__(self) -> str:
        # torch's repr (the class and its param groups), with the settings after the name:
        # under PAGEDOPTIM=1 the class name alone cannot say that the saving is on.
        shown = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        name = type(self).__name__
        return super().__repr__().replace(f"{name} (", f"{name} (pagedoptim: {shown}", 1)

    @property
    def release_grads(self) -> bool:
        """Whether params are stepped inside backward (release_grads=True): integrations
        check it against what would read gradients after backward (clipping, DDP)."""
        return self._options.release_grads

    # -- parameter groups ------------------------------------------------------------------

    @open_only
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
        for index, p in enumerate(tensors):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params[{index}] must be a Tensor, got {type(p).__name__}")
            sharded_params.check_param_type(p, f"params[{index}]")
            if self._options.release_grads and sharded_params.is_dtensor(p):
                # FSDP2 sets the reduced, sharded grad after backward, where no
                # post-accumulate-grad hook sees it: a released step would never run.
                raise ValueError(f"params[{index}] is a DTensor (FSDP2, tensor parallelism): "
                                 "release_grads=True steps each param inside backward, before "
                                 "its gradient is reduced and sharded; use release_grads=False")
            if p.dtype not in _SUPPORTED_DTYPES:
                raise ValueError(f"params[{index}] has dtype {p.dtype}; pagedoptim supports "
                                 "float32, bfloat16, float16 and complex64 params")
            if self._device is None:
                self._device = p.device
            elif p.device != self._device:
                raise ValueError(f"params must all be on one device: params[{index}] is on "
                                 f"{p.device}, earlier params are on {self._device}. "
                                 f"{_ONE_OPTIMIZER_PER_DEVICE}")
        # torch warns about a param given twice in one group (and steps it twice); so do we.
        super().add_param_group({**param_group, "params": params})
        if self._options.release_grads:
            self._register_release_hooks(tensors)

    def _register_release_hooks(self, params: list[torch.Tensor]) -> None:
        # Once per param: a param given twice in a group is stepped once per backward here
        # (each backward completes its gradient once), where step() would step it twice.
        # The hooks hold this optimizer weakly (engine/release_hooks.py). A param frozen
        # now gets its hook when it first has a gradient (_finish_released_round).
        self._release_hooks += release_hooks.claim(
            self, params, lambda optimizer, p: optimizer._step_released(p))

    # -- the step --------------------------------------------------------------------------

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # Device state: GradScaler hands over its scale and found_inf as device tensors
        # (optimizer.grad_scale / optimizer.found_inf) and the kernels unscale and skip on
        # the device, as torch's fused optimizers do: no host sync. With release_grads
        # GradScaler must not try to unscale gradients that are already gone; claiming
        # support makes it hand them over too, and step() says so.
        return self._options.release_grads or self._steps_on_a_device()

    def _steps_on_a_device(self) -> bool:
        """Whether the table kernels step this state: on a CUDA device, or on the simulated
        device (tests) that emulates them, with GradScaler's tensors as the CUDA ones take."""
        if self._engine is not None:
            return self._engine.device != "cpu"
        device = self._engine_device()
        if device is None:
            return False
        store = paging.store_options(self._options)
        return paging.engine_device(store, device) != "cpu"

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

    @open_only
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
        amp = self._amp_arguments() if self._step_supports_amp_scaling else {}
        stepped = [(p, group_id, p.grad, {}) for group_id, group in enumerate(self.param_groups)
                   for p in group["params"] if p.grad is not None]
        try:
            self._step_params(stepped, amp)
            if "grad_scale" in amp:
                # The kernels read the gradients unscaled; torch's optimizers leave them so
                # in p.grad too (GradScaler unscales them in place, the fused kernels write
                # them back), for whatever reads them after the step. One pass on the stream,
                # no sync.
                torch._foreach_div_([g for _, _, g, _ in stepped if not g.is_sparse],
                                    amp["grad_scale"].reshape(()))
        except BaseException:
            # GradScaler.step sets these before calling step() and deletes them after it
            # returns. After a raise they would stay, and the retry's scaler.step() would
            # multiply the stale scale into the new one: the gradients divided twice.
            for name in ("grad_scale", "found_inf"):
                self.__dict__.pop(name, None)
            raise
        return loss

    def _step_params(self, pending: list[tuple[torch.Tensor, int, torch.Tensor, dict[str, Any]]],
                     amp: dict[str, torch.Tensor]) -> None:
        """Steps each (param, group index, grad, tensors) in one native call per round;
        `tensors` are _add_to_batch's target and step (given by a compiled step's op)."""
        _refuse_cuda_graph_capture()
        self.state.sync()
        hyperparameters = [self._group_hyperparameters(group) for group in self.param_groups]
        # After a step that raised: a retry finishes it, anything else is refused
        # (pagedoptim/engine/interrupted_step.py).
        first_round, resume = interrupted_step.plan_rounds(
            type(self).__name__, self._engine, self._interrupted, pending, hyperparameters)
        fingerprint = interrupted_step.StepFingerprint.of(pending, hyperparameters)
        self._interrupted = None
        # A param given twice in a group is stepped twice, one after the other, as torch
        # steps it: each round holds every param at most once.
        round_index = 0
        while pending:
            batch, repeated, seen = _StepBatch(), [], set()
            batch.amp, batch.hyperparameters = amp, hyperparameters
            for entry in pending:
                p, group_id, grad, tensors = entry
                if id(p) in seen:
                    repeated.append(entry)
                    continue
                seen.add(id(p))
                grad = self._dense_grad(p, grad, self.param_groups[group_id])
                self._add_to_batch(batch, p, grad, group_id, **tensors)
            if round_index >= first_round:
                self._run(batch, fingerprint, round_index,
                          resume=resume and round_index == first_round)
            pending = repeated
            round_index += 1

    def _dense_grad(self, p: torch.Tensor, grad: torch.Tensor,
                    group: dict[str, Any]) -> torch.Tensor:
        """The gradient the kernels take; a sparse one raises as it does in torch (SGD
        overrides this: torch.optim.SGD takes sparse gradients)."""
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients"
                               f"{self._sparse_gradient_hint} (param of shape "
                               f"{tuple(p.shape)} has one)")
        return grad

    def _add_to_batch(self, batch: "_StepBatch", p: torch.Tensor, grad: torch.Tensor,
                      group_id: int, *, target: Optional[torch.Tensor] = None,
                      step: Optional[torch.Tensor] = None) -> None:
        """Adds param `p` to the batch. The step updates `target` and advances `step`,
        which are p and its step counter unless given: a compiled step hands over the
        tensors of its custom op, which may be functional copies of them."""
        # is_cuda / is_cpu, not .device: this runs per param per step, and every .device
        # makes a new object.
        if p.is_cuda:
            self._check_cuda_param(p)
        elif not p.is_cpu:
            raise NotImplementedError(
                f"{self._describe(p)} is on {p.device}; pagedoptim steps params on the CPU "
                "and on CUDA devices")
        if not (grad.is_cpu and p.is_cpu) and grad.device != p.device:
            raise ValueError(f"the grad of {self._describe(p)} is on {grad.device}, its param "
                             f"on {p.device}: they must be on one device")
        if grad.shape != p.shape or grad.dtype != p.dtype:
            raise ValueError(f"the grad of {self._describe(p)} has shape {tuple(grad.shape)} "
                             f"and dtype {grad.dtype}; it must match its param")
        values = p if target is None else target
        if sharded_params.is_dtensor(p) or sharded_params.is_dtensor(grad):
            # FSDP2 / tensor parallelism: the local shards are stepped, with state for them.
            grad = sharded_params.local_grad(p, grad, lambda: self._describe(p))
            # The step writes the local shard; a graph may have saved the DTensor itself
            # (tensor parallelism), whose version counter is its own.
            torch.autograd.graph.increment_version(values)
            values = sharded_params.local_tensor(values)
        if p.is_complex():
            # As torch.optim does: a complex param and its state are stepped as the real
            # view, every real and imaginary part an element of its own.
            values, grad = torch.view_as_real(values), torch.view_as_real(grad)
        work = values if values.is_contiguous() else values.contiguous()
        if work is not values:
            batch.write_back.append((values, work))
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

    def _run(self, batch: "_StepBatch", fingerprint: interrupted_step.StepFingerprint,
             round_index: int = 0, resume: bool = False) -> None:
        if not batch.params:
            return
        try:
            if resume:
                self._engine.resume_next_step()
            self._native_step(batch.params, batch.grads, batch.steps, batch.slots,
                              batch.group_ids, batch.hyperparameters, **batch.amp)
        except BaseException as error:
            if self._engine is not None and self._engine.interrupted_step is not None:
                self._interrupted = interrupted_step.Interrupted(
                    fingerprint, round_index, interrupted_step.describe_error(error))
            raise
        finally:
            # Also after an error: the chunks applied before it must reach the params
            # stepped on contiguous copies, or a retry could not finish the step.
            # Copies of the state read before the step no longer hold it.
            self.state.retire_all()
            # The kernels wrote the params through their pointers: tell autograd, as an
            # in-place op would, so a graph that saved a param before the step refuses to
            # backward through it (torch.optim's in-place updates raise there too).
            for param in batch.params:  # one at a time: torch < 2.5 takes no list
                torch.autograd.graph.increment_version(param)
            for p, work in batch.write_back:
                p.copy_(work)

    @property
    def interrupted_step(self) -> Optional[dict[str, Any]]:
        """None, or what the last step did before it raised: 'pages_done' of 'pages'
        applied, 'resumable' (whether step() with the same gradients can finish it), and
        'error' (what it raised). See docs/reliability.md, "Steps that fail"."""
        journal = self._engine.interrupted_step if self._engine is not None else None
        if self._interrupted is None or journal is None or journal["complete"]:
            return None
        return {"pages_done": journal["pages_done"], "pages": journal["pages"],
                "resumable": journal["resumable"], "error": self._interrupted.error}

    @open_only
    def discard_interrupted_step(self) -> None:
        """Accepts the interrupted step as it is: its step counters stay advanced and the
        pages it applied stay applied; the rest of it never will be. The next step() is a
        new step. Does nothing when no step was interrupted."""
        if self._engine is not None:
            self._engine.discard_interrupted_step()
        self._interrupted = None

    def _step_counter(self, p: torch.Tensor) -> torch.Tensor:
        """The param's step count: a 0-dim float32 tensor on the CPU for CPU params, and on
        the param's device for CUDA params (where the kernels advance it, as torch's fused
        optimizers keep it); state[p]['step'] unless the algorithm hides it."""
        return self.state[p].step_counter(self._step_device(p), self._step_in_state)

    def _step_counter_replaced(self) -> None:
        """A param's step counter was replaced or reset: a compiled step holding the old
        one must trace again."""
        compiled_step.forget_plan(self)

    @staticmethod
    def _step_device(p: torch.Tensor) -> torch.device:
        return p.device if p.is_cuda else _CPU

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
                "release_grads=False for gradient accumulation. If the previous backward "
                "raised midway (out of memory, say), call zero_grad() before retrying: the "
                "params it had stepped already keep that update")
        if not self._released_this_round:  # a backward's first release: what holds for all
            _refuse_cuda_graph_capture()
            release_guard.check_backward_not_scaled()
            release_guard.check_not_data_parallel()
            release_guard.install()  # accelerate may have been imported after __init__
            self.state.sync()
        group = self._group_of(p)
        batch = _StepBatch()
        batch.hyperparameters = [self._group_hyperparameters(group)]
        pending = [(p, 0, p.grad, {})]
        first_round, resume = interrupted_step.plan_rounds(
            type(self).__name__, self._engine, self._interrupted, pending, batch.hyperparameters)
        self._interrupted = None
        if first_round > 0:  # a retry of a step that had applied every page
            self._released_this_round.add(id(p))
            p.grad = None
            return
        self._add_to_batch(batch, p, self._dense_grad(p, p.grad, group), 0)
        self._run(batch, interrupted_step.StepFingerprint.of(pending, batch.hyperparameters),
                  resume=resume)
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
        self._step_unreleased_grads()
        self._released_this_round.clear()
        return None

    def _step_unreleased_grads(self) -> None:
        """Steps, as step() would, every param that has a gradient no hook released: a param
        frozen at construction and unfrozen since (it had no hook, so its gradient grew over
        the steps and it never moved), or a gradient set by hand. It gets its hook now, so
        from the next backward on it is released like the others."""
        late = [(p, group_id, p.grad, {}) for group_id, group in enumerate(self.param_groups)
                for p in group["params"] if p.grad is not None]
        if not late:
            return
        self._step_params(late, {})  # GradScaler was refused above
        for p, _, _, _ in late:
            p.grad = None
        self._register_release_hooks([p for p, _, _, _ in late
                                      if release_hooks.owner_of(p) is not self])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad; with release_grads=True it also ends the round, as step()
        does, so a backward that raised midway (out of memory, say) can be retried after
        it. The params that backward had already stepped keep that update: a release step
        cannot be undone."""
        super().zero_grad(set_to_none)
        if self._options.release_grads:
            self._released_this_round.clear()

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
        if self._options.master_bits is not None and p.dtype in LOW_PRECISION_DTYPES:
            return _KIND_WITH_RESIDUAL
        return _KIND_PLAIN

    @open_only
    def _ensure_engine(self) -> Any:
        if self._engine is None:
            device = self._engine_device()
            if device != self._device:
                # The params moved after construction (`opt = po.AdamW(model.parameters());
                # model.cuda()`): the paging checks of construction judged another device
                # (the offload tier chosen, the cache against the GPU's free memory).
                paging.check_before_first_step(self._options, device)
                self._check_page_file_fits(device)
                self._device = device
            for index, p in enumerate(self._indexed_params()):
                if p.device != self._device:
                    raise ValueError(f"params must all be on one device: param {index} is on "
                                     f"{p.device}, param 0 on {self._device}. "
                                     f"{_ONE_OPTIMIZER_PER_DEVICE}")
            self._kinds = self._stream_kinds()
            native_kinds = [[spec.as_native() for spec in kind] for kind in self._kinds]
            store = paging.store_options(self._options)
            device = paging.engine_device(store, self._device)
            self._page_bytes = paging.choose_page_bytes(self._options, store, self._kinds,
                                                        self._planned_state())
            self._engine = native.PagedState(self._kind, native_kinds, self._page_bytes,
                                             store=store, device=device)
            if store is not None:
                paging.warn_about_fallbacks(self._engine)
                paging.warn_about_host_offload_on_cpu(store, device)
        return self._engine

    def _slot(self, p: torch.Tensor) -> int:
        """The parameter's slot in the engine; lays out its state on first use (-1: the
        parameter keeps no state, as in plain SGD)."""
        slot = self._slots.get(p)
        if slot is None:
            engine = self._ensure_engine()
            kind = self._kind_of(p)
            if self._kinds[kind]:
                if any(spec.per_group for spec in self._kinds[kind]):
                    self._shard_groups(p)  # raises where a shard would cut a scale group
                # Pages start zeroed: a zero residual makes the master weight exactly the
                # 16-bit parameter, which is right for a weight never split before.
                slot = engine.register_param(_state_numel(p), kind)
            else:
                slot = -1
            self._slots[p] = slot
        return slot

    def _planned_state(self) -> list[tuple[int, int]]:
        """(kind, elements) of the state every param of the groups will have: what the
        page size is chosen for."""
        return [(self._kind_of(p), _state_numel(p))
                for p in dict.fromkeys(self._indexed_params())]

    def _streams_of(self, p: torch.Tensor) -> list[StreamSpec]:
        return self._kinds[self._kind_of(p)]

    # -- DTensor params: state of the local shard (see pagedoptim/state/sharding.py) --------

    def _shard_layout(self, p: torch.Tensor) -> Optional[sharded_params.ShardLayout]:
        """How p's state is sharded (None: p is not a DTensor)."""
        if not sharded_params.is_dtensor(p):
            return None
        layout = self._shard_layouts.get(p)
        if layout is None:
            layout = self._shard_layouts[p] = sharded_params.shard_layout(p)
        return layout

    def _shard_groups(self, p: torch.Tensor) -> None:
        layout = self._shard_layout(p)
        if layout is not None:
            layout.scales(lambda: self._describe(p))

    def _as_public(self, p: torch.Tensor, value: torch.Tensor, per_group: bool) -> torch.Tensor:
        """A stream of p's state as optimizer.state and state_dict() show it: a DTensor placed
        as the global stream would be for a DTensor param, else the local tensor itself."""
        layout = self._shard_layout(p)
        if layout is None:
            return value
        return sharded_params.as_dtensor(layout, value, per_group, lambda: self._describe(p))

    def _as_local(self, p: torch.Tensor, name: str, value: Any, where: str) -> Any:
        """A given stream of p (loaded, or assigned to optimizer.state) as p's local shard."""
        layout = self._shard_layout(p)
        if layout is None or not isinstance(value, torch.Tensor):
            return value
        return sharded_params.local_part(layout, value, state_format.is_group_stream(name),
                                         lambda: where)

    # -- state in pages, as optimizer.state shows it (see pagedoptim/state/param_state.py) --------

    def _indexed_params(self, groups: Optional[list[dict[str, Any]]] = None
                        ) -> list[torch.Tensor]:
        groups = self.param_groups if groups is None else groups
        return list(itertools.chain.from_iterable(g["params"] for g in groups))

    def _state_stream_names(self) -> set[str]:
        """Every key a page stream can have in state[p] or a state dict, in any format."""
        return state_format.all_stream_names(self._all_moments())

    def _is_state_stream_name(self, key: Any) -> bool:
        return isinstance(key, str) and key in self._state_stream_names()

    def _state_stream_keys(self, p: torch.Tensor) -> list[str]:
        """The streams `p` has in the pages now, in the stored format ([] before its first
        step, and for a param that keeps no state)."""
        if self._engine is None or self._slots.get(p, -1) < 0:
            return []
        return [spec.name for spec in self._streams_of(p)]

    def _decoded_names(self, p: torch.Tensor) -> set[str]:
        """fp32 moment names readable beside their stored 8-bit codes."""
        stored = set(self._state_stream_keys(p))
        return {m.name for m in self._all_moments() if f"{m.name}_codes" in stored}

    def _has_state_tensor(self, p: torch.Tensor, key: Any) -> bool:
        return key in self._state_stream_keys(p) or key in self._decoded_names(p)

    def _read_state_tensor(self, p: torch.Tensor, key: str) -> torch.Tensor:
        """A new tensor holding stream `key` of `p` (or the fp32 decoding of its codes),
        shaped like the param; fp32 moments of a complex param are complex, as torch's."""
        slot = self._slots[p]
        stored = {spec.name: spec for spec in self._streams_of(p)}
        shape = _state_shape(p)
        if key in stored:
            value = stored[key].tensor_from_bytes(self._engine.read_stream(slot, key), shape)
        else:
            given = {name: stored[name].tensor_from_bytes(self._engine.read_stream(slot, name),
                                                          shape)
                     for name in (f"{key}_codes", f"{key}_scales")}
            fp32 = StreamSpec(key, 4 * state_format.GROUP_SIZE, False, torch.float32)
            value = state_format.convert_for_stream(fp32, self._all_moments(), given,
                                                    _state_numel(p)).reshape(shape)
        if p.is_complex() and value.dtype == torch.float32 and value.shape == shape:
            value = torch.view_as_complex(value)
        return self._as_public(p, value, state_format.is_group_stream(key))

    def _write_state_tensors(self, p: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """Streams written through optimizer.state[p] (one key, or a whole entry), converted
        together: one moment's codes and scales become fp32 state and fp32 becomes codes."""
        self._write_param_streams(p, values, complete=False, where=where_written(values))

    def _write_param_streams(self, p: torch.Tensor, given: dict[str, torch.Tensor],
                             complete: bool, where: str) -> None:
        """Writes what `given` holds of `p`'s streams (in any format: fp32 moments and
        codes convert both ways) into the pages. Everything is converted and checked before
        anything is written. complete: every stream must be given (a loaded state)."""
        slot = self._slot(p)
        if slot < 0:
            if not given:
                return
            raise ValueError(f"{where}: {type(self).__name__} keeps no state for this param "
                             "with these hyperparameters")
        for moment in self._all_moments():
            if moment.name in given and ({f"{moment.name}_codes", f"{moment.name}_scales"}
                                         & given.keys()):
                # Which one holds the state is not for us to guess (DCP's full_state_dict
                # load keeps this optimizer's own stale entries beside a checkpoint's).
                raise ValueError(f"{where} holds '{moment.name}' both as fp32 and as 8-bit "
                                 "codes or scales; give one format only (a checkpoint of the "
                                 "other format loads through pagedoptim.dcp."
                                 "StateFormatLoadPlanner)")
        given = {name: _as_real(self._as_local(p, name, value, where), where)
                 for name, value in given.items()}
        numel = _state_numel(p)
        converted = []
        for spec in self._streams_of(p):
            value = state_format.convert_for_stream(spec, self._all_moments(), given, numel)
            if value is None:
                if complete and spec.name != state_format.RESIDUAL:
                    # no residual saved: the master is the 16-bit weight
                    raise ValueError(
                        f"{where} has no '{spec.name}' and nothing to convert it from; "
                        f"{type(self).__name__} with these hyperparameters keeps "
                        f"{[s.name for s in self._streams_of(p)]}")
                continue
            if spec.name == state_format.RESIDUAL and value.dtype != spec.dtype:
                value = _rescaled_residual(value, spec.dtype, where)
            expected = state_format.expected_numel(spec, numel)
            if value.numel() != expected:
                raise ValueError(f"{where}: '{spec.name}' has {value.numel()} elements, "
                                 f"expected {expected}")
            raw = value.detach().to(device="cpu", dtype=spec.dtype).contiguous()
            converted.append((spec.name, raw.view(-1).view(torch.uint8)))
        if not converted and given:
            raise ValueError(f"{where}: {sorted(given)} cannot be stored: {type(self).__name__} "
                             "with these settings keeps "
                             f"{[s.name for s in self._streams_of(p)]} for this param")
        for name, raw in converted:
            self._engine.write_stream(slot, name, raw)

    def _check_write_back(self, p: torch.Tensor, keys: list[str]) -> None:
        """Changed copies of one moment in two formats cannot both be written back."""
        for key in keys:
            if f"{key}_codes" in keys or f"{key}_scales" in keys:
                raise ValueError(f"optimizer.state[param][{key!r}] and its 8-bit codes or "
                                 "scales were both changed in place; change one format only")

    def _reset_param_state(self, p: torch.Tensor) -> None:
        """Back to the state of a param never stepped: zero pages (what new pages hold)."""
        slot = self._slots.get(p, -1) if self._engine is not None else -1
        if slot < 0:
            return
        for spec in self._streams_of(p):
            size = self._engine.stream_bytes(slot, spec.name)
            self._engine.write_stream(slot, spec.name, torch.zeros(size, dtype=torch.uint8))

    def _gather_streams(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every parameter's page streams as new tensors, by param index."""
        gathered: dict[int, dict[str, torch.Tensor]] = {}
        for index, p in enumerate(self._indexed_params()):
            keys = self._state_stream_keys(p)
            if keys:
                gathered[index] = {key: self._read_state_tensor(p, key) for key in keys}
        return gathered

    def _scatter_streams(self, streams: dict[int, dict[str, torch.Tensor]]) -> None:
        """Replaces the engine by one holding exactly `streams` (param index -> tensors, in
        this optimizer's format or another: fp32 moments and codes convert both ways).
        The new engine has no interrupted step to finish."""
        self._engine = None
        self._slots = {}
        self._interrupted = None
        if not streams:
            return
        params = self._indexed_params()
        for index in sorted(streams):
            self._write_param_streams(params[index], streams[index], complete=True,
                                      where=f"state for param {index}")

    # -- state_dict ------------------------------------------------------------------------

    @open_only
    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict, hooks included, with the page streams in each param's state
        (new tensors: a snapshot, unlike torch's references to the live state)."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self.state.sync()
        index_of: dict[int, int] = {}
        param_groups = []
        start = 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            for offset, p in enumerate(group["params"]):
                index_of.setdefault(id(p), start + offset)
            packed["params"] = [index_of[id(p)] for p in group["params"]]
            start += len(group["params"])
            param_groups.append(packed)
        packed_state: dict[Any, Any] = {}
        for key, value in self.state.items():
            if not isinstance(key, torch.Tensor):
                packed_state[key] = value
                continue
            entry = dict(value.plain_items()) if isinstance(value, ParamState) else dict(value)
            if isinstance(entry.get("step"), torch.Tensor):
                # A snapshot, like the streams, on the CPU where the state is on a device: as
                # torch's AdamW keeps it (unless fused or capturable), which reads a device
                # step back with a sync per param per step after loading it.
                entry["step"] = entry["step"].detach().to("cpu", copy=True)
            entry.update({name: self._read_state_tensor(key, name)
                          for name in self._state_stream_keys(key)})
            if entry:  # torch keeps no entry for a param without state
                packed_state[index_of[id(key)]] = entry
        state_dict = {"state": packed_state, "param_groups": param_groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    @open_only
    def torch_state_dict(self) -> dict[str, Any]:
        """This optimizer's state in torch.optim's format, loadable by the torch optimizer of
        the same algorithm: companded moments dequantized to fp32, master residuals dropped
        (torch keeps no master weight; the 16-bit parameter is the weight)."""
        state_dict = self.state_dict()
        moments = self._all_moments()
        params = self._indexed_params()
        for index, value in state_dict["state"].items():
            if not isinstance(index, int):
                continue
            converted = {k: v for k, v in value.items()
                         if k not in state_format.all_stream_names(moments)}
            p = params[index]
            for moment in self._moments():
                spec = StreamSpec(moment.name, 4 * state_format.GROUP_SIZE, False, torch.float32)
                tensor = state_format.convert_for_stream(
                    spec, moments, {k: _as_real(self._as_local(p, k, v, moment.name), moment.name)
                                    for k, v in value.items() if isinstance(v, torch.Tensor)},
                    _state_numel(p))
                if tensor is not None:
                    tensor = tensor.reshape(_state_shape(p))
                    if p.is_complex():
                        tensor = torch.view_as_complex(tensor.contiguous())
                    converted[moment.name] = self._as_public(p, tensor, per_group=False)
            state_dict["state"][index] = converted
        return state_dict

    @open_only
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, hooks included. Page streams in any format convert to
        this optimizer's; if anything in the state dict is wrong, nothing is changed."""
        self.state.sync()
        state_dict_checks.check_structure(state_dict)
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        state_dict_checks.check_structure(state_dict)  # as the hooks left it
        check_algorithm(self._kind, state_dict, type(self).__name__)
        groups = self.param_groups
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match "
                             "the size of optimizer's group")
        id_map = dict(zip(itertools.chain.from_iterable(g["params"] for g in saved_groups),
                          itertools.chain.from_iterable(g["params"] for g in groups)))
        index_of = {p: index for index, p in enumerate(self._indexed_params())}
        stream_names = self._state_stream_names()
        streams: dict[int, dict[str, torch.Tensor]] = {}
        plain: dict[torch.Tensor, dict[Any, Any]] = {}
        other: dict[Any, Any] = {}
        moments = self._all_moments()
        for key, value in state_dict["state"].items():
            if key not in id_map:
                other[key] = value  # not a param's state: kept as is, as torch keeps it
                continue
            p = id_map[key]
            state_dict_checks.check_param_state(key, value, moments, stream_names,
                                                _state_numel_global(p))
            # Sparse streams (torch.optim.SGD's momentum for sparse gradients; their indices
            # were checked above) are stored dense.
            own = {k: (v.to_dense() if isinstance(v, torch.Tensor) and v.is_sparse else v)
                   for k, v in value.items() if k in stream_names and v is not None}
            if own:
                streams[index_of[p]] = own
            plain[p] = {k: (v if k == "step" or not isinstance(v, torch.Tensor) else
                            _cast_like_torch(p, v, key, state_dict["param_groups"], k))
                        for k, v in value.items() if k not in stream_names}
        param_groups = [self._loaded_group(group, saved, index)
                        for index, (group, saved) in enumerate(zip(groups, saved_groups))]
        # Staged, then committed: the new state is built beside the old (a new engine, a new
        # StateMap), and a failure puts every attribute back as it was, the old engine and
        # its pages included, which nothing here writes to.
        before = dict(self.__dict__)
        try:
            self.param_groups = param_groups
            self._on_groups_loaded()
            self.state = StateMap(self)
            for key, value in other.items():
                self.state[key] = value
            self._scatter_streams(streams)
            for p, entries in plain.items():
                self._load_plain_state(p, entries, index_of[p] in streams)
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(before)
            raise
        # Only now are copies handed out from the old state stale: after a failed load
        # they still write back into the state they were read from.
        self.state.take_over(before["state"])
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _loaded_group(self, group: dict[str, Any], saved: dict[str, Any],
                      index: int) -> dict[str, Any]:
        """Loaded group `index`, `saved` (a copy, changed here), over the params of our
        `group`, with the defaults of keys it lacks; a bad group or hyperparameter raises
        before anything is changed."""
        saved["params"] = group["params"]
        if "param_names" in group and "param_names" not in saved:
            saved["param_names"] = group["param_names"]
        for name, default in self.defaults.items():
            saved.setdefault(name, default)
        torch_flags.normalize_loaded_group(saved, self.defaults)
        self._check_loaded_group(saved, group, index)
        self._group_hyperparameters(saved)  # a bad hyperparameter raises here
        return saved

    def _check_loaded_group(self, saved: dict[str, Any], group: dict[str, Any],
                            index: int) -> None:
        """Checks (and completes) loaded group `index`, `saved`, which replaces `group`,
        before anything is changed. Subclasses check what their groups add."""
        names = saved.get("param_names")
        if names is not None and (not isinstance(names, (list, tuple))
                                  or len(names) != len(group["params"])):
            raise ValueError(f"loaded param_groups[{index}]['param_names'] must be a list of "
                             f"{len(group['params'])} names (one per param), got {names!r}")

    def _on_groups_loaded(self) -> None:
        """New param_groups replaced the old ones (subclasses drop what they derived)."""

    # -- streaming checkpoints (pagedoptim/checkpoint/stream.py) ---------------------------

    @open_only
    def save_checkpoint(self, path: Any) -> None:
        """Writes the whole optimizer state to the file `path`, page by page: state larger
        than memory (paged to NVMe) can be saved, where state_dict() would gather it all.

        The file (docs/checkpoint_format.md) holds the param_groups, every param's step and
        other plain state, and the page streams as checksummed records of about one page.
        Memory beyond the page cache: one record buffer of the page size (page_bytes) and
        the header. The write is atomic: a temporary file in the same directory, fsynced,
        renamed over `path`, the directory fsynced; a crash leaves `path` as it was.
        Hooks of state_dict() do not run."""
        checkpoint_stream.save(self, path)

    @open_only
    def load_checkpoint(self, path: Any) -> None:
        """Loads a file written by save_checkpoint into this optimizer, page by page; it
        may use other paging settings (offload, page_bytes, cache_bytes) than the saver,
        but the same stream format (state_bits, master_bits: else ValueError, convert
        through state_dict()). Every header field and record checksum is checked; a
        foreign, truncated or corrupted file raises pagedoptim.CheckpointError (a
        ValueError) naming the file and the record. The state is loaded into a new engine
        and replaces the old one only when all of it checked out: on any error the
        optimizer is left exactly as it was. Memory beyond the new engine's page cache:
        one record buffer; an optimizer that had state keeps its old engine (its cache
        and page file) until the load is done. Hooks of load_state_dict() do not run."""
        checkpoint_stream.load(self, path)

    def _checkpoint_slots(self, p: torch.Tensor) -> list[tuple[str, int, int, list[StreamSpec]]]:
        """(role, engine slot, elements, streams) of each slot holding p's paged state."""
        slot = self._slots.get(p, -1)
        if self._engine is None or slot < 0:
            return []
        return [("state", slot, _state_numel(p), self._streams_of(p))]

    def _forget_engine(self) -> None:
        """Drops the references to the engine and its slots (a load builds a new one), and
        with them any interrupted step: the new engine has none to finish."""
        self._engine = None
        self._slots = {}
        self._interrupted = None

    def _load_plain_state(self, p: torch.Tensor, entries: dict[Any, Any],
                          has_streams: bool) -> None:
        """A loaded param's entries other than streams; its step as the engine needs it."""
        param_state = self.state[p]
        entries = dict(entries)
        step = entries.pop("step", None)
        if step is None:
            step = self._default_step(has_streams)
        elif isinstance(step, torch.Tensor):
            # The kernels advance it in place: the state dict given (a torch optimizer's
            # own, through wrap()) must not advance with it.
            step = step.detach().clone()
        param_state.update(entries)
        if self._step_in_state:
            param_state["step"] = step
        else:
            param_state.set_hidden_step(step)
        self._step_counter(p)

    def _default_step(self, has_streams: bool) -> float:
        """Step of a param whose loaded state has none (torch.optim.SGD keeps no step)."""
        return 0.0

    # -- copies ----------------------------------------------------------------------------

    @open_only
    def __getstate__(self) -> dict[str, Any]:
        self.state.sync()
        param_plain, hidden_steps, other = {}, {}, {}
        for key, value in self.state.items():
            if isinstance(value, ParamState):
                param_plain[key] = value.plain_items()
                if value.hidden_step() is not None:
                    hidden_steps[key] = value.hidden_step()
            else:
                other[key] = value
        return {"defaults": self.defaults, "param_groups": self.param_groups,
                "_options": self._options, "_param_plain": param_plain,
                "_hidden_steps": hidden_steps, "_other_state": other,
                "_saved_streams": self._gather_streams()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        options = state.pop("_options")
        saved_streams = state.pop("_saved_streams")
        param_plain = state.pop("_param_plain")
        hidden_steps = state.pop("_hidden_steps")
        other = state.pop("_other_state")
        super().__setstate__({**state, "state": {}})
        self._options = options
        self._engine = None
        self._slots = {}
        self._page_bytes = None
        self._shard_layouts = {}
        self._release_hooks = []
        self._released_this_round = set()
        self._interrupted = None
        self.state = StateMap(self)
        params = self._indexed_params()
        self._device = params[0].device if params else None
        if options.release_grads:
            release_guard.watch(self)
            self._register_release_hooks(params)
        self._scatter_streams(saved_streams)
        for p, entries in param_plain.items():
            self.state[p].update(entries)
        for p, step in hidden_steps.items():
            self.state[p].set_hidden_step(step)
        for key, value in other.items():
            self.state[key] = value

    # -- reports ---------------------------------------------------------------------------

    @open_only
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
        # A DTensor param counts its local shard: what this rank holds.
        params = [sharded_params.local_tensor(p) for p in self._indexed_params()]
        num_elements = sum(p.numel() for p in params)
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        grads = [sharded_params.local_tensor(p.grad) for p in self._indexed_params()
                 if p.grad is not None]
        grad_bytes = sum(g.numel() * g.element_size() for g in grads)
        stream_bytes = {"moment_bytes": 0, "scale_bytes": 0, "residual_bytes": 0}
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
                    stream_bytes[state_format.report_field(spec)] += \
                        self._engine.stream_bytes(slot, spec.name)
        moment_bytes, scale_bytes, residual_bytes = stream_bytes.values()
        step_bytes = 4 * sum(1 for v in self.state.values() if isinstance(v, ParamState)
                             and (v.hidden_step() is not None or "step" in v.plain_items()))
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
            "page_bytes": (self._page_bytes if self._page_bytes is not None
                           else self._options.page_bytes),
            "num_elements": num_elements,
            "state_bytes_per_param": state_bytes / per_param,
            "total_bytes_per_param": (param_bytes + grad_bytes + state_bytes) / per_param,
        }

    @open_only
    def paging_stats(self) -> dict[str, Any]:
        """The pager's counters since the state was created: hits, misses, hit_rate, bytes
        read and written per tier, stall_seconds (time the step waited for I/O), evictions,
        errors, the io backend and why it fell back, the O_DIRECT status. offload is None
        when the state is not paged; everything counts zero before the first step."""
        if self._engine is None:
            return paging.stats_before_first_step(self._options)
        return self._engine.paging_stats()


def _state_numel(p: torch.Tensor) -> int:
    """Elements of state per param: a complex param has two per element (its real view);
    a DTensor param keeps state for its local shard."""
    return sharded_params.local_tensor(p).numel() * (2 if p.is_complex() else 1)


def _state_numel_global(p: torch.Tensor) -> int:
    """Elements of the whole state of p (of every shard, for a DTensor param)."""
    return p.numel() * (2 if p.is_complex() else 1)


def _state_shape(p: torch.Tensor) -> torch.Size:
    shape = sharded_params.local_tensor(p).shape
    return torch.Size([*shape, 2]) if p.is_complex() else shape


def _cast_like_torch(p: torch.Tensor, value: torch.Tensor, index: Any,
                     param_groups: list[dict[str, Any]], key: Any) -> torch.Tensor:
    """A loaded state tensor other than a stream, cast to p's dtype and device as torch's
    load_state_dict casts it; a cast that fails (a tensor too large to copy) names it."""
    try:
        return torch.optim.Optimizer._process_value_according_to_param_policy(
            p, value, index, param_groups, key)
    except RuntimeError as error:
        raise ValueError(f"state for param {index!r}[{key!r}] could not be cast to its "
                         f"param's dtype and device ({p.dtype}, {p.device}): {error}") from None


def _rescaled_residual(value: torch.Tensor, dtype: torch.dtype, where: str) -> torch.Tensor:
    """A master residual saved with the other master_bits, in `dtype`'s code range: the
    residual is r / K half-ulps of the 16-bit weight, so r scales by K_new / K_old (int8 to
    int16 exactly; int16 to int8 rounded, within the int8 residual's own error)."""
    limits = state_dict_checks.RESIDUAL_LIMITS
    if value.dtype not in limits:
        raise TypeError(f"{where}: '{state_format.RESIDUAL}' must be int8 (master_bits=24) or "
                        f"int16 (master_bits=32), got {value.dtype}")
    scaled = value.to(torch.float64) * (limits[dtype] / limits[value.dtype])
    return torch.round(scaled).clamp_(-limits[dtype], limits[dtype]).to(dtype)


def _as_real(value: Any, where: str) -> torch.Tensor:
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
