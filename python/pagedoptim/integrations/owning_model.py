"""The model a set of parameters belongs to, found among the live nn.Modules.

SkewAdam puts each parameter in a tier by its name, and code written for torch.optim hands
an optimizer `model.parameters()`: tensors without names. Where nothing else can supply
them (the one-flag switch, which cannot change the script), the names come from the model
that owns the parameters: the outermost module alive in the process whose parameters
include all of them. Exactly what `model.named_parameters()` would have given, with the
prefix of any wrapper (DDP's `module.`, PEFT's `base_model.model.`), which tier patterns
ignore since they search within names.
"""

from __future__ import annotations

import gc
from typing import Iterable, Optional

import torch


def model_owning(params: Iterable[torch.Tensor]) -> Optional[torch.nn.Module]:
    """The outermost live module owning every one of `params`; None when there is none.
    Raises when two unrelated modules own them all (the names would be a guess)."""
    wanted = {id(p) for p in params}
    if not wanted:
        return None
    # type(), not isinstance(): isinstance asks some objects for __class__, which lazy
    # module proxies (torch.distributed.reduce_op) answer with a deprecation warning.
    modules = [obj for obj in gc.get_objects() if issubclass(type(obj), torch.nn.Module)]
    children = {id(child) for module in modules for child in module.children()}
    owners = [module for module in modules if id(module) not in children
              and wanted <= {id(p) for p in module.parameters()}]
    if len(owners) > 1:
        names = ", ".join(sorted(type(owner).__name__ for owner in owners))
        raise ValueError(f"the parameters belong to {len(owners)} separate models ({names}); "
                         "which one names them is ambiguous: pass the model as names_from=")
    return owners[0] if owners else None
