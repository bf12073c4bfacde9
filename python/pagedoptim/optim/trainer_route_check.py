"""Warns when transformers' Trainer builds one of our optimizers at another learning rate than
its TrainingArguments say.

`Trainer(model, args, optimizer_cls_and_kwargs=(po.AdamW, {...}))` calls
`po.AdamW(groups, **kwargs)` with those kwargs alone: none of TrainingArguments' optimizer
settings reach the optimizer, so a user who set `learning_rate=5e-5` and left `lr` out of the
kwargs trains at our default of 1e-3 (torch's optimizers fare the same, silently). The
optimizer cannot see the arguments, but it can see who built it: when the first frame
outside the optimizers' constructors belongs to transformers and holds a Trainer (`self`
with `args.learning_rate`), the lrs are compared. Routes 3 and 4 of the README pass the
learning rate themselves and so never warn.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any


def _builder_frame(optimizer: Any) -> Any:
    """The frame that called the optimizer's class, past every __init__ of `optimizer`."""
    frame = sys._getframe(2)  # past this module and PagedOptimizer.__init__
    while frame is not None and frame.f_code.co_name == "__init__" \
            and frame.f_locals.get("self") is optimizer:
        frame = frame.f_back
    return frame


def warn_if_trainer_learning_rate_unused(optimizer: Any) -> None:
    frame = _builder_frame(optimizer)
    if frame is None or not frame.f_globals.get("__name__", "").startswith("transformers."):
        return
    learning_rate = getattr(getattr(frame.f_locals.get("self"), "args", None), "learning_rate",
                            None)
    if not isinstance(learning_rate, (int, float)):
        return
    lrs = sorted({float(group["lr"]) for group in optimizer.param_groups})
    if lrs == [float(learning_rate)]:
        return
    name = type(optimizer).__name__
    warnings.warn(
        f"transformers' Trainer built po.{name} with lr={', '.join(map(str, lrs))}, but "
        f"TrainingArguments.learning_rate is {learning_rate}: with optimizer_cls_and_kwargs "
        "Trainer passes the given kwargs alone, none of TrainingArguments' optimizer "
        "settings, so training runs at the lr above. Put 'lr': args.learning_rate in the "
        "kwargs, or use optimizer_cls_and_kwargs_from(...) or PagedOptimTrainingArguments "
        "(README, routes 3 and 4), which pass it.", UserWarning, stacklevel=3)
