"""Hyperparameters are read from param_groups on every step: LR schedulers (float and 0-dim
tensor lr), OneCycleLR's cycled betas / momentum, hand edits of a group mid-run, and lr=0.

Comparisons use the error measure and FP32_TOL of support.py."""

import pytest
import torch
from torch.optim import lr_scheduler

from support import (FP32_TOL, OURS, REFERENCE, SMALL_SHAPES, Grads, clone_params,
                      make_params, run_lockstep, set_grads)

STEPS = 60

SCHEDULERS = {
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, lambda t: 0.97 ** t),
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS,
                                                      cycle_momentum=True),
    "CosineAnnealingLR": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS // 3,
                                                                    eta_min=1e-5),
}

HYPER = {
    "AdamW": {"lr": 1e-3, "weight_decay": 0.1},
    "SGD": {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-2},
    "Lion": {"lr": 1e-4, "weight_decay": 0.1},
}


def lr_value(lr, as_tensor):
    return torch.tensor(lr) if as_tensor else lr


def run_scheduled(name, sched_name, lr_as_tensor):
    params = make_params(SMALL_SHAPES, seed=2)
    ref_params = clone_params(params)
    hyper = dict(HYPER[name])
    lr = hyper.pop("lr")
    opt = OURS[name](params, lr=lr_value(lr, lr_as_tensor), **hyper)
    ref = REFERENCE[name](ref_params, lr=lr_value(lr, lr_as_tensor), **hyper)
    sched, ref_sched = SCHEDULERS[sched_name](opt), SCHEDULERS[sched_name](ref)
    grads = Grads(SMALL_SHAPES, STEPS, seed=17)
    seen = []

    def before_step(t, ours, reference):
        if t > 0:
            sched.step()
            ref_sched.step()
        g, rg = ours.param_groups[0], reference.param_groups[0]
        assert float(g["lr"]) == float(rg["lr"])
        if name == "SGD":
            assert g["momentum"] == rg["momentum"]
            seen.append((float(g["lr"]), g["momentum"]))
        else:
            assert tuple(g["betas"]) == tuple(rg["betas"])
            seen.append((float(g["lr"]), tuple(g["betas"])))

    run_lockstep(opt, params, ref, ref_params, grads, before_step=before_step,
                 label=f"{name} under {sched_name} (lr tensor={lr_as_tensor})")
    if lr_as_tensor:
        assert torch.is_tensor(opt.param_groups[0]["lr"])
    return seen


@pytest.mark.parametrize("lr_as_tensor", [False, True], ids=["lr_float", "lr_tensor"])
@pytest.mark.parametrize("sched_name", list(SCHEDULERS))
def test_adamw_follows_torch_under_scheduler(sched_name, lr_as_tensor):
    seen = run_scheduled("AdamW", sched_name, lr_as_tensor)
    assert len({lr for lr, _ in seen}) > STEPS // 2, "the scheduler did not vary lr"
    if sched_name == "OneCycleLR":
        assert len({betas[0] for _, betas in seen}) > STEPS // 2, "betas were not cycled"


@pytest.mark.parametrize("name,sched_name", [("SGD", "OneCycleLR"), ("SGD", "LambdaLR"),
                                             ("Lion", "OneCycleLR"),
                                             ("Lion", "CosineAnnealingLR")])
def test_sgd_and_lion_follow_reference_under_scheduler(name, sched_name):
    seen = run_scheduled(name, sched_name, lr_as_tensor=False)
    assert len({lr for lr, _ in seen}) > STEPS // 2
    if sched_name == "OneCycleLR":
        assert len({m for _, m in seen}) > STEPS // 2, "momentum / betas were not cycled"


# Hand edits of a group between steps: (step index before which it happens, key, new value).
EDITS = {
    "AdamW": [(5, "lr", 1e-2), (10, "weight_decay", 0.5), (15, "betas", (0.5, 0.9)),
              (20, "eps", 1e-1), (25, "lr", 1e-4)],
    "SGD": [(5, "lr", 1e-1), (10, "weight_decay", 0.5), (15, "momentum", 0.5),
            (20, "dampening", 0.5), (25, "lr", 1e-3)],
    "Lion": [(5, "lr", 1e-3), (10, "weight_decay", 1.0), (15, "betas", (0.5, 0.9)),
             (25, "lr", 1e-5)],
}


@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion"])
@pytest.mark.parametrize("lr_as_tensor", [False, True], ids=["lr_float", "lr_tensor"])
def test_group_edits_take_effect_next_step(name, lr_as_tensor):
    steps = 30
    params = make_params(SMALL_SHAPES, seed=4)
    ref_params = clone_params(params)
    unedited_params = clone_params(params)
    hyper = dict(HYPER[name])
    lr = hyper.pop("lr")
    opt = OURS[name](params, lr=lr_value(lr, lr_as_tensor), **hyper)
    ref = REFERENCE[name](ref_params, lr=lr_value(lr, lr_as_tensor), **hyper)
    unedited = REFERENCE[name](unedited_params, lr=lr_value(lr, lr_as_tensor), **hyper)
    edits = EDITS[name]
    grads = Grads(SMALL_SHAPES, steps, seed=19)

    def before_step(t, ours, reference):
        for at, key, value in edits:
            if at == t:
                for o in (ours, reference):
                    group = o.param_groups[0]
                    if key == "lr" and torch.is_tensor(group["lr"]):
                        group["lr"].fill_(value)
                    else:
                        group[key] = value
        set_grads(unedited_params, grads[t])
        unedited.step()

    run_lockstep(opt, params, ref, ref_params, grads, before_step=before_step,
                 label=f"{name} with group edits")
    # The edits must matter far beyond the tolerance, or this test could not catch them.
    moved = max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
                for a, b in zip(ref_params, unedited_params))
    assert moved > 1e3 * FP32_TOL


@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion"])
@pytest.mark.parametrize("grads_kind", ["zero_grads", "random_grads"])
@pytest.mark.parametrize("lr_as_tensor", [False, True], ids=["lr_float", "lr_tensor"])
def test_lr_zero_leaves_params_bit_identical(name, grads_kind, lr_as_tensor):
    """lr = 0 (weight decay on) must not move a single bit, over many steps."""
    hyper = {"AdamW": {"weight_decay": 0.1, "amsgrad": True},
             "SGD": {"momentum": 0.9, "weight_decay": 0.1, "nesterov": True},
             "Lion": {"weight_decay": 0.1}}[name]
    params = make_params(SMALL_SHAPES, seed=6)
    before = [p.detach().clone() for p in params]
    opt = OURS[name](params, lr=lr_value(0.0, lr_as_tensor), **hyper)
    grads = Grads(SMALL_SHAPES, 50, seed=29)
    for t in range(50):
        if grads_kind == "zero_grads":
            for p in params:
                p.grad = torch.zeros_like(p)
        else:
            set_grads(params, grads[t])
        opt.step()
    assert all(p in opt.state for p in params), "a step with zero grads still creates state"
    for i, (p, b) in enumerate(zip(params, before)):
        assert torch.equal(p.detach(), b), f"param {i} {tuple(b.shape)} moved with lr=0"


@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion"])
def test_lr_change_between_groups_is_per_group(name):
    """A scheduler or a hand edit that touches one group leaves the other group alone."""
    params = make_params(SMALL_SHAPES, seed=8)
    ref_params = clone_params(params)
    hyper = dict(HYPER[name])

    def groups(ps):
        return [{"params": ps[:3]}, {"params": ps[3:]}]

    opt = OURS[name](groups(params), **hyper)
    ref = REFERENCE[name](groups(ref_params), **hyper)

    def before_step(t, ours, reference):
        if t == 3:
            for o in (ours, reference):
                o.param_groups[1]["lr"] = 0.0
                o.param_groups[0]["lr"] = hyper["lr"] * 10

    run_lockstep(opt, params, ref, ref_params, Grads(SMALL_SHAPES, 10, seed=31),
                 before_step=before_step, label=f"{name} per-group lr edits")
