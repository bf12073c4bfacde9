"""Exact mode (state_bits=32, master_bits=None, offload=None) against the references.

fp32: 100 steps side by side with torch.optim.AdamW / torch.optim.SGD / LionReference on
the same seeded gradients; after every step each parameter must be within FP32_TOL = 1e-6
of the reference, where the error is

    max_i |ours_i - ref_i| / (max over the run so far of max_i |ref_i|)

(see support.py: rounding error is bounded relative to the magnitudes the tensor took,
which stays well defined where elements cross zero). For Lion, elements whose update
direction sign(beta1*m + (1-beta1)*g) was a rounding-level tie in the reference are left
out of the parameter comparison (sign() is discontinuous there); they must stay rare.

bf16 / fp16 (flash-attention's rule): run the reference in fp32 from the same initial
values (the low-precision values, widened) on the fp32 gradients; run torch's optimizer
(or LionReference) and ours in the low-precision dtype on the gradients cast to it. The
max abs error of ours against the fp32 run, over all parameters, must be at most twice
that of torch's run.
"""

import pytest
import torch

from support import (EXACT, FP32_TOL, LARGE_SHAPES, OURS, REFERENCE, SMALL_SHAPES, Grads,
                      TrajectoryScale, assert_params_close, clone_params, make_params,
                      run_lockstep, set_grads)
from optimizer_configs import configs, parametrize

STEPS = 100
PAGE_SIZES = [2 << 20, 4096]

# Every shared configuration torch defines (optimizer_configs.py): each AdamW, SGD and Lion
# branch, against torch.optim's own optimizer (or LionReference).
TORCH_CONFIGS = configs(with_torch=True)


@pytest.mark.parametrize("page_bytes", PAGE_SIZES)
@parametrize("config", TORCH_CONFIGS)
def test_fp32_matches_reference(config, page_bytes):
    params = make_params(SMALL_SHAPES, seed=0)
    ref_params = clone_params(params)
    opt = config.make(params, page_bytes=page_bytes, **EXACT)
    ref = config.make_torch(ref_params)
    run_lockstep(opt, params, ref, ref_params, Grads(SMALL_SHAPES, STEPS, seed=7),
                 label=f"{config.name} page_bytes={page_bytes}")


@parametrize("config", configs(algorithms=["sgd"], with_torch=True))
def test_fp32_sgd_is_torchs_bit_for_bit(config):
    """What the README's status table claims for SGD: on fp32 params every step equals
    torch.optim.SGD's in every bit (the same operations in the same order, each rounded once),
    not merely within FP32_TOL. On 16-bit params torch rounds each intermediate to the param
    dtype where we compute in fp32, so there only the error bound of the tests below holds."""
    params = make_params(SMALL_SHAPES, seed=0)
    ref_params = clone_params(params)
    opt, ref = config.make(params, **EXACT), config.make_torch(ref_params)
    grads = Grads(SMALL_SHAPES, STEPS, seed=7)
    for t in range(STEPS):
        set_grads(params, grads[t])
        set_grads(ref_params, grads[t])
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(params, ref_params)):
            assert torch.equal(p, q), f"{config.name}: param {i} differs after step {t + 1}"


LARGE_CONFIGS = [
    ("AdamW", {"lr": 1e-3}),
    ("SGD", {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-2}),
    ("Lion", {"lr": 1e-4, "weight_decay": 0.1}),
]


@pytest.mark.parametrize("name,hyper", LARGE_CONFIGS, ids=[n for n, _ in LARGE_CONFIGS])
def test_fp32_large_param_spanning_pages(name, hyper):
    """A > 1M-element parameter (several 2 MiB pages; thousands of 4 KiB pages) between
    a 0-dim and an odd-sized parameter, so pages are both shared and spanned. One
    reference run serves both page sizes; each is compared to it on its own."""
    shapes = [()] + LARGE_SHAPES + [(33,)]
    init = make_params(shapes, seed=3)
    ref_params = clone_params(init)
    ref = REFERENCE[name](ref_params, **hyper)
    runs = []
    for page_bytes in PAGE_SIZES:
        params = clone_params(init)
        runs.append((page_bytes, OURS[name](params, page_bytes=page_bytes, **hyper), params))
    grads = Grads(shapes, STEPS, seed=11)
    scale = TrajectoryScale(ref_params)
    for t in range(STEPS):
        g = grads[t]
        set_grads(ref_params, g)
        ref.step()
        scale.update(ref_params)
        for page_bytes, opt, params in runs:
            set_grads(params, g)
            opt.step()
            if (t + 1) % 25 == 0:
                assert_params_close(params, ref_params, scale, FP32_TOL,
                                    f"{name} large page_bytes={page_bytes} after step {t + 1}",
                                    ref_opt=ref)


@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion"])
def test_fp32_groups_with_their_own_hyperparameters(name):
    params = make_params(SMALL_SHAPES, seed=5)
    ref_params = clone_params(params)
    group_hyper = {
        "AdamW": [{"lr": 1e-2, "weight_decay": 0.0}, {"betas": (0.5, 0.9), "amsgrad": True},
                  {"eps": 1e-3, "maximize": True}],
        "SGD": [{"momentum": 0.9, "nesterov": True}, {"lr": 0.1}, {"momentum": 0.5,
                                                                   "dampening": 0.5}],
        "Lion": [{"lr": 1e-3}, {"betas": (0.5, 0.9), "weight_decay": 1.0}, {"maximize": True}],
    }[name]
    defaults = {"AdamW": {}, "SGD": {"lr": 1e-2}, "Lion": {}}[name]

    def groups(ps):
        return [dict(params=ps[i::3], **h) for i, h in enumerate(group_hyper)]

    opt = OURS[name](groups(params), **defaults)
    ref = REFERENCE[name](groups(ref_params), **defaults)
    order = [p for i in range(3) for p in params[i::3]]
    ref_order = [p for i in range(3) for p in ref_params[i::3]]
    shapes = [p.shape for p in order]
    run_lockstep(opt, order, ref, ref_order, Grads(shapes, STEPS, seed=13),
                 label=f"{name} with 3 groups")


LOW_PRECISION = [
    # fp16 cannot hold eps=1e-8 (it rounds to 0 and torch's fp16 run divides by zero), so
    # the fp16 AdamW case uses an eps fp16 represents.
    ("AdamW", torch.bfloat16, {"lr": 1e-2}),
    ("AdamW", torch.float16, {"lr": 1e-2, "eps": 1e-4}),
    ("SGD", torch.bfloat16, {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-2}),
    ("SGD", torch.float16, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
    ("Lion", torch.bfloat16, {"lr": 1e-3, "weight_decay": 0.1}),
    ("Lion", torch.float16, {"lr": 1e-3}),
]


@pytest.mark.parametrize("name,dtype,hyper", LOW_PRECISION,
                         ids=[f"{n}-{str(d).split('.')[-1]}" for n, d, _ in LOW_PRECISION])
def test_low_precision_error_at_most_twice_torch(name, dtype, hyper):
    shapes = SMALL_SHAPES + [(4099,), (63, 65)]
    init = [p.detach().to(dtype) for p in make_params(shapes, seed=21)]
    ref32_params = clone_params(init, torch.float32)
    torch_params = clone_params(init)
    ours_params = clone_params(init)
    ref32 = REFERENCE[name](ref32_params, **hyper)
    torch_lp = REFERENCE[name](torch_params, **hyper)
    ours = OURS[name](ours_params, **hyper)
    # Unit-scale gradients: the regime where the low-precision dtypes are used at all.
    grads = Grads(shapes, STEPS, seed=23, magnitudes=[1.0] * len(shapes))
    for t in range(STEPS):
        g = grads[t]
        set_grads(ref32_params, g)
        set_grads(torch_params, g)
        set_grads(ours_params, g)
        ref32.step()
        torch_lp.step()
        ours.step()
    for p in ours_params:
        assert p.dtype == dtype, f"ours changed a parameter's dtype to {p.dtype}"

    def max_error(run):
        return max((a.detach().float() - r.detach()).abs().max().item()
                   for a, r in zip(run, ref32_params))

    err_torch, err_ours = max_error(torch_params), max_error(ours_params)
    assert 0.0 < err_torch < float("inf"), f"torch's {dtype} run is not a usable baseline"
    assert err_ours <= 2.0 * err_torch, (
        f"{name} {dtype}: max abs error vs fp32 reference {err_ours:.4e} > 2 x torch's "
        f"{err_torch:.4e}")
