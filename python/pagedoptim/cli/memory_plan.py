"""Where a training run's memory goes, before it runs: the arithmetic behind
`python -m pagedoptim plan`.

Optimizer state is exact (`state_plan.plan_state` runs the optimizer's own layout code);
weights and gradients are exact sums of the param shapes; activations are an estimate
(`activation_bytes`), and every report says so.

The peak of a step of training, on the device that trains, when gradients are freed between
steps (`zero_grad(set_to_none=True)` after `step()`, as HF Trainer does):

    weights + state resident there + max(activations + the loss's transient,
                                          gradients + the optimizer step's transient)

Backward frees activations layer by layer as it produces gradients layer by layer, so the
sum of the two stays near the larger of them; the step runs once every gradient exists.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch

from pagedoptim import optim
from pagedoptim.paging import state_plan
from pagedoptim.cli.model_shapes import ModelSpec, TransformerDims

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# What a CUDA process holds outside torch's tensors: the context, cuBLAS workspaces and the
# caching allocator's slack. Stated, not measured: it varies by GPU and driver.
CUDA_OVERHEAD_BYTES = 1 << 30
# Host memory a training process needs outside the optimizer's state (the interpreter, torch,
# the data loader): stated.
HOST_OVERHEAD_BYTES = 2 << 30


@dataclasses.dataclass(frozen=True)
class TrainingShape:
    seq_len: int = 2048
    micro_batch: int = 1
    activation_checkpointing: bool = False


@dataclasses.dataclass(frozen=True)
class Method:
    """Full fine-tuning (lora_rank None) or LoRA of rank r on the named modules."""

    lora_rank: Optional[int] = None
    lora_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    @property
    def is_lora(self) -> bool:
        return self.lora_rank is not None


# --- activations ----------------------------------------------------------------------------


def activation_bytes(dims: TransformerDims, shape: TrainingShape, dtype: torch.dtype) -> int:
    """Bytes autograd saves for backward in one forward of a pre-norm decoder with fused
    (SDPA/flash) attention: no seq_len^2 term. Per token and layer: the gated MLP's four
    intermediate tensors (per expert chosen), the attention's q, k, v, output and residual
    stream, and the two norms' float32 inputs; outside the layers the final norm, the logits
    the model returns and the float32 copy the loss takes. Fitted to HF Llama's saved
    tensors in float32 and bfloat16 (within 6%); other architectures differ in detail.

    With activation checkpointing each layer keeps only its input, and backward recomputes
    one layer at a time, which adds one layer's activations."""
    element = dtype.itemsize
    h, kv = dims.hidden_size, dims.kv_dim
    mlp = 4 * dims.intermediate_size * dims.experts_per_token + dims.num_experts
    per_layer = element * (mlp + 6 * h + 2 * kv) + 4 * 2 * h
    outside = (4 + element) * dims.vocab_size + 4 * h + element * 2 * h
    tokens = shape.seq_len * shape.micro_batch
    if shape.activation_checkpointing:
        return tokens * (dims.num_layers * element * h + per_layer + outside)
    return tokens * (dims.num_layers * per_layer + outside)


def loss_transient_bytes(dims: TransformerDims, shape: TrainingShape, dtype: torch.dtype) -> int:
    """The loss's backward holds the logits' gradient in float32 and in the model's dtype."""
    element = dtype.itemsize
    return shape.seq_len * shape.micro_batch * dims.vocab_size * (4 + element)


# --- trainable params -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Params:
    """What the optimizer steps and what the model holds."""

    trainable: list[tuple[str, tuple[int, ...], torch.dtype]]
    frozen_bytes: int

    @property
    def trainable_elements(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.trainable)

    @property
    def trainable_bytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in self.trainable)

    @property
    def largest_trainable_bytes(self) -> int:
        return max((math.prod(shape) * dtype.itemsize for _, shape, dtype in self.trainable),
                   default=0)


def _matches(module_name: str, targets: tuple[str, ...]) -> bool:
    if "all-linear" in targets:
        return not module_name.split(".")[-1] == "lm_head"
    return module_name.split(".")[-1] in targets


def trainable_params(spec: ModelSpec, method: Method, dtype: torch.dtype) -> Params:
    """Full fine-tuning trains every param in `dtype`. LoRA freezes them and trains A [r, in]
    and B [out, r] per targeted linear layer, in float32: PEFT upcasts adapters of bf16 and
    fp16 layers (its autocast_adapter_dtype default)."""
    all_bytes = spec.num_params * dtype.itemsize
    if not method.is_lora:
        return Params([(name, shape, dtype) for name, shape in spec.params], 0)
    if not spec.linear_layers:
        raise ValueError("--lora-rank needs a model with layers (--model config.json): a "
                         "parameter count or named shapes do not say which are linear")
    rank = method.lora_rank
    adapters = []
    for layer in spec.linear_layers:
        if _matches(layer.name, method.lora_modules):
            adapters.append((f"{layer.name}.lora_A", (rank, layer.in_features), torch.float32))
            adapters.append((f"{layer.name}.lora_B", (layer.out_features, rank), torch.float32))
    if not adapters:
        names = sorted({layer.name.split(".")[-1] for layer in spec.linear_layers})
        raise ValueError(f"--lora-modules {','.join(method.lora_modules)} matches no linear "
                         f"layer of the model; its linear layers are named {', '.join(names)}")
    return Params(adapters, all_bytes)


# --- one column of the plan -----------------------------------------------------------------


@dataclasses.dataclass
class Column:
    """One way to train: the memory it needs by component, where, and its step estimate."""

    name: str
    settings: dict[str, Any]  # the optimizer's keyword arguments (empty for torch's)
    weights: int
    grads: int
    activations: Optional[int]
    optimizer_state: int  # moments, scales, step counters and page slack
    master_residual: int
    page_cache: int  # device (or, for CPU training, host) memory the page cache may use
    pinned_host: int
    host: int  # host memory the state holds outside the page cache (a host tier)
    nvme: int
    step_transient: int  # what the optimizer step allocates on top, at its peak
    device_peak: int  # on the device that trains; includes CUDA_OVERHEAD_BYTES on a GPU
    host_needed: int  # host memory beyond the training device's
    exact_state: Optional[state_plan.StatePlan] = None
    estimates: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        record["exact_state"] = self.exact_state.as_dict() if self.exact_state else None
        return record


def _meta_params(params: Params) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
            for _, shape, dtype in params.trainable]


def pagedoptim_state(params: Params, algorithm: str, settings: dict[str, Any],
                     device: torch.device) -> state_plan.StatePlan:
    optimizer_class = {"adamw": optim.AdamW, "lion": optim.Lion, "sgd": optim.SGD}[algorithm]
    extra = {"lr": 1e-3, "momentum": 0.9} if algorithm == "sgd" else {}
    optimizer = optimizer_class(_meta_params(params), **extra, **settings)
    return state_plan.plan_state(optimizer.state_store, device)


def torch_state_bytes(params: Params, algorithm: str) -> tuple[int, int]:
    """torch.optim's state (moments in each param's dtype, a 4-byte step tensor per param)
    and its step's transient: the single-tensor loop allocates temporaries the size of the
    largest param twice over (exp_avg_sq's square root, then the update)."""
    moments = {"adamw": 2, "lion": 1, "sgd": 1}[algorithm]
    steps = 4 * len(params.trainable) if algorithm == "adamw" else 0
    return moments * params.trainable_bytes + steps, 2 * params.largest_trainable_bytes


def blockwise_8bit_state_bytes(params: Params, algorithm: str) -> int:
    """A generic 8-bit optimizer without paging (bitsandbytes' AdamW8bit layout): one byte
    per element per moment plus a float32 scale per 256 elements."""
    moments = {"adamw": 2, "lion": 1, "sgd": 1}[algorithm]
    elements = params.trainable_elements
    return moments * (elements + 4 * -(-elements // 256)) + 4 * len(params.trainable)


def build_column(name: str, params: Params, *, device: torch.device, algorithm: str,
                 activations: Optional[int], loss_transient: int,
                 settings: Optional[dict[str, Any]] = None, state: Optional[int] = None,
                 step_transient: int = 0) -> Column:
    """A column for torch's or a peer's optimizer (`state` given) or for pagedoptim with
    `settings`."""
    on_gpu = device.type == "cuda"
    weights = params.frozen_bytes + params.trainable_bytes
    release = bool(settings and settings.get("release_grads"))
    grads = params.largest_trainable_bytes if release else params.trainable_bytes
    exact = None
    residual = cache = pinned = host_tier = nvme = 0
    resident_state = state or 0
    if settings is not None:
        exact = pagedoptim_state(params, algorithm, settings, device)
        placement = exact.state_placement
        residual = exact.residual_bytes
        state = exact.state_bytes - residual
        pinned = placement.get("pinned_host", 0)
        nvme = placement.get("nvme", 0)
        host_tier = placement.get("host_tier", 0)
        if exact.offload is None:
            resident_state = exact.state_bytes
        else:
            cache = placement.get("device" if on_gpu else "host", 0)
            resident_state = cache + exact.step_bytes
    act = activations or 0
    peak = weights + resident_state + max(act + loss_transient, grads + step_transient)
    if on_gpu:
        peak += CUDA_OVERHEAD_BYTES
    host_needed = pinned + host_tier
    return Column(name, dict(settings or {}), weights, grads, activations, int(state or 0),
                  residual, cache, pinned, host_tier, nvme, step_transient, peak, host_needed,
                  exact)


# --- step-time estimates --------------------------------------------------------------------


def step_bytes_touched(params: Params, column: Column) -> int:
    """Bytes a step reads and writes: each param and its state read and written, its
    gradient read."""
    state = column.optimizer_state + column.master_residual
    if column.exact_state is not None:
        state = (column.exact_state.moment_bytes + column.exact_state.scale_bytes
                 + column.exact_state.residual_bytes)
    return 2 * params.trainable_bytes + params.trainable_bytes + 2 * state


def paging_traffic_bytes(column: Column) -> tuple[int, int]:
    """(read, written) per step in steady state: with the plan-aware policy (the default)
    the cache keeps its budget's worth of pages and every other page is read in and written
    back once. policy='lru' can miss a few pages more."""
    exact = column.exact_state
    if exact is None or exact.offload is None:
        return 0, 0
    pages = exact.num_pages * exact.page_bytes
    missing = max(0, pages - (exact.cache_bytes or 0))
    return missing, missing
