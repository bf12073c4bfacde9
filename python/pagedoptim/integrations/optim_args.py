"""Parse a "key=value,key=value" string (TrainingArguments.optim_args) into keyword arguments
of a pagedoptim optimizer.

Accepted keys are the optimizer's own keyword arguments that a string can express, plus
beta1 / beta2 for its betas. Values:

  floats    lr, eps, weight_decay, momentum, dampening, beta1, beta2
  ints      state_bits, min_8bit_size, prefetch; master_bits also takes none
  bools     amsgrad, maximize, nesterov, release_grads: true/false, 1/0, yes/no, on/off
  sizes     cache_bytes (also none), page_bytes: bytes, with an optional unit
            B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000)
  strings   offload (none, host, nvme), nvme_dir, policy

The optimizer validates the values themselves (state_bits=4 raises there, naming
state_bits); this module only turns text into Python values, and every error names the key.
tiers (SkewAdam's name patterns) is a mapping and has no string form: pass it through
optimizer_cls_and_kwargs instead.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional

from pagedoptim.paging.setting_text import (optional, parse_bool, parse_byte_size, parse_float,
                                     parse_int)

_PARSERS: dict[str, Callable[[str], Any]] = {
    "lr": parse_float, "eps": parse_float, "weight_decay": parse_float,
    "momentum": parse_float, "dampening": parse_float,
    "beta1": parse_float, "beta2": parse_float,
    "amsgrad": parse_bool, "maximize": parse_bool, "nesterov": parse_bool,
    "release_grads": parse_bool,
    "state_bits": parse_int, "master_bits": optional(parse_int), "prefetch": parse_int,
    "min_8bit_size": parse_int,
    "cache_bytes": optional(parse_byte_size), "page_bytes": parse_byte_size,
    "offload": optional(str), "nvme_dir": str, "policy": str,
}


def accepted_keys(optimizer_cls: type) -> list[str]:
    """The optim_args keys `optimizer_cls` takes, in its signature's order."""
    keys = []
    for name in inspect.signature(optimizer_cls.__init__).parameters:
        if name == "betas":
            keys += ["beta1", "beta2"]
        elif name in _PARSERS:
            keys.append(name)
    return keys


def parse_optim_args(text: Optional[str], optimizer_cls: type,
                     base: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """`base` (keyword arguments taken elsewhere, e.g. from TrainingArguments) updated with
    the keyword arguments `text` sets for `optimizer_cls`. beta1 / beta2 replace one
    element of base['betas'] or, without it, of the optimizer's default betas."""
    kwargs = dict(base or {})
    if text is None:
        return kwargs
    if not isinstance(text, str):
        raise TypeError(f"optim_args must be a string like 'state_bits=8,offload=host', "
                        f"got {type(text).__name__}")
    if not text.strip():
        return kwargs
    accepted = accepted_keys(optimizer_cls)
    given: dict[str, Any] = {}
    for entry in text.split(","):
        key, equals, value = (part.strip() for part in entry.partition("="))
        if not equals or not key or not value:
            raise ValueError(f"Invalid optim_args entry {entry.strip()!r} in {text!r} "
                             "(expected key=value pairs separated by commas)")
        if key not in accepted:
            raise ValueError(f"Invalid optim_args key {key!r}: {optimizer_cls.__name__} takes "
                             f"{accepted}")
        if key in given:
            raise ValueError(f"optim_args sets {key!r} twice in {text!r}")
        try:
            given[key] = _PARSERS[key](value)
        except ValueError as error:
            raise ValueError(f"Invalid optim_args value for {key!r}: {value!r} ({error})") from None
    if "beta1" in given or "beta2" in given:
        betas = kwargs.get("betas",
                           inspect.signature(optimizer_cls.__init__).parameters["betas"].default)
        kwargs["betas"] = (given.pop("beta1", betas[0]), given.pop("beta2", betas[1]))
    kwargs.update(given)
    return kwargs
