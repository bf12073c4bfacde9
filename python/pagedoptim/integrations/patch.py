"""pagedoptim.patch() / unpatch(): torch.optim's optimizer names resolve to ours.

    PAGEDOPTIM=1 python train.py        # the startup hook calls patch_from_environment()
    pagedoptim.patch(state_bits=32)     # the same from code

Only the names in torch.optim are replaced (torch.optim.AdamW, and so
`from torch.optim import AdamW` after the patch); torch's own modules keep their references
(torch.optim.adamw.AdamW is still torch's class). See pagedoptim.integrations.stand_ins for what the
replacements accept.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from pagedoptim.integrations import stand_ins

from pagedoptim.paging import env_settings, kwargs as paging_kwargs

# algorithm -> (torch.optim name -> the stand-in that replaces it). Lion has no torch name;
# SkewAdam, the Mixture-of-Experts Adam, takes Adam's names when asked for.
STAND_INS_BY_ALGORITHM: dict[str, dict[str, type]] = {
    "adamw": {"AdamW": stand_ins.AdamW, "Adam": stand_ins.Adam, "SGD": stand_ins.SGD},
    "skewadam": {"AdamW": stand_ins.SkewAdamW, "Adam": stand_ins.SkewAdamAsAdam,
                 "SGD": stand_ins.SGD},
}
STAND_INS = STAND_INS_BY_ALGORITHM["adamw"]

# torch.optim's own classes, captured when this module is first imported: the patch never
# runs before that, so they are torch's even if patch() was called since.
_TORCH_CLASSES: dict[str, type] = {name: getattr(torch.optim, name) for name in STAND_INS}
_patched = False


def torch_class(name: str) -> type:
    """torch.optim's own class for `name` ('AdamW', 'Adam', 'SGD'), patched or not."""
    return _TORCH_CLASSES[name]


def is_patched() -> bool:
    return _patched


def patch(algorithm: Optional[str] = None, **overrides: Any) -> None:
    """Makes torch.optim.AdamW, Adam and SGD build pagedoptim optimizers.

    algorithm: what Adam's names build, "adamw" (the default) or "skewadam" (tiers from the
    names in the model owning the params); None: PAGEDOPTIM_ALGORITHM, else "adamw".
    `overrides` are paging keyword arguments (state_bits=..., offload=..., ...); they win
    over the PAGEDOPTIM_* environment variables, which win over the optimizers' defaults.
    Calling it again replaces the settings; unpatch() restores torch's classes.
    """
    global _patched
    from_environment = env_settings.settings_from_environment()
    if algorithm is None:
        algorithm = env_settings.algorithm_from_environment()
    if algorithm not in STAND_INS_BY_ALGORITHM:
        raise ValueError(f"Invalid algorithm: {algorithm!r} (expected one of "
                         f"{sorted(STAND_INS_BY_ALGORITHM)})")
    paging_kwargs.check_names(overrides, "pagedoptim.patch()")
    env_settings.check_together(from_environment, overrides)
    stand_ins.use_paging_settings({**from_environment, **overrides})
    for name, stand_in in STAND_INS_BY_ALGORITHM[algorithm].items():
        setattr(torch.optim, name, stand_in)
    _patched = True


def unpatch() -> None:
    """Restores torch.optim's own classes (a no-op when not patched). Optimizers built while
    patched stay pagedoptim optimizers."""
    global _patched
    for name, torch_cls in _TORCH_CLASSES.items():
        setattr(torch.optim, name, torch_cls)
    stand_ins.use_paging_settings({})
    _patched = False


_announced = False


def patch_from_environment() -> bool:
    """patch() if PAGEDOPTIM asks for it, and says so once per process on stderr (the flag
    is otherwise invisible: the patched classes keep torch's names); returns whether it
    patched."""
    global _announced
    if not env_settings.flag_enabled():
        return False
    patch()
    if not _announced:
        _announced = True
        sys.stderr.write(announcement() + "\n")
        sys.stderr.flush()
    return True


def announcement() -> str:
    """What PAGEDOPTIM=1 did, in one line: which torch.optim names build what, with which
    settings."""
    algorithm = env_settings.algorithm_from_environment()
    built = ", ".join(f"torch.optim.{name} -> pagedoptim {stand_in.__name__}"
                      for name, stand_in in STAND_INS_BY_ALGORITHM[algorithm].items())
    settings = paging_kwargs.with_defaults(env_settings.settings_from_environment())
    shown = ", ".join(f"{k}={v!r}" for k, v in settings.items())
    return (f"pagedoptim: {env_settings.FLAG}=1 is on in this process: {built}; with {shown} "
            "(repr(optimizer) and optimizer.settings show them)")
