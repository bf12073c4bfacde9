"""pagedoptim.SkewAdam against the plain PyTorch reference (pagedoptim.reference.skewadam),
its state_dict, its bf16 weight decay and its argument errors.

Error measure: the parameters' change from their start, max|ours - ref| over the largest
|change| of the reference (support.relative_error's scale idea applied to the update, so the
test sees update errors rather than rounding of the weights). fp32 state: the only
differences are reduction orders (row and column sums, the RMS) and the order of a few
products, a few fp32 ulps of the update: FP32_UPDATE_TOL = 1e-5 is about 80 ulp. 8-bit
momentum: both sides quantize the same momentum with the same codec, so they agree unless an
ulp-level difference moves a value across a rounding boundary of its code; such a flip is
one code step, at most 2/127 of its group's scale (companding.h), so the tolerance is two
code steps of the largest momentum, relative to the update scale.
"""

import copy

import pytest
import torch

import pagedoptim as po
from pagedoptim._native import native
from pagedoptim.reference.skewadam import SkewAdamReference

FP32_UPDATE_TOL = 1e-5
EIGHT_BIT_UPDATE_TOL = 2 * 2 / 127

STEPS = 6
LR = 1e-2
BETAS = (0.9, 0.99)
WD = 0.1

# Shapes per tier. (70, 50) with fp32 momentum spans several 4 KiB pages (1024 elements
# each), so segments start mid-row; (3, 40, 50) is a 3-D expert tensor.
SHAPES = {
    "backbone": [(37,), (), (5, 13), (70, 50)],
    "experts": [(37,), (5, 13), (3, 40, 50), (2, 1, 33)],
    "router": [(37,), (8, 24)],
}
CASES = [(tier, shape) for tier, shapes in SHAPES.items() for shape in shapes]


def grads_for(shape, steps, seed):
    """Gradients whose rows and columns differ in scale by up to 100x (what the factoring
    has to model), with one all-zero row when there are rows."""
    generator = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(steps):
        g = torch.randn(shape, generator=generator)
        if len(shape) >= 2:
            rows = torch.logspace(-2, 0, shape[-2])[:, None]
            cols = torch.logspace(0, -1, shape[-1])[None, :]
            g = g * rows * cols
            g[..., 0, :] = 0.0
        grads.append(g)
    return grads


def run_pair(tier, shape, state_bits, steps=STEPS, seed=0):
    generator = torch.Generator().manual_seed(seed + 1)
    start = torch.randn(shape, generator=generator)
    ours_p = torch.nn.Parameter(start.clone())
    ref_p = torch.nn.Parameter(start.clone())
    ours = po.SkewAdam([{"params": [ours_p], "tier": tier}], lr=LR, betas=BETAS,
                       weight_decay=WD, state_bits=state_bits, master_bits=None,
                       page_bytes=4096)
    codec = (native.encode_moment, native.decode_moment) if state_bits == 8 else None
    ref = SkewAdamReference([(ref_p, tier)], lr=LR, betas=BETAS, weight_decay=WD,
                            momentum_codec=codec)
    for g in grads_for(shape, steps, seed):
        ours_p.grad = g.clone()
        ref_p.grad = g.clone()
        ours.step()
        ref.step()
    return start, ours, ours_p, ref, ref_p


def update_error(start, ours_p, ref_p):
    ref_change = (ref_p.detach() - start).double()
    scale = ref_change.abs().max().item()
    diff = (ours_p.detach().double() - ref_p.detach().double()).abs().max().item()
    return diff / scale if scale > 0 else diff


@pytest.mark.parametrize("state_bits", [32, 8])
@pytest.mark.parametrize("tier,shape", CASES)
def test_matches_reference(tier, shape, state_bits):
    start, ours, ours_p, ref, ref_p = run_pair(tier, shape, state_bits)
    error = update_error(start, ours_p, ref_p)
    tol = FP32_UPDATE_TOL if state_bits == 32 else EIGHT_BIT_UPDATE_TOL
    assert error <= tol, f"{tier} {shape} state_bits={state_bits}: update error {error:.3g}"

    state = ours.state_dict()["state"][0]
    ref_state = ref.state[ref_p]
    if len(shape) >= 2 and tier != "router":
        for key in ("exp_avg_sq_row", "exp_avg_sq_col"):
            torch.testing.assert_close(state[key].reshape(-1), ref_state[key].reshape(-1),
                                       rtol=1e-5, atol=0)
        assert "exp_avg_sq" not in state
    else:
        torch.testing.assert_close(state["exp_avg_sq"], ref_state["exp_avg_sq"].reshape(shape),
                                   rtol=1e-5, atol=0)
        assert "exp_avg_sq_row" not in state
    has_momentum = tier != "experts"
    assert ("exp_avg" in state or "exp_avg_codes" in state) == has_momentum
    assert float(state["step"]) == STEPS


def test_update_rms_is_clipped_per_expert():
    # One expert gets gradients 1e3 times another's: with per-expert clipping each expert's
    # first update has RMS exactly at most 1 (times lr), whatever the other expert does.
    p = torch.nn.Parameter(torch.zeros(2, 16, 24))
    opt = po.SkewAdam([{"params": [p], "tier": "experts"}], lr=1.0, state_bits=32)
    g = torch.randn(2, 16, 24, generator=torch.Generator().manual_seed(3))
    g[1] *= 1e3
    p.grad = g
    opt.step()
    rms = p.detach().square().mean(dim=(1, 2)).sqrt()
    assert torch.all(rms <= 1.0 + 1e-5), rms
    assert torch.all(rms >= 0.5), rms  # a rank-1 fit of iid noise is close to the truth


def test_bf16_weight_decay_is_not_rounded_away():
    # lr * wd = 1e-4 per step is far below half a bf16 ulp at 1.0 (2^-8): a bf16 weight
    # updated in place would never move; the master residual accumulates the decay.
    p = torch.nn.Parameter(torch.ones(64, 32, dtype=torch.bfloat16))
    plain = torch.nn.Parameter(torch.ones(64, 32, dtype=torch.bfloat16))
    opt = po.SkewAdam([p], lr=1e-2, weight_decay=1e-2)
    opt_plain = po.SkewAdam([plain], lr=1e-2, weight_decay=1e-2, master_bits=None)
    for _ in range(300):
        p.grad = torch.zeros_like(p)
        plain.grad = torch.zeros_like(plain)
        opt.step()
        opt_plain.step()
    expected = (1 - 1e-4) ** 300
    assert torch.allclose(p.float(), torch.full_like(p.float(), expected), atol=2 ** -8)
    assert torch.all(p.float() < 1.0)
    assert torch.all(plain.float() == 1.0)


def mixed_model(dtype=torch.float32):
    torch.manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.nn.Parameter(torch.randn(40, 16, dtype=dtype)),
        "model.layers.0.mlp.gate.weight": torch.nn.Parameter(torch.randn(4, 16, dtype=dtype)),
        "model.layers.0.mlp.experts.gate_up_proj":
            torch.nn.Parameter(torch.randn(4, 24, 16, dtype=dtype)),
        "model.layers.0.mlp.experts.down_proj":
            torch.nn.Parameter(torch.randn(4, 16, 12, dtype=dtype)),
        "model.layers.0.input_layernorm.weight": torch.nn.Parameter(torch.ones(16, dtype=dtype)),
        "model.layers.0.mlp.experts.bias": torch.nn.Parameter(torch.zeros(12, dtype=dtype)),
    }


def step_mixed(opt, params, steps, seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        opt.step()


def all_equal(a, b):
    return all(torch.equal(a[k].view(torch.uint8) if a[k].dim() else a[k],
                           b[k].view(torch.uint8) if b[k].dim() else b[k]) for k in a)


@pytest.mark.parametrize("dtype,state_bits", [(torch.float32, 8), (torch.float32, 32),
                                              (torch.bfloat16, 8)])
def test_state_dict_round_trip_is_bit_for_bit(dtype, state_bits):
    params = mixed_model(dtype)
    opt = po.SkewAdam(list(params.items()), lr=1e-2, weight_decay=0.1,
                      state_bits=state_bits, page_bytes=4096)
    step_mixed(opt, params, 3, seed=1)
    saved = opt.state_dict()
    assert set(saved["state"][2]) == {"step", "exp_avg_sq_row", "exp_avg_sq_col"} | (
        {"master_residual"} if dtype == torch.bfloat16 else set())
    assert saved["state"][2]["exp_avg_sq_row"].shape == (4, 24)

    twin_params = {k: torch.nn.Parameter(v.detach().clone()) for k, v in params.items()}
    twin = po.SkewAdam(list(twin_params.items()), lr=1e-2, weight_decay=0.1,
                       state_bits=state_bits, page_bytes=4096)
    twin.load_state_dict(copy.deepcopy(saved))
    reloaded = twin.state_dict()
    assert saved["state"].keys() == reloaded["state"].keys()
    for index in saved["state"]:
        assert saved["state"][index].keys() == reloaded["state"][index].keys()
        assert all_equal(saved["state"][index], reloaded["state"][index]), index

    clone = copy.deepcopy(opt)
    clone_params = [p for g in clone.param_groups for p in g["params"]]
    step_mixed(opt, params, 2, seed=2)
    step_mixed(twin, twin_params, 2, seed=2)
    for name in params:
        assert torch.equal(params[name], twin_params[name]), name
    assert len(clone_params) == len(params)


def test_memory_report_shows_tiers():
    params = mixed_model()
    opt = po.SkewAdam(list(params.items()), state_bits=8, page_bytes=4096)
    step_mixed(opt, params, 1, seed=0)
    report = opt.memory_report()
    tiers = {name: entry["tier"] for name, entry in report["params"].items()}
    assert tiers == {
        "model.embed_tokens.weight": "backbone",
        "model.layers.0.mlp.gate.weight": "router",
        "model.layers.0.mlp.experts.gate_up_proj": "experts",
        "model.layers.0.mlp.experts.down_proj": "experts",
        "model.layers.0.input_layernorm.weight": "backbone",
        "model.layers.0.mlp.experts.bias": "experts",
    }
    assert opt.param_tiers() == tiers
    # fp32 experts: the row and column means and the step counter, nothing per element.
    gate_up = report["params"]["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up["state_bytes"] == 4 * 4 * (24 + 16) + 4
    assert gate_up["second_moment"] == "factored" and not gate_up["momentum"]
    assert report["tiers"]["experts"]["num_params"] == 3
    assert sum(t["state_bytes"] for t in report["tiers"].values()) <= report["state_bytes"]
    assert report["factor_bytes"] == 4 * (40 + 16 + 4 * (24 + 16) + 4 * (16 + 12))


def test_explicit_tiers_and_patterns():
    a = torch.nn.Parameter(torch.randn(3, 4, 5))
    b = torch.nn.Parameter(torch.randn(4, 5))
    opt = po.SkewAdam([{"params": [a], "tier": "experts"}, {"params": [b], "tier": "router"}])
    assert list(opt.param_tiers().values()) == ["experts", "router"]
    named = [("blocks.0.moe.w_in", torch.nn.Parameter(torch.randn(2, 3, 4))),
             ("blocks.0.moe.selector.weight", torch.nn.Parameter(torch.randn(2, 3)))]
    opt = po.SkewAdam(named, tiers={"experts": r"\.w_in$", "router": [r"selector"]})
    assert list(opt.param_tiers().values()) == ["experts", "router"]


@pytest.mark.parametrize("build,match", [
    (lambda p3, p2: po.SkewAdam([{"params": [p2], "tier": "dense"}]), "Invalid tier"),
    (lambda p3, p2: po.SkewAdam([p3]), r"params\[0\] is 3-D .* in tier 'backbone'.*names_from=model"),
    (lambda p3, p2: po.SkewAdam([p2, p3], names_from=torch.nn.ParameterDict({"w": p2})),
     r"params\[1\] \(shape \(2, 3, 4\)\) is not a parameter of the module given as names_from="),
    (lambda p3, p2: po.SkewAdam([("layers.0.mlp.gate.weight", p3)]),
     "param 'layers.0.mlp.gate.weight' is 3-D"),
    (lambda p3, p2: po.SkewAdam([torch.nn.Parameter(torch.zeros(2, 2, 2, 2))]),
     "4 dimensions"),
    (lambda p3, p2: po.SkewAdam([p2], tiers={"backbone": "x"}), "Invalid tiers key"),
    (lambda p3, p2: po.SkewAdam([p2], tiers={"experts": "("}), r"Invalid tiers\['experts'\]"),
    (lambda p3, p2: po.SkewAdam([p2], eps=0.0), "Invalid eps"),
    (lambda p3, p2: po.SkewAdam([p2], betas=(0.9, 1.0)), "Invalid beta parameter at index 1"),
    (lambda p3, p2: po.SkewAdam([p2], lr=-1.0), "Invalid learning rate"),
    (lambda p3, p2: po.SkewAdam([p2], state_bits=4), "Invalid state_bits"),
])
def test_bad_input_names_the_argument(build, match):
    p3 = torch.nn.Parameter(torch.zeros(2, 3, 4))
    p2 = torch.nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=match):
        build(p3, p2)


def test_names_from_must_be_a_module():
    with pytest.raises(TypeError, match="names_from must be a torch.nn.Module"):
        po.SkewAdam([torch.nn.Parameter(torch.zeros(3))], names_from={"w": 1})


def test_names_from_names_unnamed_params_as_named_parameters_would():
    # Trainer's route: groups of plain tensors, named through names_from=.
    moe = torch.nn.Module()
    moe.experts = torch.nn.Parameter(torch.randn(2, 3, 4))
    moe.gate = torch.nn.Linear(4, 2)
    moe.proj = torch.nn.Linear(4, 4)
    by_name = po.SkewAdam(list(moe.named_parameters()))
    groups = [{"params": [moe.experts, moe.gate.weight, moe.proj.weight], "weight_decay": 0.1},
              {"params": [moe.gate.bias, moe.proj.bias], "weight_decay": 0.0}]
    by_model = po.SkewAdam(groups, names_from=moe)
    assert by_model.param_tiers() == {name: by_name.param_tiers()[name]
                                      for name in by_model.param_tiers()}
    assert by_model.param_tiers()["experts"] == "experts"
    assert by_model.param_tiers()["gate.weight"] == "router"
    assert by_model.param_tiers()["proj.weight"] == "backbone"


def test_state_dict_with_missing_factors_is_rejected():
    params = mixed_model()
    opt = po.SkewAdam(list(params.items()))
    step_mixed(opt, params, 1, seed=0)
    saved = opt.state_dict()
    del saved["state"][2]["exp_avg_sq_row"]
    with pytest.raises(ValueError, match="param 2 has no 'exp_avg_sq_row'"):
        po.SkewAdam(list(params.items())).load_state_dict(saved)


def test_release_grads_steps_like_step():
    # Gradient release steps each parameter inside backward: the same updates as one step()
    # over all of them, since SkewAdam's statistics are per parameter.
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    results = []
    for release in (False, True):
        params = mixed_model()
        opt = po.SkewAdam(list(params.items()), lr=1e-2, release_grads=release)
        for _ in range(3):
            h = x @ params["model.embed_tokens.weight"].t()[:16, :16]
            h = h @ params["model.layers.0.mlp.experts.gate_up_proj"][1].t()
            h = h[:, :12] @ params["model.layers.0.mlp.experts.down_proj"][2].t()
            loss = (h.square().mean() + params["model.layers.0.mlp.gate.weight"].sum()
                    + params["model.layers.0.input_layernorm.weight"].square().sum()
                    + params["model.layers.0.mlp.experts.bias"].square().sum())
            loss.backward()
            opt.step()
            opt.zero_grad()
        results.append({k: v.detach().clone() for k, v in params.items()})
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


@pytest.mark.parametrize("tier,shape", [("backbone", (70, 50)), ("experts", (3, 40, 50)),
                                        ("experts", (37,)), ("router", (8, 24))])
def test_bf16_params_within_twice_plain_bf16_error(tier, shape):
    # flash-attention's rule: against the fp32 reference, the bf16 path (bf16 weight + int8
    # master residual) may be off by at most twice what a plain bf16 implementation is.
    generator = torch.Generator().manual_seed(7)
    start = torch.randn(shape, generator=generator).to(torch.bfloat16).float()
    ours_p = torch.nn.Parameter(start.to(torch.bfloat16))
    fp32_p = torch.nn.Parameter(start.clone())
    bf16_p = torch.nn.Parameter(start.to(torch.bfloat16))
    ours = po.SkewAdam([{"params": [ours_p], "tier": tier}], lr=LR, betas=BETAS,
                       weight_decay=WD, state_bits=32, master_bits=24)
    fp32 = SkewAdamReference([(fp32_p, tier)], lr=LR, betas=BETAS, weight_decay=WD)
    bf16 = SkewAdamReference([(bf16_p, tier)], lr=LR, betas=BETAS, weight_decay=WD)
    for g in grads_for(shape, 20, seed=3):
        ours_p.grad = g.to(torch.bfloat16)
        bf16_p.grad = g.to(torch.bfloat16)
        fp32_p.grad = g.to(torch.bfloat16).float()
        for opt in (ours, fp32, bf16):
            opt.step()
    ours_error = update_error(start, ours_p.float(), fp32_p)
    plain_error = update_error(start, bf16_p.float(), fp32_p)
    assert ours_error <= 2 * plain_error, (ours_error, plain_error)


@pytest.mark.parametrize("state_bits", [8, 32])
def test_page_size_never_changes_results(state_bits):
    # Pages only decide where state lives and how the elementwise pass is chunked; the
    # statistics are per matrix and the 8-bit groups never straddle a segment.
    results = []
    for page_bytes in (4096, 12288, 2 << 20):
        params = mixed_model(torch.bfloat16)
        params["model.lm_head.weight"] = torch.nn.Parameter(torch.randn(300, 40))
        opt = po.SkewAdam(list(params.items()), lr=1e-2, weight_decay=0.1,
                          state_bits=state_bits, page_bytes=page_bytes)
        step_mixed(opt, params, 3, seed=4)
        results.append(({k: v.detach().clone() for k, v in params.items()},
                        opt.state_dict()["state"]))
    for params, state in results[1:]:
        for name in params:
            assert torch.equal(params[name], results[0][0][name]), name
        for index in state:
            assert all_equal(state[index], results[0][1][index]), index
