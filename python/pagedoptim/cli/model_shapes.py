"""The models `python -m pagedoptim plan` plans for: named parameter shapes, the linear
layers LoRA can adapt, and the dimensions the activation estimate needs.

Three ways to name one:
- a HF `config.json`: the model is built from it on the meta device by transformers (no
  memory, no download), so the shapes are exactly the ones training will see, for every
  architecture transformers knows;
- a parameter count (`7e9`, `7B`): one tensor of that many elements; no layer structure, so
  no activation estimate and no LoRA;
- named shapes (`embed=32000x4096,layers.q=4096x4096*32`): `*N` repeats an entry N times.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
from typing import Any, Optional

import torch

# What the activation estimate reads from a config, by the name transformers' configs use
# (their attribute_map translates GPT-2's n_embd and the like).
REQUIRED_CONFIG_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclasses.dataclass(frozen=True)
class LinearLayer:
    name: str  # the module's qualified name, e.g. "model.layers.0.self_attn.q_proj"
    in_features: int
    out_features: int


@dataclasses.dataclass(frozen=True)
class TransformerDims:
    """What the activation estimate of a pre-norm decoder needs."""

    hidden_size: int
    num_layers: int
    num_heads: int
    kv_dim: int  # key (= value) width: num_key_value_heads * head_dim
    intermediate_size: int  # one expert's when the model is a mixture of experts
    vocab_size: int
    experts_per_token: int = 1  # top-k of a mixture of experts; 1 for a dense MLP
    num_experts: int = 0


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    description: str
    params: list[tuple[str, tuple[int, ...]]]  # (name, shape), each distinct param once
    dtype: Optional[torch.dtype]  # what the config says the weights are (None: not said)
    linear_layers: list[LinearLayer]  # empty: LoRA cannot be planned
    dims: Optional[TransformerDims]  # None: no activation estimate

    @property
    def num_params(self) -> int:
        return sum(math.prod(shape) for _, shape in self.params)


# --- parameter counts and named shapes ------------------------------------------------------

_COUNT_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_param_count(text: str) -> int:
    """'7e9', '7B', '1.5b', '350M', '125000000' -> elements."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*", str(text).lower())
    if match is None:
        raise ValueError(f"--params: expected a parameter count such as 7e9, 7B or 350M, "
                         f"got {text!r}")
    count = float(match.group(1)) * _COUNT_SUFFIXES.get(match.group(2), 1)
    if not math.isfinite(count) or count < 1 or count > 1e15:
        raise ValueError(f"--params: expected a count between 1 and 1e15, got {text!r}")
    return int(round(count))


def from_param_count(text: str) -> ModelSpec:
    count = parse_param_count(text)
    return ModelSpec(f"{count:,} params (a count: no layer shapes)", [("params", (count,))],
                     None, [], None)


def from_named_shapes(text: str) -> ModelSpec:
    params: list[tuple[str, tuple[int, ...]]] = []
    for index, entry in enumerate(part.strip() for part in text.split(",")):
        match = re.fullmatch(r"([^=\s]+)=([0-9]+(?:x[0-9]+)*)(?:\*([0-9]+))?", entry)
        if match is None:
            raise ValueError(f"--shapes entry {index} ({entry!r}): expected NAME=DxD[xD...] "
                             "with an optional *COUNT, e.g. layers.q=4096x4096*32")
        name, dims, repeat = match.group(1), match.group(2), match.group(3)
        shape = tuple(int(d) for d in dims.split("x"))
        if any(d < 1 for d in shape):
            raise ValueError(f"--shapes entry {index} ({entry!r}): every dimension must be >= 1")
        count = int(repeat) if repeat is not None else 1
        if count < 1:
            raise ValueError(f"--shapes entry {index} ({entry!r}): the *COUNT must be >= 1")
        params.extend((f"{name}.{i}" if count > 1 else name, shape) for i in range(count))
    total = sum(math.prod(shape) for _, shape in params)
    return ModelSpec(f"{len(params)} named tensors, {total:,} params", params, None, [], None)


# --- HF configs -----------------------------------------------------------------------------


def _config_value(config: Any, raw: dict[str, Any], name: str, path: pathlib.Path) -> int:
    aliases = {name} | {target for key, target in getattr(config, "attribute_map", {}).items()
                        if key == name}
    if not aliases & raw.keys():
        raise ValueError(f"{path}: the config has no '{name}' (nor "
                         f"{', '.join(sorted(aliases - {name})) or 'an alias'}); plan needs it")
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{path}: '{name}' must be a positive integer, got {value!r}")
    return value


def _dims(config: Any, raw: dict[str, Any], path: pathlib.Path) -> TransformerDims:
    for name in REQUIRED_CONFIG_FIELDS:
        _config_value(config, raw, name, path)
    return dims_from_config(config)


def dims_from_config(config: Any) -> TransformerDims:
    """The activation estimate's dimensions of a transformers config object."""
    hidden, layers, heads, vocab = (getattr(config, name) for name in REQUIRED_CONFIG_FIELDS)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = (getattr(config, "moe_intermediate_size", None)
                    or getattr(config, "intermediate_size", None)
                    or getattr(config, "n_inner", None) or 4 * hidden)
    experts = (getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
               or 0)
    top_k = getattr(config, "num_experts_per_tok", None) or 1
    return TransformerDims(hidden, layers, heads, kv_heads * head_dim, int(intermediate), vocab,
                           int(top_k) if experts else 1, int(experts))


def _dtype_of(config: Any) -> Optional[torch.dtype]:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def from_hf_config(path: os.PathLike | str) -> ModelSpec:
    """The model a HF config.json describes (a file, or a directory holding config.json)."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--model: no config file at {path}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--model: {path} is not a readable JSON config: {error}") from error
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ValueError(f"--model: {path} has no 'model_type' string: it is not a HF "
                         "model config")
    try:
        import transformers
    except ImportError as error:
        raise ValueError("--model needs transformers to build the model's shapes "
                         "(pip install 'pagedoptim[hf]'); or plan with --params or --shapes") \
            from error
    model_type = raw["model_type"]
    try:
        config_class = transformers.AutoConfig.for_model(model_type).__class__
    except (ValueError, KeyError) as error:
        raise ValueError(f"--model: {path} has model_type {model_type!r}, which this "
                         f"transformers ({transformers.__version__}) does not know") from error
    try:
        config = config_class.from_dict(dict(raw))
    except (TypeError, ValueError) as error:
        raise ValueError(f"--model: {path} is not a valid {model_type} config: {error}") \
            from error
    dims = _dims(config, raw, path)
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as error:
        raise ValueError(f"--model: transformers cannot build a causal LM from {path}: "
                         f"{error}") from error
    return from_module(model, f"{model_type} from {path}", dims=dims, dtype=_dtype_of(config))


def from_module(model: torch.nn.Module, description: str, *,
                dims: Optional[TransformerDims] = None,
                dtype: Optional[torch.dtype] = None) -> ModelSpec:
    """A live (or meta) module's params, each shared (tied) param once, in the order
    `model.parameters()` yields them, and its linear layers."""
    params = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    linear = [LinearLayer(name, module.in_features, module.out_features)
              for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    return ModelSpec(description, params, dtype, linear, dims)
