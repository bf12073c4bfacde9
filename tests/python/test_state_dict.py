"""Optimizer state: when it exists, torch's state_dict format, save / load / continue bit for
bit, torch.save / torch.load(weights_only=True), cross-loading with torch.optim.AdamW,
deepcopy and pickle, and params without grads."""

import copy
import io
import pickle

import pytest
import torch

import pagedoptim as po
from support import (FP32_TOL, OURS, REFERENCE, SMALL_SHAPES, Grads, TinyModel,
                      TrajectoryScale, assert_params_close, assert_state_equal, clone_params,
                      make_params, run_steps, set_grads, state_tensors)

K, N = 4, 10  # interrupt after K steps, N steps in all

HYPER = {
    "AdamW": {"lr": 1e-2},
    "AdamW-amsgrad": {"lr": 1e-2, "amsgrad": True},
    "SGD": {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-2},
    "Lion": {"lr": 1e-3, "weight_decay": 0.1},
}
CASES = list(HYPER)


def make(case, params, page_bytes=2 << 20):
    return OURS[case.split("-")[0]](params, page_bytes=page_bytes, **HYPER[case])


def make_ref(case, params):
    return REFERENCE[case.split("-")[0]](params, **HYPER[case])


EXPECTED_KEYS = {
    "AdamW": {"step", "exp_avg", "exp_avg_sq"},
    "AdamW-amsgrad": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    "Lion": {"step", "exp_avg"},
}


@pytest.mark.parametrize("case", CASES)
def test_no_state_before_first_step(case):
    params = make_params(SMALL_SHAPES)
    opt = make(case, params)
    assert len(opt.state) == 0
    sd = opt.state_dict()
    assert sd["state"] == {}
    assert sd["param_groups"][0]["params"] == list(range(len(params)))
    for p in params:
        assert p not in opt.state
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert len(opt.state) == len(params)


@pytest.mark.parametrize("case", [c for c in CASES if c != "SGD"])
def test_state_has_step_after_a_step(case):
    """opt.state[p] holds 'step', a 0-dim float32 tensor counting this param's steps (not
    for SGD: torch.optim.SGD keeps none, test_torch_contract checks ours keeps none)."""
    params = make_params(SMALL_SHAPES)
    opt = make(case, params)
    grads = Grads(SMALL_SHAPES, 3)
    run_steps(opt, params, grads, 0, 3)
    for i, p in enumerate(params):
        assert p in opt.state, f"param {i} has no state"
        step = opt.state[p].get("step")
        assert torch.is_tensor(step), f"param {i}: state['step'] is {step!r}"
        assert step.dtype == torch.float32 and step.dim() == 0
        assert step.item() == 3.0


@pytest.mark.parametrize("case", ["AdamW", "AdamW-amsgrad", "Lion"])
def test_state_dict_has_torch_format(case):
    """Keys, shapes and dtypes of ours match torch.optim.AdamW's (LionReference for Lion)
    after the same steps; the values match to FP32_TOL."""
    params = make_params(SMALL_SHAPES, seed=1)
    ref_params = clone_params(params)
    opt, ref = make(case, params), make_ref(case, ref_params)
    grads = Grads(SMALL_SHAPES, 5)
    run_steps(opt, params, grads, 0, 5)
    run_steps(ref, ref_params, grads, 0, 5)
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    assert set(sd) == {"state", "param_groups"}
    assert sorted(sd["state"]) == sorted(ref_sd["state"]) == list(range(len(params)))
    for idx, ref_state in ref_sd["state"].items():
        state = sd["state"][idx]
        assert set(state) == EXPECTED_KEYS[case], f"param {idx}: keys {sorted(state)}"
        assert set(state) == set(ref_state)
        for key, ref_value in ref_state.items():
            value = state[key]
            assert torch.is_tensor(value), f"param {idx} {key} is {type(value)}"
            assert value.dtype == ref_value.dtype, f"param {idx} {key}: {value.dtype}"
            assert value.shape == ref_value.shape, f"param {idx} {key}: {tuple(value.shape)}"
            assert value.device == ref_value.device
            if key == "step":
                assert torch.equal(value, ref_value)
            else:
                scale = TrajectoryScale([ref_value])
                assert_params_close([value], [ref_value], scale, FP32_TOL,
                                    f"{case} state {key} of param {idx}")
    for group, ref_group in zip(sd["param_groups"], ref_sd["param_groups"]):
        assert group["params"] == ref_group["params"]
        for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"):
            if key in ref_group:
                assert group[key] == ref_group[key], f"param group {key}"


def test_sgd_state_dict_has_momentum_buffer():
    params = make_params(SMALL_SHAPES, seed=1)
    ref_params = clone_params(params)
    opt, ref = make("SGD", params), make_ref("SGD", ref_params)
    grads = Grads(SMALL_SHAPES, 5)
    run_steps(opt, params, grads, 0, 5)
    run_steps(ref, ref_params, grads, 0, 5)
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    assert sorted(sd["state"]) == list(range(len(params)))
    for idx, ref_state in ref_sd["state"].items():
        state = sd["state"][idx]
        assert "momentum_buffer" in state
        assert set(state) <= {"momentum_buffer", "step"}, f"param {idx}: keys {sorted(state)}"
        buf, ref_buf = state["momentum_buffer"], ref_state["momentum_buffer"]
        assert buf.dtype == ref_buf.dtype and buf.shape == ref_buf.shape
        assert_params_close([buf], [ref_buf], TrajectoryScale([ref_buf]), FP32_TOL,
                            f"SGD momentum_buffer of param {idx}")


def test_sgd_without_momentum_has_no_momentum_buffer():
    params = make_params(SMALL_SHAPES, seed=1)
    opt = OURS["SGD"](params, lr=1e-2)
    run_steps(opt, params, Grads(SMALL_SHAPES, 2), 0, 2)
    for idx, state in opt.state_dict()["state"].items():
        assert state.get("momentum_buffer") is None, f"param {idx}: {sorted(state)}"


def interrupted_and_uninterrupted(case, save_load, page_bytes=2 << 20, load_page_bytes=None):
    """Run N steps straight, and K steps -> save_load(state_dict) -> fresh optimizer on
    copies of the params -> N-K more steps. Returns both (params, opt) pairs."""
    grads = Grads(SMALL_SHAPES, N, seed=41)
    straight_params = make_params(SMALL_SHAPES, seed=9)
    straight = make(case, straight_params, page_bytes)
    run_steps(straight, straight_params, grads, 0, N)

    first_params = make_params(SMALL_SHAPES, seed=9)
    first = make(case, first_params, page_bytes)
    run_steps(first, first_params, grads, 0, K)
    saved = save_load(first.state_dict())
    resumed_params = clone_params(first_params)
    resumed = make(case, resumed_params, load_page_bytes or page_bytes)
    resumed.load_state_dict(saved)
    run_steps(resumed, resumed_params, grads, K, N)
    return (straight_params, straight), (resumed_params, resumed)


def assert_bit_identical(a, b, where):
    (a_params, a_opt), (b_params, b_opt) = a, b
    for i, (p, q) in enumerate(zip(a_params, b_params)):
        assert torch.equal(p.detach(), q.detach()), f"{where}: param {i} differs"
    assert_state_equal(state_tensors(a_opt), state_tensors(b_opt), where)


@pytest.mark.parametrize("case", CASES)
def test_save_load_continue_is_bit_identical(case):
    a, b = interrupted_and_uninterrupted(case, lambda sd: copy.deepcopy(sd))
    assert_bit_identical(a, b, f"{case} state_dict round trip")


@pytest.mark.parametrize("case", CASES)
def test_load_into_different_page_size_is_bit_identical(case):
    a, b = interrupted_and_uninterrupted(case, lambda sd: copy.deepcopy(sd),
                                         page_bytes=2 << 20, load_page_bytes=4096)
    assert_bit_identical(a, b, f"{case} saved with 2 MiB pages, loaded with 4 KiB pages")


def torch_save_load_bytes(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("case", CASES)
def test_torch_save_and_weights_only_load(case, tmp_path):
    a, b = interrupted_and_uninterrupted(case, torch_save_load_bytes)
    assert_bit_identical(a, b, f"{case} torch.save to BytesIO / torch.load(weights_only=True)")

    path = tmp_path / "optim.pt"

    def via_file(sd):
        torch.save(sd, path)
        return torch.load(path, weights_only=True)

    a, b = interrupted_and_uninterrupted(case, via_file)
    assert_bit_identical(a, b, f"{case} torch.save to a file / torch.load(weights_only=True)")


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_cross_loading_with_torch_adamw(direction, amsgrad):
    """K steps in one implementation, state_dict -> the other -> N-K more steps; the result
    matches an uninterrupted torch.optim.AdamW run to FP32_TOL."""
    hyper = {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": amsgrad}
    grads = Grads(SMALL_SHAPES, N, seed=43)
    straight_params = make_params(SMALL_SHAPES, seed=10)
    straight = torch.optim.AdamW(straight_params, **hyper)
    scale = TrajectoryScale(straight_params)
    for t in range(N):
        run_steps(straight, straight_params, grads, t, t + 1)
        scale.update(straight_params)

    first_cls, second_cls = ((torch.optim.AdamW, OURS["AdamW"]) if direction == "torch_to_ours"
                             else (OURS["AdamW"], torch.optim.AdamW))
    first_params = make_params(SMALL_SHAPES, seed=10)
    first = first_cls(first_params, **hyper)
    run_steps(first, first_params, grads, 0, K)
    saved = torch_save_load_bytes(first.state_dict())
    second_params = clone_params(first_params)
    # Constructed with other hyperparameters: load_state_dict must restore the saved ones.
    second = second_cls(second_params, lr=0.5, weight_decay=0.0, amsgrad=amsgrad)
    second.load_state_dict(saved)
    assert second.param_groups[0]["lr"] == hyper["lr"]
    assert second.param_groups[0]["weight_decay"] == hyper["weight_decay"]
    for i, p in enumerate(second_params):
        assert second.state[p]["step"].item() == K, f"param {i}: step not restored"
    run_steps(second, second_params, grads, K, N)
    assert_params_close(second_params, straight_params, scale, FP32_TOL,
                        f"AdamW {direction} after {K}+{N - K} steps")
    if direction == "ours_to_torch":
        return
    # The state that continued in ours is still in torch's format and close to torch's.
    ref_sd, sd = straight.state_dict()["state"], second.state_dict()["state"]
    for idx, ref_state in ref_sd.items():
        for key, ref_value in ref_state.items():
            if key == "step":
                assert torch.equal(sd[idx][key], ref_value)
            else:
                assert_params_close([sd[idx][key]], [ref_value], TrajectoryScale([ref_value]),
                                    FP32_TOL, f"state {key} of param {idx}")


def test_named_state_dict_loads_into_torch():
    model, torch_model = TinyModel(), TinyModel()
    opt = OURS["AdamW"](model.named_parameters(), lr=1e-2)
    params = list(model.parameters())
    run_steps(opt, params, Grads([p.shape for p in params], 3), 0, 3)
    sd = opt.state_dict()
    assert sd["param_groups"][0]["param_names"] == [n for n, _ in model.named_parameters()]
    ref = torch.optim.AdamW(torch_model.named_parameters(), lr=0.5)
    ref.load_state_dict(sd)
    assert ref.param_groups[0]["lr"] == 1e-2
    assert len(ref.state) == len(params)


def assert_copy_is_independent(original, original_params, copied, copied_params, case):
    """Step the original on: the copy must not change. Then step the copy the same way:
    both must end bit-identical."""
    snapshot = state_tensors(copied)
    copied_values = [p.detach().clone() for p in copied_params]
    assert len(snapshot) > 0, "the copy lost the optimizer state"
    assert_state_equal(snapshot, state_tensors(original), f"{case}: copy != original")
    grads = Grads(SMALL_SHAPES, 6, seed=47)
    run_steps(original, original_params, grads, 3, 6)
    assert_state_equal(state_tensors(copied), snapshot, f"{case}: stepping the original "
                                                       "changed the copy's state")
    for i, (p, v) in enumerate(zip(copied_params, copied_values)):
        assert torch.equal(p.detach(), v), f"{case}: stepping the original moved copy param {i}"
    run_steps(copied, copied_params, grads, 3, 6)
    assert_bit_identical((original_params, original), (copied_params, copied),
                         f"{case}: copy stepped like the original")


def stepped(case):
    params = make_params(SMALL_SHAPES, seed=12)
    opt = make(case, params)
    run_steps(opt, params, Grads(SMALL_SHAPES, 6, seed=47), 0, 3)
    return params, opt


@pytest.mark.parametrize("case", CASES)
def test_deepcopy(case):
    params, opt = stepped(case)
    copied = copy.deepcopy(opt)
    assert type(copied) is type(opt)
    copied_params = [p for g in copied.param_groups for p in g["params"]]
    assert all(c is not p for c, p in zip(copied_params, params))
    assert_copy_is_independent(opt, params, copied, copied_params, case)


@pytest.mark.parametrize("case", CASES)
def test_deepcopy_with_the_model_shares_params(case):
    """Copying model and optimizer together keeps the copy's optimizer on the copied model."""
    model = TinyModel()
    params = list(model.parameters())
    opt = OURS[case.split("-")[0]](params, **HYPER[case])
    shapes = [p.shape for p in params]
    run_steps(opt, params, Grads(shapes, 3), 0, 3)
    model_copy, opt_copy = copy.deepcopy((model, opt))
    copy_params = list(model_copy.parameters())
    assert all(a is b for a, b in zip(opt_copy.param_groups[0]["params"], copy_params))
    before = [p.detach().clone() for p in params]
    set_grads(copy_params, Grads(shapes, 1, seed=5)[0])
    opt_copy.step()
    assert any(not torch.equal(p.detach(), b) for p, b in zip(copy_params, before))
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))


@pytest.mark.parametrize("case", CASES)
def test_pickle(case):
    params, opt = stepped(case)
    copied = pickle.loads(pickle.dumps(opt))
    assert type(copied) is type(opt)
    copied_params = [p for g in copied.param_groups for p in g["params"]]
    assert_copy_is_independent(opt, params, copied, copied_params, case)


@pytest.mark.parametrize("case", CASES)
def test_params_without_grad_are_skipped(case):
    """A param whose grad stays None gets no state and keeps its value (weight decay on);
    a param that gets a grad from step 3 on starts its own step count there. Both as in
    the reference."""
    params = make_params(SMALL_SHAPES, seed=14)
    ref_params = clone_params(params)
    opt, ref = make(case, params), make_ref(case, ref_params)
    never, late = 1, 4  # indices into SMALL_SHAPES
    never_before = params[never].detach().clone()
    grads = Grads(SMALL_SHAPES, 8, seed=53)
    scale = TrajectoryScale(ref_params)
    for t in range(8):
        for ps in (params, ref_params):
            set_grads(ps, grads[t])
            ps[never].grad = None
            if t < 2:
                ps[late].grad = None
        opt.step()
        ref.step()
        scale.update(ref_params)
        assert params[never] not in opt.state, f"step {t + 1}: state for a param without grad"
        assert torch.equal(params[never].detach(), never_before)
        if t < 2:
            assert params[late] not in opt.state, f"step {t + 1}: state before the first grad"
        elif case != "SGD":  # torch.optim.SGD keeps no step
            assert opt.state[params[late]]["step"].item() == t - 1
        assert_params_close(params, ref_params, scale, FP32_TOL, f"{case} after step {t + 1}",
                            ref_opt=ref)
    sd = opt.state_dict()
    assert never not in sd["state"]
    if case != "SGD":
        assert sd["state"][late]["step"].item() == 6
        assert sd["state"][0]["step"].item() == 8


@pytest.mark.parametrize("case", CASES)
def test_load_state_dict_rejects_mismatched_groups(case):
    params = make_params(SMALL_SHAPES)
    opt = make(case, params)
    run_steps(opt, params, Grads(SMALL_SHAPES, 1), 0, 1)
    sd = opt.state_dict()
    other = make(case, make_params(SMALL_SHAPES[:-1]))
    with pytest.raises(ValueError):
        other.load_state_dict(sd)
