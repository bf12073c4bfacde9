"""The fused 8-bit step kernels and the native codecs against pagedoptim.reference.

The reference restates the header math (companding.h, master_split.h, update_rules.h) one fp32
operation at a time, in the kernels' order of operations, with fmaf and sqrtf reproduced
exactly (reference.fma32 / sqrt32). The kernels are built with -ffp-contract=off and never
reassociate, so there is no evaluation-order freedom left: every comparison here is bit for
bit -- codes, scales, residuals and parameters -- with no code of slack. A kernel change that
reorders the float math (approximate reciprocals, fused products) would show up here as a
difference of one code or one ulp; this test is then the place to state and bound it.

Gradients are heavy-tailed (|g| spread over 1e-6..10 inside every group of 32), so the
denominator floor (code 0 of v next to a large neighbour) is exercised on every step.
"""

import math

import pytest
import torch

import pagedoptim as po
from pagedoptim import reference
from pagedoptim._native import native

from optimizer_configs import configs, parametrize

STEPS = 6
PAGE_BYTES = 4096  # a 2100-element AdamW state spans two pages, 9000 elements five
# Groups follow the rows of the last dimension: one row with a partial last group (1, 33),
# rows that are one partial group each (5, 13), (3, 3, 13), rows of a full and a partial
# group (3, 40), exactly one group (1, 32), one row spanning 4 KiB pages (1, 2100), rows
# ending in partial groups across pages (9, 1000); in one optimizer, so that params share
# pages too. With min_8bit_size=0 these keep 8-bit state; the 0-dim, the 1-D and the rows of
# 3 (3, 31, 3), too short for 8 bits to save bytes, keep fp32 moments beside them
# (state_format.keeps_8bit_state).
SHAPES = [(1, 33), (), (5, 13), (1, 32), (3, 3, 13), (3, 31, 3), (3, 40), (1, 2100),
          (9, 1000), (33,)]
MIN_8BIT_SIZE = 0

# The configurations that reach every branch of the AdamW, SGD and Lion kernels
# (optimizer_configs.CORE); SkewAdam has its own oracle and tests (test_skewadam.py).
CORE = configs(core=True, with_reference=True)

# (param dtype, master_bits); master_bits is ignored for fp32 params.
PARAM_FORMATS = [
    (torch.float32, 24),
    (torch.bfloat16, 24), (torch.bfloat16, 32), (torch.bfloat16, None),
    (torch.float16, 24), (torch.float16, 32), (torch.float16, None),
]


def heavy_tailed(shape, generator, dtype):
    """N(0, 1) times magnitudes log-uniform over 1e-6..10, cast to the param dtype."""
    magnitude = 10.0 ** (torch.rand(shape, generator=generator) * 7.0 - 6.0)
    return (torch.randn(shape, generator=generator) * magnitude).to(dtype)


def bits(t):
    """A tensor's bit patterns, so that equality is bitwise (-0 != +0, NaN == same NaN)."""
    if t.is_floating_point():
        return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
    return t


def assert_bitwise_equal(ours, ref, where):
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, (
        f"{where}: {ours.dtype}{tuple(ours.shape)} vs {ref.dtype}{tuple(ref.shape)}")
    differ = bits(ours).reshape(-1) != bits(ref).reshape(-1)
    if differ.any():
        first = int(differ.nonzero()[0])
        pytest.fail(f"{where}: {int(differ.sum())} of {ours.numel()} elements differ; first "
                    f"at flat index {first}: {ours.reshape(-1)[first].item()!r} vs "
                    f"{ref.reshape(-1)[first].item()!r}")


def run_against_reference(config, dtype, master_bits, state_bits=8, shapes=SHAPES, steps=STEPS):
    gen = torch.Generator().manual_seed(7)
    initial = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    params = [torch.nn.Parameter(t.clone()) for t in initial]
    ref_params = [t.clone() for t in initial]
    opt = config.make(params, state_bits=state_bits, master_bits=master_bits,
                      page_bytes=PAGE_BYTES, min_8bit_size=MIN_8BIT_SIZE)
    ref_states = [reference.init_state(p, config.moments(), state_bits, master_bits,
                                       MIN_8BIT_SIZE) for p in ref_params]
    for step in range(1, steps + 1):
        grads = [heavy_tailed(s, gen, dtype) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for p, g, state in zip(ref_params, grads, ref_states):
            config.reference_step(p, g, state, **config.hyper)
        where = (f"{config.name} {dtype} master_bits={master_bits} state_bits={state_bits} "
                 f"step {step}")
        ours_state = opt.state_dict()["state"]
        for i, (p, q, state) in enumerate(zip(params, ref_params, ref_states)):
            assert_bitwise_equal(p.detach(), q, f"{where}, param {i} {tuple(q.shape)}")
            keys = {k for k in state if k != "step"}
            # no entry at all for a param without state (plain SGD), as in torch
            assert keys == {k for k in ours_state.get(i, {}) if k != "step"}, where
            for key in keys:
                assert_bitwise_equal(ours_state[i][key], state[key], f"{where}, {key} of {i}")


@pytest.mark.parametrize("dtype,master_bits", PARAM_FORMATS,
                         ids=[f"{str(d)[6:]}-master{m}" for d, m in PARAM_FORMATS])
@parametrize("config", CORE)
def test_fused_8bit_step_matches_reference_bit_for_bit(config, dtype, master_bits):
    run_against_reference(config, dtype, master_bits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@parametrize("config", CORE)
def test_exact_mode_on_16_bit_params_matches_reference_bit_for_bit(config, dtype):
    """Exact mode (state_bits=32, master_bits=None) on bf16/fp16 params: fp32 moments, the
    update computed in fp32 from the 16-bit param and rounded back to it. The comparison with
    torch's 16-bit runs (test_exactness.py) can only bound an error; this one pins every bit,
    so a learning rate off by 2x or a skipped rounding fails here."""
    run_against_reference(config, dtype, None, state_bits=32)


@pytest.mark.parametrize("dtype,master_bits", [(torch.bfloat16, 24), (torch.float16, 32)])
@parametrize("config", configs("AdamW-amsgrad_maximize_wd", "SGD-dampening", "Lion-weight_decay"))
def test_fp32_state_with_master_split_matches_reference(config, dtype, master_bits):
    """state_bits=32 goes through the same master join/split and update rules."""
    run_against_reference(config, dtype, master_bits, state_bits=32, shapes=[(33,), (2100,)])


@pytest.mark.parametrize("dtype,master_bits", [(torch.bfloat16, 24), (torch.float16, None)])
def test_sgd_without_momentum_matches_reference(dtype, master_bits):
    """Plain SGD keeps no moment; bf16/fp16 params keep only the master residual."""
    run_against_reference(configs("SGD-weight_decay_no_momentum")[0], dtype, master_bits)


def test_sgd_without_momentum_on_fp32_params_with_default_master_bits():
    """fp32 params keep no state in plain SGD, bf16 params keep a residual (regression: the
    fp32 ones failed with 'parameter slot -1 is not registered')."""
    p = torch.nn.Parameter(torch.ones(10))
    opt = po.SGD([p], lr=0.1)  # master_bits=24 by default, ignored for fp32 params
    p.grad = torch.ones(10)
    opt.step()
    assert torch.equal(p.detach(), torch.full((10,), 0.9))
    run_against_reference(configs("SGD-plain")[0], torch.float32, 24, shapes=[(33,), (7,)])
    q = torch.nn.Parameter(torch.ones(40, dtype=torch.bfloat16))
    mixed = po.SGD([p, q], lr=1e-3)
    p.grad, q.grad = torch.ones(10), torch.ones(40, dtype=torch.bfloat16)
    mixed.step()
    assert "master_residual" in mixed.state_dict()["state"][1]
    master = reference.join_master(q.detach(), mixed.state_dict()["state"][1]["master_residual"])
    target = 1.0 - reference.f32(1e-3).item()  # below 1.0, where the bf16 spacing is 2^-8
    assert ((master.double() - target).abs() <= 2.0**-8 / (4 * 127) + 2.0**-24).all()


# ---------------------------------------------------------------------------------------------
# Native codec ops against the reference codec: bit for bit on every kind of input.

def codec_inputs():
    gen = torch.Generator().manual_seed(3)
    n = 64 * 32 + 13  # a partial last group
    heavy = 10.0 ** (torch.rand(n, generator=gen) * 10.0 - 8.0)  # 1e-8..1e2 inside a group
    heavy = heavy * torch.randn(n, generator=gen).sign()
    # Values on and next to fp16 scale boundaries: exact fp16 values, just above, just below.
    boundary = torch.randn(n, generator=gen).to(torch.float16).float()
    boundary[::2] = torch.nextafter(boundary[::2], boundary[::2] * 2)
    nonfinite = torch.randn(n, generator=gen)
    nonfinite[[3, 40, 100, 2000]] = torch.tensor([math.nan, math.inf, -math.inf, math.nan])
    return {
        "uniform": torch.rand(n, generator=gen) * 2 - 1,
        "normal": torch.randn(n, generator=gen),
        "heavy_tailed": heavy,
        "zeros": torch.zeros(n),
        "subnormal": torch.randn(n, generator=gen) * 1e-39,
        "below_fp16_range": torch.randn(n, generator=gen) * 1e-9,
        "above_fp16_range": torch.randn(n, generator=gen) * 1e6,
        "fp16_boundaries": boundary,
        "nonfinite": nonfinite,
        "multidim": torch.randn(7, 5, 3, generator=gen),
    }


CODEC_INPUTS = codec_inputs()


@pytest.mark.parametrize("name", list(CODEC_INPUTS))
@pytest.mark.parametrize("second", [False, True], ids=["first_moment", "second_moment"])
def test_native_codec_is_bit_identical_to_reference(name, second):
    values = CODEC_INPUTS[name]
    if second:  # second moments are v >= 0 (the nonfinite case keeps its inf / NaN)
        values = values * values if name not in ("subnormal", "nonfinite") else values.abs()
    encode_native = native.encode_second_moment if second else native.encode_moment
    encode_ref = reference.encode_second_moment if second else reference.encode_moment
    decode_native = native.decode_second_moment if second else native.decode_moment
    decode_ref = reference.decode_second_moment if second else reference.decode_moment
    rows = values.shape[-1] if values.dim() >= 2 else 0  # groups follow the last dim's rows
    codes, scales = encode_native(values, rows)
    ref_codes, ref_scales = encode_ref(values)
    assert_bitwise_equal(codes, ref_codes, f"{name} codes")
    assert_bitwise_equal(scales.view(ref_scales.shape), ref_scales, f"{name} scales")
    assert_bitwise_equal(decode_native(codes, scales, rows), decode_ref(codes, ref_scales),
                         f"{name} decode")


def test_negative_second_moment_poisons_its_group():
    values = torch.rand(70)
    values[40] = -1e-3
    codes, scales = native.encode_second_moment(values)
    ref_codes, ref_scales = reference.encode_second_moment(values)
    assert_bitwise_equal(codes, ref_codes, "codes")
    assert_bitwise_equal(scales, ref_scales, "scales")
    assert torch.isnan(scales[1]) and not torch.isnan(scales[[0, 2]]).any()


def test_first_moment_round_trip_error_bound():
    """|decode(encode(x)) - x| <= s * h * 2 / (2 - min(|z| + h, 1))^2, h = 0.5/127, z the
    unrounded code / 127 (half a code step of the compander's inverse), plus fp32 rounding of
    the decode (2 ulp of s)."""
    for name in ("uniform", "normal", "heavy_tailed", "multidim"):
        x = CODEC_INPUTS[name].reshape(-1)
        codes, scales = native.encode_moment(x)
        decoded = native.decode_moment(codes, scales).reshape(-1)
        s = scales.float().repeat_interleave(32)[: x.numel()]
        ratio = (x / s).double().abs()
        z = 2 * ratio / (1 + ratio)
        h = 0.5 / 127
        bound = s.double() * (h * 2 / (2 - torch.clamp(z + h, max=1.0)) ** 2 + 2 * 2.0**-23)
        err = (decoded.double() - x.double()).abs()
        assert (err <= bound).all(), f"{name}: worst excess {(err - bound).max().item():.3e}"


def test_second_moment_round_trip_error_bound():
    """|sqrt(decode(encode(v))) - sqrt(v)| <= s / 510 (half a linear code of sqrt(v)), plus
    fp32 rounding (2 ulp of s)."""
    for name in ("uniform", "normal", "heavy_tailed", "multidim"):
        v = CODEC_INPUTS[name].reshape(-1) ** 2
        codes, scales = native.encode_second_moment(v)
        decoded = native.decode_second_moment(codes, scales).reshape(-1)
        s = scales.float().double().repeat_interleave(32)[: v.numel()]
        err = (decoded.double().sqrt() - v.double().sqrt()).abs()
        assert (err <= s / 510 + s * 2 * 2.0**-23).all()


def test_all_zero_group_and_nonfinite_policy():
    values = torch.zeros(96)
    values[33] = math.inf  # group 1 poisoned, groups 0 and 2 zero
    codes, scales = native.encode_moment(values)
    decoded = native.decode_moment(codes, scales)
    assert scales[0].item() == 0.0 and scales[2].item() == 0.0
    assert torch.equal(decoded[:32], torch.zeros(32)) and torch.equal(decoded[64:], torch.zeros(32))
    assert torch.isnan(scales[1]) and torch.isnan(decoded[32:64]).all()  # the whole group
    # Sticky: re-encoding the decoded NaN group keeps it NaN.
    codes2, scales2 = native.encode_moment(decoded)
    assert torch.isnan(scales2[1]) and torch.isnan(native.decode_moment(codes2, scales2)[32:64]).all()


# ---------------------------------------------------------------------------------------------
# The denominator floor, through the kernel.

def test_denominator_floor_bounds_the_update_where_plain_decode_explodes():
    """Element 0 of a group gets +-1 alternating (small m, large v); the others a steady
    1e-3 (v more than 510x below the group's top: code 0, m still coded), then no gradient.

    Exact AdamW moves them by about lr per step. The plain decode of v (reference with
    v_floor=False) makes the denominator eps once their gradient stops: m / eps, an update of
    ~1e5 lr. The native kernel's floor bounds the normalized update by 2 sqrt(C) = 14.5 for
    betas (0.9, 0.999) (docs/compression.md)."""
    lr = 1e-3
    grads = []
    for step in range(60):  # one group: a row of 32 (2-D, so its moments are 8-bit)
        g = torch.full((1, 32), 1e-3 if step < 40 else 0.0)
        g[0, 0] = 1.0 if step % 2 == 0 else -1.0
        grads.append(g)
    p = torch.nn.Parameter(torch.zeros(1, 32))
    opt = po.AdamW([p], lr=lr, weight_decay=0.0, min_8bit_size=0)
    q_floor, q_plain = torch.zeros(1, 32), torch.zeros(1, 32)
    s_floor = reference.init_state(q_floor, ["exp_avg", "exp_avg_sq"], min_8bit_size=0)
    s_plain = reference.init_state(q_plain, ["exp_avg", "exp_avg_sq"], min_8bit_size=0)
    worst_native = worst_plain = 0.0
    for g in grads:
        before, before_plain = p.detach().clone(), q_plain.clone()
        p.grad = g.clone()
        opt.step()
        reference.adamw_step(q_floor, g, s_floor, lr=lr, weight_decay=0.0)
        reference.adamw_step(q_plain, g, s_plain, lr=lr, weight_decay=0.0, v_floor=False)
        worst_native = max(worst_native, (p.detach() - before)[0, 1:].abs().max().item() / lr)
        worst_plain = max(worst_plain, (q_plain - before_plain)[0, 1:].abs().max().item() / lr)
        assert torch.equal(p.detach(), q_floor)
    assert worst_native <= 2 * math.sqrt((0.1**2) / (0.001 * (1 - 0.81 / 0.999)))
    assert worst_plain > 1e3, "the scenario no longer triggers the failure the floor fixes"
