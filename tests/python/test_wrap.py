"""pagedoptim.wrap(): a torch optimizer mid-training becomes ours with its groups,
hyperparameters and state, and continues as the torch optimizer would have (reference: the
same torch optimizer, never wrapped, on the same gradients)."""

import pytest
import torch

import pagedoptim as po
from pagedoptim.state import format as state_format
from support import (EXACT, FP32_TOL, SMALL_SHAPES, Grads, TrajectoryScale,
                     assert_8bit_moment_bytes, assert_params_close, make_params, run_steps,
                     set_grads)

K, N = 4, 10  # wrap after K steps, N steps in all

# Two param groups with different hyperparameters, so that wrap() must keep each group's.
CASES = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, {"lr": 3e-3}),
    "AdamW-amsgrad": (torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True},
                      {"weight_decay": 0.0}),
    "Adam": (torch.optim.Adam, {"lr": 1e-2}, {"betas": (0.8, 0.99)}),
    "Adam-decoupled": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1,
                                          "decoupled_weight_decay": True}, {"lr": 2e-2}),
    "SGD": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-2},
            {"lr": 3e-2}),
    "SGD-nesterov": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True},
                     {"momentum": 0.5}),
}


def build(case, params):
    cls, defaults, second_group = CASES[case]
    half = len(params) // 2
    return cls([{"params": params[:half]}, {"params": params[half:], **second_group}],
               **defaults)


@pytest.mark.parametrize("case", list(CASES))
def test_wrap_mid_training_continues_like_torch(case):
    grads = Grads(SMALL_SHAPES, N, seed=7)
    ref_params = make_params(SMALL_SHAPES, seed=3)
    ref = build(case, ref_params)
    params = make_params(SMALL_SHAPES, seed=3)
    torch_opt = build(case, params)
    run_steps(ref, ref_params, grads, 0, K)
    run_steps(torch_opt, params, grads, 0, K)

    wrapped = po.wrap(torch_opt, **EXACT)

    assert isinstance(wrapped, po.PagedOptimizer)
    assert len(wrapped.param_groups) == len(torch_opt.param_groups)
    for ours, theirs in zip(wrapped.param_groups, torch_opt.param_groups):
        assert all(a is b for a, b in zip(ours["params"], theirs["params"]))
        for key, value in theirs.items():
            if key != "params":
                assert ours[key] == value, f"group key {key}: {ours[key]!r} != {value!r}"
    for p in params:
        if "step" in torch_opt.state[p]:
            assert wrapped.state[p]["step"].item() == torch_opt.state[p]["step"].item()

    scale = TrajectoryScale(ref_params)
    for t in range(K, N):
        set_grads(ref_params, grads[t])
        set_grads(params, grads[t])
        ref.step()
        wrapped.step()
        scale.update(ref_params)
        assert_params_close(params, ref_params, scale, FP32_TOL, f"{case} wrapped, step {t + 1}")


def test_wrap_applies_the_paging_kwargs():
    params = make_params(SMALL_SHAPES)
    torch_opt = torch.optim.AdamW(params, lr=1e-2)
    run_steps(torch_opt, params, Grads(SMALL_SHAPES, 1), 0, 1)
    exact = po.wrap(torch_opt, **EXACT).memory_report()
    compressed = po.wrap(torch_opt, state_bits=8, min_8bit_size=0).memory_report()
    numel = sum(p.numel() for p in params)
    assert exact["moment_bytes"] == 2 * 4 * numel  # fp32 m and v
    # 8-bit codes of m and v; fp32 moments for the 0-dim and 1-D params and the rows of 3
    assert_8bit_moment_bytes(compressed)
    assert compressed["fp32_state_elements"] == sum(
        p.numel() for p in params if not state_format.keeps_8bit_state(p, 0))
    assert compressed["fp32_state_elements"] < numel


def test_wrap_leaves_the_torch_optimizer_as_it_was():
    params = make_params(SMALL_SHAPES)
    torch_opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    run_steps(torch_opt, params, Grads(SMALL_SHAPES, 1), 0, 1)
    before = {k: v.clone() for k, v in torch_opt.state[params[0]].items()}
    po.wrap(torch_opt, **EXACT)
    assert type(torch_opt) is torch.optim.SGD
    for key, value in before.items():
        assert torch.equal(torch_opt.state[params[0]][key], value)


def test_wrap_rejects_unsupported_optimizers_naming_the_supported_ones():
    params = make_params(SMALL_SHAPES)
    with pytest.raises(TypeError) as error:
        po.wrap(torch.optim.RMSprop(params))
    for name in ("AdamW", "Adam", "SGD", "RMSprop"):
        assert name in str(error.value)


def test_wrap_rejects_subclasses_of_torch_optimizers():
    class ClippedAdamW(torch.optim.AdamW):
        pass  # a subclass may change the step: converting it could change training

    with pytest.raises(TypeError, match="ClippedAdamW"):
        po.wrap(ClippedAdamW(make_params(SMALL_SHAPES)))


def test_wrap_rejects_adam_with_coupled_weight_decay():
    torch_opt = torch.optim.Adam(make_params(SMALL_SHAPES), weight_decay=0.1)
    with pytest.raises(ValueError, match="weight_decay"):
        po.wrap(torch_opt)


def test_wrap_rejects_arguments_that_are_not_paging_arguments():
    torch_opt = torch.optim.AdamW(make_params(SMALL_SHAPES))
    with pytest.raises(TypeError, match="lr"):
        po.wrap(torch_opt, lr=0.5)
    with pytest.raises(ValueError, match="state_bits"):
        po.wrap(torch_opt, state_bits=4)


def test_wrap_of_a_pagedoptim_optimizer():
    ours = po.AdamW(make_params(SMALL_SHAPES), **EXACT)
    assert po.wrap(ours) is ours
    with pytest.raises(ValueError, match="already a pagedoptim"):
        po.wrap(ours, state_bits=8)


def test_wrap_warns_about_a_scheduler_on_the_torch_optimizer():
    params = make_params(SMALL_SHAPES)
    torch_opt = torch.optim.AdamW(params, lr=1e-2)
    torch.optim.lr_scheduler.StepLR(torch_opt, step_size=1, gamma=0.5)
    with pytest.warns(UserWarning, match="scheduler"):
        wrapped = po.wrap(torch_opt, **EXACT)
    # Built on the wrapped optimizer, a scheduler drives it.
    scheduler = torch.optim.lr_scheduler.StepLR(wrapped, step_size=1, gamma=0.5)
    run_steps(wrapped, params, Grads(SMALL_SHAPES, 1), 0, 1)
    scheduler.step()
    assert wrapped.param_groups[0]["lr"] == pytest.approx(5e-3)


def test_wrap_while_patched_uses_torch_classes_and_its_own_settings():
    params = make_params(SMALL_SHAPES)
    torch_opt = torch.optim.AdamW(params)
    po.patch(state_bits=32)
    try:
        wrapped = po.wrap(torch_opt)
    finally:
        po.unpatch()
    assert type(wrapped) is po.AdamW
    # The patch's settings are for scripts' torch names, not for wrap(): the default 8 bits
    # (these small params keep fp32 moments there, so their 8 B each would be 32 bits too:
    # the 8-bit format shows in the report's count of them).
    run_steps(wrapped, params, Grads(SMALL_SHAPES, 1), 0, 1)
    report = wrapped.memory_report()
    assert_8bit_moment_bytes(report)
    assert report["fp32_state_elements"] == report["num_elements"]
    assert wrapped.settings["state_bits"] == 8
