"""Master weights of bf16/fp16 params: the 16-bit parameter plus an int8 (master_bits=24) or
int16 (master_bits=32) residual, split and joined by the step kernels (codec/master_split.h).

Bounds used here (docs/compression.md, "Master weights"): the split of an fp32 master w into
(w', r) rebuilds w within u / (4K) plus one fp32 ulp of w, where u is the 16-bit spacing next
to w' on the side of w and K = 127 or 32767. The rebuilt value is read back from state_dict()
(param + 'master_residual') with reference.join_master, which test_compressed_kernels.py shows
to be bit-identical to the kernels' own join (every step there joins, updates and splits).
"""

import math

import pytest
import torch

import pagedoptim as po
from pagedoptim import reference

from optimizer_configs import configs, parametrize

K = {24: 127.0, 32: 32767.0}
LOW_PRECISION = [(torch.bfloat16, 24), (torch.bfloat16, 32), (torch.float16, 24),
                 (torch.float16, 32)]
IDS = [f"{str(d)[6:]}-master{m}" for d, m in LOW_PRECISION]


def fp32_ulp(x):
    """Spacing of fp32 above |x| (an upper bound of the spacing at any value up to |x|)."""
    x = x.float().abs()
    return torch.nextafter(x, torch.full_like(x, math.inf)) - x


def spacing_toward(param, target):
    """|u|: the 16-bit grid spacing between `param` and its neighbour on `target`'s side."""
    direction = torch.where(target.float() >= param.float(), math.inf, -math.inf)
    neighbour = torch.nextafter(param, direction.to(param.dtype))
    return (neighbour.float() - param.float()).abs()


def rebuilt_master(opt, index, param):
    residual = opt.state_dict()["state"][index]["master_residual"]
    return reference.join_master(param.detach(), residual)


def random_16bit_values(n, dtype, generator):
    """Values of every binade of the format, half of them exact powers of two (where the grid
    below is twice as fine as above), both signs."""
    low, high = (-30, 30) if dtype == torch.bfloat16 else (-13, 14)
    exponent = torch.randint(low, high, (n,), generator=generator).double()
    mantissa = 1.0 + torch.rand(n, generator=generator).double()
    mantissa[::2] = 1.0
    sign = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0).double()
    return (sign * mantissa * 2.0**exponent).to(dtype)


@pytest.mark.parametrize("dtype,master_bits", LOW_PRECISION, ids=IDS)
def test_split_error_is_within_quarter_residual_step(dtype, master_bits):
    """One SGD step p <- fma(g, -lr, p) from residual 0 (master = p) lands on fp32 targets of
    every binade, next to powers of two on both sides; the stored (param, residual) must
    rebuild each target within u/(4K) + 1 fp32 ulp. A second step with lr=0 leaves the master
    unchanged, so param and residual must not move at all (split(join(.)) is stable)."""
    gen = torch.Generator().manual_seed(11)
    n = 1 << 16
    initial = random_16bit_values(n, dtype, gen)
    # Relative steps up to 2^-6: a quarter to two 16-bit ulps for bf16, many for fp16.
    relative = (torch.rand(n, generator=gen) * 2 - 1) * 2.0**-6
    grad = (initial.float() * relative).to(dtype)
    lr = 0.3183098861837907  # many significant bits: targets are general fp32 values
    p = torch.nn.Parameter(initial.clone())
    opt = po.SGD([p], lr=lr, master_bits=master_bits, state_bits=8)
    p.grad = grad.clone()
    opt.step()
    target = reference.fma32(grad.float(), -reference.f32(lr), initial.float())
    rebuilt = rebuilt_master(opt, 0, p)
    bound = spacing_toward(p.detach(), target) / (4 * K[master_bits]) + fp32_ulp(target)
    error = (rebuilt.double() - target.double()).abs()
    worst = (error / bound.double()).max().item()
    assert worst <= 1.0, f"split error reaches {worst:.3f} of u/(4K) + ulp"
    # The residual must be used, not just be zero: most targets are off the 16-bit grid.
    assert (opt.state_dict()["state"][0]["master_residual"] != 0).float().mean() > 0.5

    param_before = p.detach().clone()
    residual_before = opt.state_dict()["state"][0]["master_residual"].clone()
    opt.param_groups[0]["lr"] = 0.0
    p.grad = grad.clone()
    opt.step()
    residual_after = opt.state_dict()["state"][0]["master_residual"]
    assert torch.equal(rebuilt_master(opt, 0, p).view(torch.int32), rebuilt.view(torch.int32))
    # The one representation that may change: a master exactly halfway between two 16-bit
    # values (r = +-K) re-splits to the even neighbour with -r; the master is the same.
    moved = (p.detach().view(torch.int16) != param_before.view(torch.int16)) | (
        residual_after != residual_before)
    assert (residual_before[moved].abs() == K[master_bits]).all()
    assert (residual_after[moved] == -residual_before[moved]).all()
    assert (p.detach().view(torch.int16)[moved] & 1 == 0).all()  # now on the even neighbour


@pytest.mark.parametrize("dtype,master_bits", LOW_PRECISION, ids=IDS)
def test_master_tracks_an_fp32_master_over_many_steps(dtype, master_bits):
    """AdamW's update of an element does not depend on its weight (decoupled decay aside), so
    the same gradients give our 16-bit+residual run and an fp32-param run (reference, same
    8-bit moments) identical codes, and the masters differ only by the split errors. With
    f(x) = fl(fl(x * decay) + d_t) the masters' distance grows per step by at most one split
    error u/(4K) plus the fp32 rounding of f (2 ulp) and one ulp of the rebuild:
        |master_t - fp32_t| <= sum over steps of (u_t / (4K) + 3 ulp32).
    Without the residual (master_bits=None) the same run is at least 10x further off."""
    steps, lr, wd = 60, 1e-3, 0.1
    gen = torch.Generator().manual_seed(5)
    shape = (4, 300)
    initial = torch.randn(shape, generator=gen).to(dtype)
    grads = [(torch.randn(shape, generator=gen) * 0.1).to(dtype) for _ in range(steps)]

    def run(bits):
        p = torch.nn.Parameter(initial.clone())
        opt = po.AdamW([p], lr=lr, weight_decay=wd, master_bits=bits, min_8bit_size=0)
        return p, opt

    p, opt = run(master_bits)
    p_plain, opt_plain = run(None)
    q = initial.float().clone()
    state = reference.init_state(q, ["exp_avg", "exp_avg_sq"], 8, None, min_8bit_size=0)
    bound = torch.zeros(shape, dtype=torch.float64)
    for g in grads:
        for param, o in ((p, opt), (p_plain, opt_plain)):
            param.grad = g.clone()
            o.step()
        reference.adamw_step(q, g.float(), state, lr=lr, weight_decay=wd)
        rebuilt = rebuilt_master(opt, 0, p)
        u = spacing_toward(p.detach(), torch.full(shape, math.inf)).double()  # the larger side
        bound += u / (4 * K[master_bits]) + 3 * fp32_ulp(q).double()
        error = (rebuilt.double() - q.double()).abs()
        assert (error <= bound).all(), f"excess {(error - bound).max().item():.3e}"
    ours = opt.state_dict()["state"][0]
    assert torch.equal(ours["exp_avg_codes"], state["exp_avg_codes"])
    assert torch.equal(ours["exp_avg_sq_codes"], state["exp_avg_sq_codes"])
    error = (rebuilt.double() - q.double()).abs().max().item()
    error_plain = (p_plain.detach().double() - q.double()).abs().max().item()
    assert error_plain >= 10 * error, (error, error_plain)


@pytest.mark.parametrize("master_bits", [24, 32])
def test_weight_decay_below_bf16_resolution_is_not_rounded_away(master_bits):
    """lr * wd = 1e-4 is 20x below half a bf16 ulp at 1.0 (2^-9 = 2e-3 towards zero). With
    zero gradients AdamW only decays: w_t = w_0 (1 - lr*wd)^t. Over 500 steps the weight must
    follow that within 500 split errors (u/(4K) + 3 fp32 ulp each); plain bf16 weights
    (master_bits=None) round every step back to w_0 and never decay."""
    steps, lr, wd = 500, 1e-2, 1e-2
    initial = torch.tensor([1.0, 1.5, -1.25, 3.0, 0.75]).to(torch.bfloat16)
    p = torch.nn.Parameter(initial.clone())
    p_plain = torch.nn.Parameter(initial.clone())
    opt = po.AdamW([p], lr=lr, weight_decay=wd, master_bits=master_bits)
    opt_plain = po.AdamW([p_plain], lr=lr, weight_decay=wd, master_bits=None)
    for _ in range(steps):
        for param, o in ((p, opt), (p_plain, opt_plain)):
            param.grad = torch.zeros_like(param)
            o.step()
    expected = initial.double() * (1.0 - lr * wd) ** steps
    rebuilt = rebuilt_master(opt, 0, p).double()
    u = spacing_toward(initial, torch.zeros(5)).double() * 2  # the coarser side, any binade
    bound = steps * (u / (4 * K[master_bits]) + 3 * fp32_ulp(initial).double())
    assert ((rebuilt - expected).abs() <= bound).all(), (rebuilt, expected, bound)
    assert ((initial.double() - rebuilt).abs() >= 0.04 * initial.double().abs()).all()
    assert torch.equal(p_plain.detach(), initial), "plain bf16 weights are expected to stall"
    assert not torch.equal(p.detach(), initial), "the 16-bit weight itself must decay"


@parametrize("config", configs(core=True))
def test_master_bits_is_ignored_for_fp32_params(config):
    """fp32 params keep no residual stream, and the result does not depend on master_bits."""
    gen = torch.Generator().manual_seed(2)
    initial = torch.randn(100, generator=gen)
    grads = [torch.randn(100, generator=gen) for _ in range(5)]
    results = []
    for master_bits in (None, 24, 32):
        p = torch.nn.Parameter(initial.clone())
        opt = config.make([p], master_bits=master_bits)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        assert "master_residual" not in opt.state_dict()["state"][0]
        assert opt.memory_report()["residual_bytes"] == 0
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
