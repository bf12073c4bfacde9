"""pagedoptim's optimizers in HF transformers' Trainer, chosen by name.

transformers 5 has no registry for optimizer names: TrainingArguments.__post_init__ turns
`optim` into its OptimizerNames enum (any other name raises), and Trainer looks the name up
in a private table. Its supported extension points are Trainer(optimizers=...),
Trainer(optimizer_cls_and_kwargs=...) and overriding Trainer.get_optimizer_cls_and_kwargs /
create_optimizer in a subclass. Both routes here use them:

    # Plain Trainer: the name and optim_args resolved up front.
    args = TrainingArguments(..., max_grad_norm=1.0)
    trainer = Trainer(model, args, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs_from(
        "pagedoptim_adamw", "state_bits=8,offload=host,cache_bytes=1GiB", args=args,
        model=model))

    # By name in TrainingArguments (and so on the command line: --optim pagedoptim_adamw).
    args = PagedOptimTrainingArguments(..., optim="pagedoptim_adamw",
                                       optim_args="state_bits=8,offload=host")
    trainer = PagedOptimTrainer(model, args, ...)

The names are prefixed with pagedoptim_ because transformers' paged_adamw_8bit, lion_8bit,
... already mean bitsandbytes. From TrainingArguments, every optimizer takes learning_rate;
AdamW and SkewAdam take adam_beta1 / adam_beta2, and AdamW adam_epsilon (SkewAdam's eps is
added to g^2 and means something else; Lion keeps its own betas); weight decay comes, as for
every Trainer optimizer, from the Trainer's parameter groups. optim_args overrides any of them
(pagedoptim.integrations.optim_args lists the keys).

SkewAdam needs the model so that Trainer's unnamed parameters get their tiers from
named_parameters() (SkewAdam's names_from=). release_grads=True keeps each gradient in a
gradient stream from backward to the step: Trainer's clip_grad_norm_ (through accelerate) and
its gradient accumulation work on them unchanged (pagedoptim/optim/gradient_release.py). Under
several processes accelerate wraps the model in DDP after the optimizer is built, where
release needs `optimizer.register_ddp(model)` first, so release is refused there rather than
train differently without a word.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from transformers import Trainer, TrainingArguments
from transformers.training_args import OptimizerNames

from pagedoptim import optim
from pagedoptim.integrations.optim_args import parse_optim_args
from pagedoptim.optim.optimizer import PagedOptimizer

OPTIMIZERS: dict[str, type[PagedOptimizer]] = {
    "pagedoptim_adamw": optim.AdamW,
    "pagedoptim_lion": optim.Lion,
    "pagedoptim_sgd": optim.SGD,
    "pagedoptim_skewadam": optim.SkewAdam,
}

_TRANSFORMERS_NAMES = [name.value for name in OptimizerNames]

# Which of TrainingArguments' Adam settings each optimizer takes (see the module docstring).
_TAKES_ADAM_BETAS = (optim.AdamW, optim.SkewAdam)
_TAKES_ADAM_EPSILON = (optim.AdamW,)


def optimizer_cls_and_kwargs_from(
    name: str,
    optim_args: Optional[str] = None,
    *,
    args: Optional[TrainingArguments] = None,
    model: Optional[torch.nn.Module] = None,
) -> tuple[type[PagedOptimizer], dict[str, Any]]:
    """(optimizer class, keyword arguments) for Trainer(optimizer_cls_and_kwargs=...).

    name: one of OPTIMIZERS. optim_args: "key=value,..." with the optimizer's keyword
    arguments. args: the Trainer's TrainingArguments, for the learning rate and Adam
    settings, and to refuse release_grads under several processes (without args that check is
    left to the caller). model: required by
    pagedoptim_skewadam, whose tiers come from the parameter names.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"Invalid optimizer name: {name!r} (expected one of "
                         f"{list(OPTIMIZERS)})")
    optimizer_cls = OPTIMIZERS[name]
    base = _kwargs_from_training_args(optimizer_cls, args) if args is not None else {}
    kwargs = parse_optim_args(optim_args, optimizer_cls, base)
    if optimizer_cls is optim.SkewAdam:
        if model is None:
            raise ValueError(f"{name} needs model=: Trainer passes its parameters without "
                             "names, and SkewAdam's tiers come from "
                             "model.named_parameters()")
        kwargs["names_from"] = model
    if args is not None:
        check_release_grads_fits(args, kwargs.get("release_grads", False))
    return optimizer_cls, kwargs


def _kwargs_from_training_args(optimizer_cls: type, args: TrainingArguments) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"lr": args.learning_rate}
    if optimizer_cls in _TAKES_ADAM_BETAS:
        kwargs["betas"] = (args.adam_beta1, args.adam_beta2)
    if optimizer_cls in _TAKES_ADAM_EPSILON:
        kwargs["eps"] = args.adam_epsilon
    return kwargs


def check_release_grads_fits(args: TrainingArguments, release_grads: bool) -> None:
    """Raise if release_grads=True would silently change what this Trainer trains: under
    several processes accelerate wraps the model in DDP after the optimizer is built, and the
    released gradients would be taken before the all-reduce (release under DDP needs
    optimizer.register_ddp(model), which Trainer never calls). Clipping (max_grad_norm) and
    gradient_accumulation_steps work with release."""
    if release_grads and args.world_size > 1:
        raise ValueError(f"release_grads=True cannot be used with {args.world_size} processes "
                         "under Trainer: accelerate wraps the model in DDP after the optimizer "
                         "is built, and release takes the gradients after DDP's all-reduce "
                         "only where optimizer.register_ddp(model) was called (a plain DDP "
                         "loop, docs/drop_in.md). Use release_grads=False")


@dataclasses.dataclass
class PagedOptimTrainingArguments(TrainingArguments):
    """TrainingArguments whose `optim` also accepts pagedoptim's names (OPTIMIZERS), with
    optim_args for their keyword arguments; use it with PagedOptimTrainer. Every other
    name means what it means in TrainingArguments."""

    # A plain str, so that HfArgumentParser offers no enum choices and --optim
    # pagedoptim_adamw parses; __post_init__ checks every name.
    optim: str = dataclasses.field(
        default=TrainingArguments.__dataclass_fields__["optim"].default,
        metadata={"help": f"The optimizer to use: one of pagedoptim's {list(OPTIMIZERS)}, "
                          "with optim_args for their keyword arguments, or one of "
                          "transformers' OptimizerNames."})

    def __post_init__(self) -> None:
        name = self.optim
        if name not in OPTIMIZERS:
            if name not in _TRANSFORMERS_NAMES:
                raise ValueError(f"Invalid optim: {name!r} (expected one of pagedoptim's "
                                 f"{list(OPTIMIZERS)} or transformers' {_TRANSFORMERS_NAMES})")
            super().__post_init__()
            return
        # TrainingArguments turns `optim` into its enum, which has no room for our names:
        # let it check a name it knows, then put ours back (a plain str, as the field's
        # type allows).
        self.optim = "adamw_torch"
        try:
            super().__post_init__()
        finally:
            self.optim = name
        # A bad optim_args or a release_grads that Trainer would defeat is reported now,
        # not when training starts.
        kwargs = parse_optim_args(self.optim_args, OPTIMIZERS[name])
        check_release_grads_fits(self, kwargs.get("release_grads", False))


class PagedOptimTrainer(Trainer):
    """Trainer that builds pagedoptim's optimizers from their names in `args.optim`
    (PagedOptimTrainingArguments), and refuses release_grads=True under several processes,
    whichever route built the optimizer (check_release_grads_fits)."""

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: TrainingArguments,
                                     model: Optional[torch.nn.Module] = None
                                     ) -> tuple[Any, dict[str, Any]]:
        if args.optim in OPTIMIZERS:
            return optimizer_cls_and_kwargs_from(args.optim, args.optim_args, args=args,
                                                 model=model)
        return Trainer.get_optimizer_cls_and_kwargs(args, model)

    def create_optimizer(self, model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        # Also covers optimizers=(po.AdamW(..., release_grads=True), None) and
        # optimizer_cls_and_kwargs=, which never pass through the name route.
        if isinstance(optimizer, PagedOptimizer):
            check_release_grads_fits(self.args, optimizer.release_grads)
        return optimizer
