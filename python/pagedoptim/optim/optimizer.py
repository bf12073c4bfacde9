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

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Optional

import torch

from pagedoptim import paging
from pagedoptim.checkpoint import stream as checkpoint_stream
from pagedoptim.engine import compiled_step, interrupted_step, release_guard, release_hooks
from pagedoptim.engine.lifecycle import ClosedState, open_only
from pagedoptim.engine.state_store import (ONE_OPTIMIZER_PER_DEVICE, StateStore,
                                           replacing_state)
from pagedoptim.engine.step_batch import StepBatch, refuse_cuda_graph_capture
from pagedoptim.optim import state_dict as state_dict_bodies
from pagedoptim.optim import release_ddp, torch_flags, trainer_route_check
from pagedoptim.optim.gradient_release import GradientRelease
from pagedoptim.paging.options import PagingOptions
from pagedoptim.state import sharding as sharded_params
from pagedoptim.state.format import Moment
from pagedoptim.state.param_state import StateMap

__all__ = ["PagedOptimizer"]

# complex64 params are stepped as their float32 real view, as torch.optim does.
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.complex64)

_CPU = torch.device("cpu")


class PagedOptimizer(torch.optim.Optimizer):
    """Base class; subclasses set `_kind` and implement the hooks marked below.

    The state lives in `state_store` (pagedoptim/engine/state_store.py); this class keeps
    construction, the lifecycle, the step's orchestration and torch's Optimizer contract."""

    _kind: str = ""
    # Whether state[p] shows 'step', as torch's optimizer of the algorithm does (torch.optim.SGD
    # keeps none; ours still counts steps, out of sight).
    _step_in_state: bool = True
    # What torch's error for a sparse gradient adds (AdamW: where to go instead).
    _sparse_gradient_hint: str = ""
    # The store class of the algorithm's state layout.
    _store_class: type = StateStore

    def __init__(self, params: Any, defaults: dict[str, Any], options: PagingOptions) -> None:
        self._options = options
        self._store = self._store_class(self, self._kind, options)
        self._release_hooks: list[Any] = []
        self._release = GradientRelease(self, options) if options.release_grads else None
        self._last_grad_norm: Optional[torch.Tensor] = None
        # max_grad_norm clipped p.grad in place for a step that raised: its retry must not
        # clip the clipped gradients again (zero_grad() or a finished step forgets it).
        self._clipped_for_step = False
        self._closed = False
        if isinstance(params, (set, frozenset)):
            raise TypeError("params must be an ordered collection (a list, a generator, "
                            "named_parameters()), not a set: a set's order changes between "
                            "runs, and the state_dict maps state to params by position")
        super().__init__(params, defaults)
        self.state: StateMap = StateMap(self)
        # What can be known wrong before the first step is reported here, not there.
        paging.check_before_first_step(options, self._store.device)
        self._store.check_page_file_fits(self._store.device)
        if options.release_grads:
            release_guard.watch(self)
        trainer_route_check.warn_if_trainer_learning_rate_unused(self)

    @property
    def state_store(self) -> StateStore:
        """Where this optimizer's state lives: the pages of its native engine and the
        translation between them and the tensors optimizer.state and state_dict() show
        (pagedoptim/engine/state_store.py). Replaced by every load."""
        return self._store

    # -- lifecycle (pagedoptim/engine/lifecycle.py) -----------------------------------------

    def close(self) -> None:
        """Releases the state now: the page file (its descriptor, and so its disk space),
        the io_uring ring and pinned buffers, and those of the released gradients' streams.
        Every later use of the optimizer raises; closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        for handle in self._release_hooks:  # backward must no longer release into it
            handle.remove()
        self._release_hooks.clear()
        if self._release is not None:
            self._release.close()
        compiled_step.forget_plan(self)
        self.state = ClosedState(self)  # type: ignore[assignment]
        self._store.close()

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

    def _group_hyperparameters(self, group: dict[str, Any]) -> tuple:
        """The group's hyperparameters, validated, in the native tuple order."""
        raise NotImplementedError

    def _native_step(self, batch: StepBatch) -> None:
        """One native step call over `batch` (the engine exists: the batch's slots made it)."""
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
        """Whether gradients are released (release_grads=True): each one goes into a
        gradient stream of the param's pages as backward produces it and p.grad is freed;
        step() steps from the streams (optim/gradient_release.py)."""
        return self._options.release_grads

    @property
    def max_grad_norm(self) -> Optional[float]:
        """The max_norm step() clips the gradients to, as clip_grad_norm_ would, before it
        steps (None: it does not clip)."""
        return self._options.max_grad_norm

    @property
    def last_grad_norm(self) -> Optional[torch.Tensor]:
        """The total gradient norm of the last step, where it was clipped (by max_grad_norm,
        or by a clip_grad_norm_ of released gradients): what clip_grad_norm_ returned. A
        0-dim tensor; None before any."""
        if self._release is not None:
            return self._release.last_grad_norm
        return self._last_grad_norm

    @open_only
    def register_ddp(self, model: Any) -> None:
        """With release_grads=True under DDP: takes the gradients of `model` (the
        DistributedDataParallel module of this optimizer's params) after DDP's all-reduce,
        so every rank steps the same reduced gradient (optim/release_ddp.py). Call it once
        after wrapping the model, before the first backward; the module must have no
        communication hook of its own (several optimizers may register on one module)."""
        if self._release is None:
            raise ValueError("register_ddp is for release_grads=True: without release, DDP "
                             "reduces p.grad and step() reads it")
        release_ddp.register(self._release, model)

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
        store = self._store
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
            if store.device is None:
                store.device = p.device
            elif p.device != store.device:
                raise ValueError(f"params must all be on one device: params[{index}] is on "
                                 f"{p.device}, earlier params are on {store.device}. "
                                 f"{ONE_OPTIMIZER_PER_DEVICE}")
        # torch warns about a param given twice in one group (and steps it twice); so do we.
        super().add_param_group({**param_group, "params": params})
        if self._options.release_grads:
            self._release.groups_changed()
            self._register_release_hooks(tensors)

    def _register_release_hooks(self, params: list[torch.Tensor]) -> None:
        # Once per param: each backward completes a param's gradient once, however often the
        # param is given (step() then steps it once per time it is given, as torch does).
        # The hooks hold this optimizer weakly (engine/release_hooks.py). A param frozen
        # now gets its hook when it first has a gradient (GradientRelease.finish_round).
        self._release_hooks += release_hooks.claim(
            self, params, lambda optimizer, p: optimizer._release.on_hook(p))

    # -- the step --------------------------------------------------------------------------

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # Device state: GradScaler hands over its scale and found_inf as device tensors
        # (optimizer.grad_scale / optimizer.found_inf) and the kernels unscale and skip on
        # the device, as torch's fused optimizers do: no host sync. The same with
        # release_grads: GradScaler's unscale_ and inf checks reach the released gradients
        # through release_guard (optim/gradient_release.py).
        return self._store.steps_on_a_device()

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
            amp[name] = value.to(device=self._store.engine_device(), dtype=torch.float32,
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
        if self._options.max_grad_norm is not None and stepped \
                and not self._clipped_for_step:  # a retried step's gradients are clipped
            if "grad_scale" in amp:
                raise RuntimeError(
                    f"max_grad_norm={self._options.max_grad_norm} cannot clip gradients "
                    "GradScaler has not unscaled: call scaler.unscale_(optimizer) before "
                    "scaler.step(optimizer)")
            # clip_grad_norm_ of the optimizer's params, in their order, as a loop would.
            self._last_grad_norm = torch.nn.utils.clip_grad_norm_(
                list(dict.fromkeys(p for p, _, _, _ in stepped)), self._options.max_grad_norm)
            self._clipped_for_step = True
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
        self._clipped_for_step = False
        return loss

    def _step_params(self, pending: list[tuple[torch.Tensor, int, torch.Tensor, dict[str, Any]]],
                     amp: dict[str, torch.Tensor]) -> None:
        """Steps each (param, group index, grad, tensors) in one native call per round;
        `tensors` are _add_to_batch's target and step (given by a compiled step's op)."""
        refuse_cuda_graph_capture()
        self.state.sync()
        store = self._store
        hyperparameters = [self._group_hyperparameters(group) for group in self.param_groups]
        # After a step that raised: a retry finishes it, anything else is refused
        # (pagedoptim/engine/interrupted_step.py).
        first_round, resume = interrupted_step.plan_rounds(
            type(self).__name__, store.engine, store.interrupted, pending, hyperparameters)
        fingerprint = interrupted_step.StepFingerprint.of(pending, hyperparameters)
        store.interrupted = None
        # A param given twice in a group is stepped twice, one after the other, as torch
        # steps it: each round holds every param at most once.
        round_index = 0
        while pending:
            batch, repeated, seen = StepBatch(hyperparameters, amp), [], set()
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

    def _add_to_batch(self, batch: StepBatch, p: torch.Tensor, grad: torch.Tensor,
                      group_id: int, *, target: Optional[torch.Tensor] = None,
                      step: Optional[torch.Tensor] = None) -> None:
        """Adds param `p` to the batch. The step updates `target` and advances `step`,
        which are p and its step counter unless given: a compiled step hands over the
        tensors of its custom op, which may be functional copies of them."""
        batch.add(self._store, p, grad, group_id,
                  self._step_counter(p) if step is None else step, target)

    def _run(self, batch: StepBatch, fingerprint: interrupted_step.StepFingerprint,
             round_index: int = 0, resume: bool = False) -> None:
        if not batch.params:
            return
        store = self._store
        try:
            if resume:
                store.engine.resume_next_step()
            self._native_step(batch)
        except BaseException as error:
            if store.engine is not None and store.engine.interrupted_step is not None:
                store.interrupted = interrupted_step.Interrupted(
                    fingerprint, round_index, interrupted_step.describe_error(error))
            raise
        finally:
            # Copies of the state read before the step no longer hold it.
            self.state.retire_all()
            batch.finish()

    @property
    def interrupted_step(self) -> Optional[dict[str, Any]]:
        """None, or what the last step did before it raised: 'pages_done' of 'pages'
        applied, 'resumable' (whether step() with the same gradients can finish it), and
        'error' (what it raised). See docs/reliability.md, "Steps that fail"."""
        store = self._store
        journal = store.engine.interrupted_step if store.engine is not None else None
        if store.interrupted is None or journal is None or journal["complete"]:
            return None
        return {"pages_done": journal["pages_done"], "pages": journal["pages"],
                "resumable": journal["resumable"], "error": store.interrupted.error}

    @open_only
    def discard_interrupted_step(self) -> None:
        """Accepts the interrupted step as it is: its step counters stay advanced and the
        pages it applied stay applied; the rest of it never will be. The next step() is a
        new step. Does nothing when no step was interrupted."""
        if self._store.engine is not None:
            self._store.engine.discard_interrupted_step()
        self._store.interrupted = None

    def _step_counter(self, p: torch.Tensor) -> torch.Tensor:
        """The param's step count: a 0-dim float32 tensor on the CPU for CPU params, and on
        the param's device for CUDA params (where the kernels advance it, as torch's fused
        optimizers keep it); state[p]['step'] unless the algorithm hides it."""
        return self.state[p].step_counter(p.device if p.is_cuda else _CPU, self._step_in_state)

    # -- gradient release (pagedoptim/optim/gradient_release.py) ---------------------------

    def _finish_released_round(self, closure: Any) -> None:
        if closure is not None:
            raise RuntimeError("step(closure) cannot be used with release_grads=True: the "
                               "closure's backward releases the gradients that step() steps; "
                               "call the closure (backward) before step()")
        try:
            self._release.finish_round(
                lambda entries, amp: self._step_params(
                    [(p, group_id, grad, {}) for p, group_id, grad in entries], amp),
                self._amp_arguments() if self._step_supports_amp_scaling else {})
        except BaseException:
            for name in ("grad_scale", "found_inf"):  # as step() does: see there
                self.__dict__.pop(name, None)
            raise
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad; with release_grads=True it also empties the gradient streams
        (or, with set_to_none=False, zeroes them), as it does p.grad without release (after a
        backward that raised midway, out of memory say, the retry starts from no gradient).
        A module's zero_grad() does the same for its params (engine/release_guard.py)."""
        super().zero_grad(set_to_none)
        self._clipped_for_step = False
        if self._release is not None:
            self._release.zero(self._store.params(), set_to_none)

    # -- state_dict (the bodies: pagedoptim/optim/state_dict.py) ----------------------------

    @open_only
    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict, hooks included, with the page streams in each param's state
        (new tensors: a snapshot, unlike torch's references to the live state)."""
        return state_dict_bodies.pack(self)

    @open_only
    def torch_state_dict(self) -> dict[str, Any]:
        """This optimizer's state in torch.optim's format, loadable by the torch optimizer of
        the same algorithm: companded moments dequantized to fp32, master residuals dropped
        (torch keeps no master weight; the 16-bit parameter is the weight)."""
        return state_dict_bodies.as_torch_format(self, self.state_dict())

    @open_only
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, hooks included. Page streams in any format convert to
        this optimizer's; if anything in the state dict is wrong, nothing is changed."""
        state_dict_bodies.load(self, state_dict)

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

    @contextlib.contextmanager
    def _replacing_state(self, param_groups: list[dict[str, Any]]) -> Iterator[StateStore]:
        """A load: the groups replaced by `param_groups`, a fresh store and state map to
        fill (yielded), all of it undone if the body raises (engine/state_store.py)."""
        with replacing_state(self):
            self.param_groups = param_groups
            self._store = self._store.fresh()
            self.state = StateMap(self)
            yield self._store
        compiled_step.forget_plan(self)

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
        self.state.sync()
        checkpoint_stream.save(self._store, self.state, path)

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
        self.state.sync()
        with checkpoint_stream.Reader(self._store, path) as reader:
            param_groups = [self._loaded_group(group, dict(saved), index)
                            for index, (group, saved)
                            in enumerate(zip(self.param_groups, reader.param_groups))]
            with self._replacing_state(param_groups) as store:
                reader.read_streams(store)
                for key, value in reader.other_state():
                    self.state[key] = value
                params = store.params()
                for position, entries, has_streams in reader.plain_state(self._step_in_state):
                    self._load_plain_state(params[position], entries, has_streams)

    # -- copies ----------------------------------------------------------------------------

    @open_only
    def __getstate__(self) -> dict[str, Any]:
        return state_dict_bodies.pickled(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        saved = {name: state.pop(name) for name in state_dict_bodies.PICKLED_FIELDS}
        super().__setstate__({**state, "state": {}})
        self._options = saved["_options"]
        params = [p for group in self.param_groups for p in group["params"]]
        self._store = self._store_class(self, self._kind, self._options,
                                        params[0].device if params else None)
        self._release_hooks = []
        self._release = GradientRelease(self, self._options) if self._options.release_grads \
            else None
        self._last_grad_norm = None
        self._clipped_for_step = False
        self._closed = False
        self.state = StateMap(self)
        if self._options.release_grads:
            release_guard.watch(self)
            self._register_release_hooks(params)
        state_dict_bodies.restore_pickled(self, saved)

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
        file). 'fp32_state_elements': with state_bits=8, the elements of the params that keep
        fp32 moments (1-D, fewer than min_8bit_size elements, complex; docs/compression.md).
        SkewAdam adds 'factor_bytes', 'tiers' and 'params'
        (pagedoptim/optim/skewadam_store.py). With release_grads=True, 'grad_stream_bytes'
        are the pages of the gradient streams (docs/gradient_release.md; not state) and
        'grad_stream_placement' where they are, as 'state_placement' says it.
        """
        report = self._store.memory_report(self.state)
        if self._release is not None:
            usage = self._release.gradients.memory_usage()
            report["grad_stream_bytes"] = usage["state_bytes"]
            report["grad_stream_placement"] = usage["placement"]
        return report

    @open_only
    def paging_stats(self) -> dict[str, Any]:
        """The pager's counters since the state was created: hits, misses, hit_rate, bytes
        read and written per tier, stall_seconds (time the step waited for I/O), evictions,
        errors, the io backend and why it fell back, the O_DIRECT status. offload is None
        when the state is not paged; everything counts zero before the first step. With
        release_grads=True, 'grad_streams' holds the same counters of the gradient streams'
        pages (None before the first release)."""
        stats = self._store.paging_stats()
        if self._release is not None:
            stats["grad_streams"] = self._release.gradients.paging_stats()
        return stats
