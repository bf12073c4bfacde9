"""Converting optimizer state_dicts: pagedoptim's 8-bit state to torch.optim's format and
back, checked against torch's own optimizers (the converted state must step in
torch.optim.AdamW / SGD as ours steps in exact mode), and bad input."""

import copy

import pytest
import torch

import pagedoptim as po
from conftest import (Grads, assert_state_equal, clone_params, make_params, run_lockstep,
                      run_steps)
from pagedoptim.checkpoint_conversion import (AlreadyInTargetFormat, to_pagedoptim_format,
                                              to_torch_format)

SHAPES = [(), (7,), (33,), (5, 13), (3, 31, 3)]
STEPS = 4
EXACT = dict(state_bits=32, master_bits=None)

# name -> (pagedoptim constructor, algorithm, torch.optim class or None)
CASES = {
    "AdamW": (lambda ps, **kw: po.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw), "adamw",
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    "AdamW-amsgrad": (lambda ps, **kw: po.AdamW(ps, lr=1e-2, amsgrad=True, **kw), "adamw",
                      lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True)),
    "SGD": (lambda ps, **kw: po.SGD(ps, lr=1e-2, momentum=0.9, **kw), "sgd",
            lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)),
    "Lion": (lambda ps, **kw: po.Lion(ps, lr=1e-3, **kw), "lion", None),
    "SkewAdam": (lambda ps, **kw: po.SkewAdam(ps, lr=1e-3, **kw), "skewadam", None),
}
TORCH_CASES = [name for name, case in CASES.items() if case[2] is not None]


def trained(case, dtype=torch.float32, **options):
    """(params, optimizer) after STEPS steps of pagedoptim's `case` (8-bit by default)."""
    params = make_params([s for s in SHAPES if case != "SkewAdam" or len(s) < 3], dtype=dtype)
    opt = CASES[case][0](params, **options)
    run_steps(opt, params, Grads([p.shape for p in params], STEPS), 0, STEPS)
    return params, opt


def trained_torch(case):
    params = make_params(SHAPES)
    opt = CASES[case][2](params)
    run_steps(opt, params, Grads(SHAPES, STEPS), 0, STEPS)
    return params, opt


def tensors_of(state_dict):
    return {(index, key): value for index, state in state_dict["state"].items()
            for key, value in state.items()}


# -- the conversions -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_to_torch_is_torch_state_dict(case, dtype):
    """Converting a saved 8-bit state_dict gives what the live optimizer's torch_state_dict()
    gives, bit for bit (bf16 params: the master residual is dropped)."""
    _, opt = trained(case, dtype)
    converted = to_torch_format(opt.state_dict(), CASES[case][1])
    assert_state_equal(tensors_of(converted), tensors_of(opt.torch_state_dict()), case)
    assert converted["param_groups"] == opt.state_dict()["param_groups"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_8bit_to_torch_and_back_is_bit_identical(case, dtype):
    """Dequantized codes quantize back to themselves; the residual survives a round trip
    through pagedoptim's 32-bit format."""
    _, opt = trained(case, dtype)
    saved, algorithm = opt.state_dict(), CASES[case][1]
    via_torch = to_pagedoptim_format(to_torch_format(saved, algorithm), algorithm, 8)
    via_fp32 = to_pagedoptim_format(to_pagedoptim_format(saved, algorithm, 32), algorithm, 8)
    without_residual = {k: v for k, v in tensors_of(saved).items() if k[1] != "master_residual"}
    assert_state_equal(tensors_of(via_torch), without_residual, f"{case} via torch")
    assert_state_equal(tensors_of(via_fp32), tensors_of(saved), f"{case} via 32-bit")


@pytest.mark.parametrize("case", TORCH_CASES)
def test_8bit_checkpoint_steps_in_torch_as_ours_does_in_exact_mode(case):
    """The reason to convert: torch's optimizer, given the converted 8-bit checkpoint,
    continues exactly as pagedoptim's exact mode does from the same checkpoint."""
    params, opt = trained(case)
    converted = to_torch_format(opt.state_dict(), CASES[case][1])
    torch_params, exact_params = clone_params(params), clone_params(params)
    # One copy each: torch's load_state_dict keeps the given 'step' tensors, which both
    # optimizers would then increment.
    theirs = CASES[case][2](torch_params)
    theirs.load_state_dict(copy.deepcopy(converted))
    exact = CASES[case][0](exact_params, **EXACT)
    exact.load_state_dict(copy.deepcopy(converted))
    grads = Grads(SHAPES, STEPS, seed=7)
    run_lockstep(exact, exact_params, theirs, torch_params, grads, label=case)


@pytest.mark.parametrize("case", TORCH_CASES)
def test_torch_checkpoint_to_8bit_loads_into_ours_and_steps(case):
    """A torch checkpoint converted to 8 bits is the state ours would make of it on load,
    and training goes on from it exactly as from the torch checkpoint itself."""
    params, theirs = trained_torch(case)
    converted = to_pagedoptim_format(theirs.state_dict(), CASES[case][1], 8)
    from_converted_params, from_torch_params = clone_params(params), clone_params(params)
    from_converted = CASES[case][0](from_converted_params)
    from_converted.load_state_dict(copy.deepcopy(converted))
    from_torch = CASES[case][0](from_torch_params)
    from_torch.load_state_dict(copy.deepcopy(theirs.state_dict()))
    grads = Grads(SHAPES, STEPS, seed=7)
    run_steps(from_converted, from_converted_params, grads, 0, STEPS)
    run_steps(from_torch, from_torch_params, grads, 0, STEPS)
    for a, b in zip(from_converted_params, from_torch_params):
        assert torch.equal(a, b)
    assert_state_equal(tensors_of(from_converted.state_dict()),
                       tensors_of(from_torch.state_dict()), case)


@pytest.mark.parametrize("case", TORCH_CASES)
def test_torch_checkpoint_is_already_torch_and_pagedoptim_32bit(case):
    """torch's fp32 format is pagedoptim's state_bits=32 format: nothing to convert."""
    _, theirs = trained_torch(case)
    algorithm = CASES[case][1]
    with pytest.raises(AlreadyInTargetFormat, match="already in torch.optim's format"):
        to_torch_format(theirs.state_dict(), algorithm)
    with pytest.raises(AlreadyInTargetFormat, match="state_bits=32 format"):
        to_pagedoptim_format(theirs.state_dict(), algorithm, 32)


def test_8bit_checkpoint_is_already_8bit_and_empty_state_is_in_every_format():
    _, opt = trained("AdamW")
    with pytest.raises(AlreadyInTargetFormat, match="state_bits=8 format"):
        to_pagedoptim_format(opt.state_dict(), "adamw", 8)
    unstepped = po.AdamW(make_params(SHAPES)).state_dict()
    with pytest.raises(AlreadyInTargetFormat):
        to_torch_format(unstepped, "adamw")


def test_adam_with_coupled_weight_decay_is_refused():
    params = make_params(SHAPES)
    for weight_decay in (0.0, 0.1):
        adam = torch.optim.Adam(params, lr=1e-3, weight_decay=weight_decay)
        run_steps(adam, params, Grads(SHAPES, 1), 0, 1)
        if weight_decay == 0.0:
            to_pagedoptim_format(adam.state_dict(), "adam", 8)
            continue
        with pytest.raises(ValueError, match="torch.optim.Adam with weight_decay != 0"):
            to_pagedoptim_format(adam.state_dict(), "adam", 8)


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("exp_avg_scales"), "has only one of 'exp_avg_codes' and 'exp_avg_scales'"),
    (lambda s: s.update(exp_avg_scales=torch.zeros(1, dtype=torch.float16)),
     r"'exp_avg_scales' of param 0 has 1 elements, expected 3"),
    (lambda s: s.update(exp_avg_codes=[1, 2]), "'exp_avg_codes' of param 0 must be a tensor"),
])
def test_malformed_state_is_a_clear_error(edit, message):
    _, opt = trained("AdamW")
    state_dict = opt.state_dict()
    state_dict["state"] = {index: dict(state) for index, state in state_dict["state"].items()}
    first = next(i for i, s in state_dict["state"].items() if s["exp_avg_codes"].numel() == 65)
    state_dict["state"] = {0: state_dict["state"][first]}
    edit(state_dict["state"][0])
    with pytest.raises(ValueError, match=message):
        to_torch_format(state_dict, "adamw")


def test_bad_arguments_are_named():
    _, opt = trained("AdamW")
    with pytest.raises(ValueError, match=r"algorithm must be one of .*got 'adafactor'"):
        to_torch_format(opt.state_dict(), "adafactor")
    with pytest.raises(ValueError, match=r"state_bits must be one of \[8, 32\], got 16"):
        to_pagedoptim_format(opt.state_dict(), "adamw", 16)
    with pytest.raises(ValueError, match="state_dict must be an optimizer state_dict"):
        to_torch_format({"model": {}}, "adamw")
