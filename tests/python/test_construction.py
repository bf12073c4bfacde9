"""Construction of pagedoptim's optimizers: accepted parameter forms, parameter groups,
rejected inputs, keyword arguments that are not implemented yet, bad hyperparameters."""

import math

import pytest
import torch
from torch import nn

import pagedoptim as po
from support import (OURS, REFERENCE, Grads, TinyModel, clone_params, make_params,
                      run_lockstep, set_grads)

ALL = ["AdamW", "SGD", "Lion"]
STEP_HYPER = {"AdamW": {"lr": 1e-2}, "SGD": {"lr": 1e-2, "momentum": 0.9}, "Lion": {"lr": 1e-3}}

# Hyperparameters every optimizer class stores in its groups (torch's names).
GROUP_KEYS = {
    "AdamW": {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"},
    "SGD": {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"},
    "Lion": {"lr", "betas", "weight_decay", "maximize"},
}


def one_param():
    return nn.Parameter(torch.randn(4, 3))


@pytest.mark.parametrize("name", ALL)
def test_is_a_torch_optimizer_with_torch_defaults(name):
    opt = OURS[name]([one_param()])
    assert isinstance(opt, torch.optim.Optimizer)
    ref = REFERENCE[name]([one_param()])
    group = opt.param_groups[0]
    for key in GROUP_KEYS[name]:
        assert key in opt.defaults, f"{name}.defaults lacks {key!r}"
        assert key in group, f"{name} param group lacks {key!r}"
        if key in ref.defaults:
            assert group[key] == ref.defaults[key], (
                f"{name} default {key}={group[key]!r}, torch/reference has {ref.defaults[key]!r}")


def test_adamw_positional_signature():
    p = one_param()
    opt = po.AdamW([p], 0.01, (0.8, 0.9), 1e-6, 0.1, True, True)
    g = opt.param_groups[0]
    got = (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"], g["amsgrad"], g["maximize"])
    assert got == (0.01, (0.8, 0.9), 1e-6, 0.1, True, True)


def test_sgd_positional_signature():
    opt = po.SGD([one_param()], 0.5, 0.9, 0.0, 0.1, True, True)
    g = opt.param_groups[0]
    got = (g["lr"], g["momentum"], g["dampening"], g["weight_decay"], g["nesterov"],
           g["maximize"])
    assert got == (0.5, 0.9, 0.0, 0.1, True, True)


def test_lion_positional_signature():
    opt = po.Lion([one_param()], 3e-4, (0.95, 0.98), 0.1, True)
    g = opt.param_groups[0]
    got = (g["lr"], tuple(g["betas"]), g["weight_decay"], g["maximize"])
    assert got == (3e-4, (0.95, 0.98), 0.1, True)


PAGING_KWARGS = ["state_bits", "master_bits", "offload", "nvme_dir", "cache_bytes", "page_bytes",
                 "prefetch", "policy", "release_grads"]


@pytest.mark.parametrize("cls", [po.AdamW, po.SGD, po.Lion, po.SkewAdam],
                         ids=lambda cls: cls.__name__)
def test_paging_kwargs_are_keyword_only(cls):
    """Positional arguments stop where torch's do (at maximize; SkewAdam at weight_decay):
    one more positional is a TypeError, and every paging keyword is keyword-only, so a
    torch-style positional call can never land in state_bits. The class itself, not a
    functools.partial that already passes state_bits by keyword."""
    import inspect
    parameters = inspect.signature(cls).parameters
    for name in PAGING_KWARGS:
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    positional = [p for p in parameters.values()
                  if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    defaults = [p.default for p in positional[1:]]  # all but params
    with pytest.raises(TypeError, match="positional argument"):
        cls([one_param()], *defaults, 32)


# --- parameter forms ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_params_as_list_and_generator(name):
    model = TinyModel()
    from_list = OURS[name](list(model.parameters()))
    from_gen = OURS[name](model.parameters())
    for opt in (from_list, from_gen):
        assert len(opt.param_groups) == 1
        got = opt.param_groups[0]["params"]
        assert len(got) == len(list(model.parameters()))
        assert all(a is b for a, b in zip(got, model.parameters()))


@pytest.mark.parametrize("name", ALL)
def test_param_groups_as_dicts_keep_their_own_hyperparameters(name):
    model = TinyModel()
    opt = OURS[name]([
        {"params": model.fc1.parameters(), "lr": 0.5, "weight_decay": 0.25},
        {"params": [model.fc2.weight, model.fc2.bias, model.scale]},
    ], lr=0.125)
    g0, g1 = opt.param_groups
    assert (g0["lr"], g0["weight_decay"]) == (0.5, 0.25)
    assert g1["lr"] == 0.125
    assert g1["weight_decay"] == opt.defaults["weight_decay"]
    for key in GROUP_KEYS[name]:
        assert key in g0 and key in g1


@pytest.mark.parametrize("name", ALL)
def test_named_parameters_give_param_names(name):
    model = TinyModel()
    names = [n for n, _ in model.named_parameters()]
    opt = OURS[name](model.named_parameters())
    group = opt.param_groups[0]
    assert group["param_names"] == names
    assert all(p is q for p, q in zip(group["params"], model.parameters()))
    assert all(torch.is_tensor(p) for p in group["params"])
    assert opt.state_dict()["param_groups"][0]["param_names"] == names


def test_named_parameters_step_like_torch():
    model, ref_model = TinyModel(), TinyModel()
    opt = OURS["AdamW"](model.named_parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_model.named_parameters(), lr=1e-2)
    params, ref_params = list(model.parameters()), list(ref_model.parameters())
    grads = Grads([p.shape for p in params], steps=5)
    run_lockstep(opt, params, ref, ref_params, grads, label="named params")


@pytest.mark.parametrize("name", ALL)
def test_empty_group_is_allowed(name):
    params = make_params([(6,), (2, 3)])
    ref_params = clone_params(params)
    hyper = STEP_HYPER[name]
    opt = OURS[name]([{"params": [], "lr": 0.5}, {"params": params}], **hyper)
    ref = REFERENCE[name]([{"params": [], "lr": 0.5}, {"params": ref_params}], **hyper)
    assert len(opt.param_groups) == 2 and opt.param_groups[0]["params"] == []
    run_lockstep(opt, params, ref, ref_params, Grads([p.shape for p in params], steps=5),
                 label=f"{name} with an empty group")
    sd = opt.state_dict()
    assert sd["param_groups"][0]["params"] == []
    assert sd["param_groups"][1]["params"] == [0, 1]


@pytest.mark.parametrize("name", ALL)
def test_add_param_group_after_steps(name):
    """A group added after 3 steps gets the defaults, its own lr, and steps from then on
    exactly like the same sequence on the reference optimizer."""
    first, second = make_params([(9,), (4, 5)], seed=1), make_params([(33,), ()], seed=2)
    ref_first, ref_second = clone_params(first), clone_params(second)
    hyper = STEP_HYPER[name]
    opt = OURS[name](first, **hyper)
    ref = REFERENCE[name](ref_first, **hyper)
    grads = Grads([p.shape for p in first + second], steps=8)
    for t in range(3):
        set_grads(first, grads[t][:2])
        set_grads(ref_first, grads[t][:2])
        opt.step()
        ref.step()
    opt.add_param_group({"params": second, "lr": 0.05})
    ref.add_param_group({"params": ref_second, "lr": 0.05})
    new = opt.param_groups[1]
    assert new["lr"] == 0.05
    for key in GROUP_KEYS[name] - {"lr"}:
        assert new[key] == opt.defaults[key], f"added group did not get default {key!r}"
    assert all(p not in opt.state for p in second), "state before the group's first step"

    class Offset:
        def __getitem__(self, t):
            return grads[t + 3]

        def __len__(self):
            return 5

    run_lockstep(opt, first + second, ref, ref_first + ref_second, Offset(),
                 label=f"{name} after add_param_group")


@pytest.mark.parametrize("name", ALL)
def test_add_param_group_rejects_a_param_already_present(name):
    params = make_params([(3,), (4,)])
    opt = OURS[name]([params[0]])
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [params[0], params[1]]})


# --- rejected inputs ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("where", ["top_level", "in_group"])
def test_params_as_set_is_a_type_error(name, where):
    params = set(make_params([(3,), (4,)]))
    with pytest.raises(TypeError):
        OURS[name](params if where == "top_level" else [{"params": params}])


@pytest.mark.parametrize("name", ALL)
def test_non_leaf_tensor_is_rejected(name):
    leaf = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="can't optimize a non-leaf Tensor"):
        OURS[name]([leaf * 2])


@pytest.mark.parametrize("name", ALL)
def test_param_in_two_groups_is_rejected_as_torch_does(name):
    p, q = make_params([(3,), (5,)])
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        OURS[name]([{"params": [p, q]}, {"params": [p]}])


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("layout", ["same_group", "across_groups"])
def test_params_on_different_devices_are_rejected(name, layout):
    cpu = one_param()
    meta = nn.Parameter(torch.empty(4, 3, device="meta"))
    groups = [cpu, meta] if layout == "same_group" else [{"params": [cpu]}, {"params": [meta]}]
    with pytest.raises(ValueError) as info:
        OURS[name](groups)
    msg = str(info.value)
    assert "cpu" in msg and "meta" in msg, msg


@pytest.mark.parametrize("name", ["AdamW", "Lion"])  # SGD takes them, as torch's does
def test_sparse_grad_fails_at_step(name):
    p = one_param()
    before = p.detach().clone()
    opt = OURS[name]([p], lr=0.1)
    p.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="(?i)sparse"):
        opt.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("kwargs", [
    {"nesterov": True},
    {"nesterov": True, "momentum": 0.0},
    {"nesterov": True, "momentum": 0.9, "dampening": 0.1},
])
def test_sgd_nesterov_needs_momentum_and_no_dampening(kwargs):
    with pytest.raises(ValueError) as torch_info:
        torch.optim.SGD([one_param()], lr=0.1, **kwargs)
    with pytest.raises(ValueError) as info:
        po.SGD([one_param()], lr=0.1, **kwargs)
    assert "nesterov" in str(info.value).lower(), (str(info.value), str(torch_info.value))


# --- the paging and compression keyword arguments -----------------------------------------
# (their values and errors are tested in test_paging.py and test_compressed_*.py)

@pytest.mark.parametrize("name", ALL)
def test_exact_mode_kwargs_spelled_out_are_accepted(name):
    p = one_param()
    opt = OURS[name]([p], state_bits=32, master_bits=None, offload=None, nvme_dir=None,
                     cache_bytes=None, page_bytes=2 << 20, prefetch=4, policy="auto",
                     release_grads=False)
    p.grad = torch.ones_like(p)
    opt.step()
    assert p in opt.state


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("page_bytes", [4096, 8192, 1 << 16, 2 << 20, 8 << 20])
def test_page_bytes_accepts_multiples_of_4096(name, page_bytes):
    p = one_param()
    opt = OURS[name]([p], page_bytes=page_bytes)
    p.grad = torch.ones_like(p)
    opt.step()
    assert p in opt.state


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("page_bytes", [0, -4096, 1, 1000, 4095, 4097, 6144, 3 << 19 | 1])
def test_page_bytes_rejects_other_values(name, page_bytes):
    with pytest.raises(ValueError) as info:
        OURS[name]([one_param()], page_bytes=page_bytes)
    assert "page_bytes" in str(info.value), str(info.value)


# --- bad hyperparameters ------------------------------------------------------------------

NAN = math.nan
BAD_HYPERPARAMETERS = [
    ("AdamW", "lr", {"lr": -1e-3}),
    ("AdamW", "lr", {"lr": NAN}),
    ("AdamW", "betas", {"betas": (-0.1, 0.999)}),
    ("AdamW", "betas", {"betas": (0.9, -0.5)}),
    ("AdamW", "betas", {"betas": (NAN, 0.999)}),
    ("AdamW", "betas", {"betas": (0.9, NAN)}),
    ("AdamW", "eps", {"eps": -1e-8}),
    ("AdamW", "eps", {"eps": NAN}),
    ("AdamW", "weight_decay", {"weight_decay": -0.01}),
    ("AdamW", "weight_decay", {"weight_decay": NAN}),
    ("SGD", "lr", {"lr": -0.1}),
    ("SGD", "lr", {"lr": NAN}),
    ("SGD", "momentum", {"momentum": -0.9}),
    ("SGD", "momentum", {"momentum": NAN}),
    ("SGD", "weight_decay", {"weight_decay": -1e-4}),
    ("SGD", "weight_decay", {"weight_decay": NAN}),
    ("Lion", "lr", {"lr": -1e-4}),
    ("Lion", "lr", {"lr": NAN}),
    ("Lion", "betas", {"betas": (-0.9, 0.99)}),
    ("Lion", "betas", {"betas": (0.9, -0.99)}),
    ("Lion", "betas", {"betas": (NAN, 0.99)}),
    ("Lion", "betas", {"betas": (0.9, NAN)}),
    ("Lion", "weight_decay", {"weight_decay": -0.1}),
    ("Lion", "weight_decay", {"weight_decay": NAN}),
]


@pytest.mark.parametrize("name,arg,kwargs", BAD_HYPERPARAMETERS,
                         ids=[f"{n}-{k}" for n, _, k in BAD_HYPERPARAMETERS])
def test_bad_hyperparameter_is_a_value_error_naming_it(name, arg, kwargs):
    with pytest.raises(ValueError) as info:
        OURS[name]([one_param()], **kwargs)
    assert arg in str(info.value), f"message does not name {arg!r}: {info.value}"


@pytest.mark.parametrize("name", ALL)
def test_lr_as_0dim_tensor_is_accepted(name):
    p = one_param()
    lr = torch.tensor(1e-2)
    opt = OURS[name]([p], lr=lr)
    assert torch.is_tensor(opt.param_groups[0]["lr"])
    before = p.detach().clone()
    p.grad = torch.ones_like(p)
    opt.step()
    assert not torch.equal(p.detach(), before)


@pytest.mark.parametrize("name", ALL)
def test_construction_does_not_touch_params(name):
    params = make_params([(5,), (2, 2)])
    before = [p.detach().clone() for p in params]
    OURS[name](params, lr=0.1)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(p.grad is None for p in params)


def test_params_on_two_devices_are_refused_with_what_to_do():
    # "meta" stands in for a second GPU here; tests/python/test_cuda_step.py uses a real one.
    with pytest.raises(ValueError, match=r"params\[1\] is on meta.*one optimizer per device"):
        po.AdamW([nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4, device="meta"))])
