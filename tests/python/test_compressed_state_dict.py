"""Checkpoints of compressed state: codes and scales in state_dict, bit-for-bit round trips,
size against torch.optim.AdamW, export to and import from torch.optim.AdamW's format, and
conversion between state_bits=32 and state_bits=8."""

import io

import pytest
import torch

import pagedoptim as po
from pagedoptim import reference
from pagedoptim._native import native

from optimizer_configs import configs, parametrize

K, N = 4, 10  # save after K steps, N steps in all

# Every algorithm's branches (optimizer_configs.CORE), SkewAdam's tiers included.
CORE = configs(core=True)
# fp32 params beside bf16 and fp16 params (with residuals), rows ending in partial groups, a
# row spanning 4 KiB pages; a 0-dim and a 1-D param, which keep fp32 moments in any format.
PARAMS = [((1, 33), torch.float32), ((5, 13), torch.bfloat16), ((), torch.float32),
          ((1, 2100), torch.float16), ((3, 31, 3), torch.bfloat16), ((33,), torch.float32)]


def row_length(t):
    """The row length a tensor's 8-bit groups follow (state_format.row_length)."""
    return t.shape[-1] if t.dim() >= 2 else 0


def make_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(d)) for s, d in PARAMS]


def grads_for(step):
    gen = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=gen) * 10 ** torch.empty(s).uniform_(-4, 0, generator=gen)
             ).to(d) for s, d in PARAMS]


def run(opt, params, start, stop):
    for t in range(start, stop):
        for p, g in zip(params, grads_for(t)):
            p.grad = g
        opt.step()


def state_tensors(opt):
    return {(i, k): v.clone() for i, s in opt.state_dict()["state"].items()
            for k, v in s.items() if torch.is_tensor(v)}


def assert_bit_identical(params_a, params_b, state_a, state_b):
    for i, (a, b) in enumerate(zip(params_a, params_b)):
        assert torch.equal(a.detach(), b.detach()), f"param {i} differs"
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert state_a[key].dtype == state_b[key].dtype, key
        assert torch.equal(state_a[key], state_b[key]), f"state {key} differs"


def expected_stream_keys(config, p, master_bits):
    """The 8-bit state_dict keys of param p under `config`: each moment's codes and scales;
    SkewAdam's per tier (docs/skewadam.md): momentum but in the experts tier, the second
    moment factored into row and column means for matrices outside the router tier, else
    exact (fp32 in every format). Params of fewer than two dimensions, and rows too short for
    8 bits to save bytes ((3, 31, 3): rows of 3), keep fp32 moments."""
    eight_bit = reference.keeps_8bit_state(p, min_8bit_size=0)
    if config.algorithm == "skewadam":
        tier = "experts" if p.dim() == 3 else "backbone"
        keys = (set() if tier == "experts" else
                {"exp_avg_codes", "exp_avg_scales"} if eight_bit else {"exp_avg"})
        keys |= ({"exp_avg_sq_row", "exp_avg_sq_col"} if p.dim() >= 2 and p.numel()
                 else {"exp_avg_sq"})
    elif eight_bit:
        keys = {f"{m}_{part}" for m in config.moments() for part in ("codes", "scales")}
    else:
        keys = set(config.moments())
    if p.dtype != torch.float32 and master_bits is not None:
        keys.add("master_residual")
    if config.algorithm != "sgd":  # torch.optim.SGD keeps no 'step', and neither does ours
        keys.add("step")
    return keys


@pytest.mark.parametrize("master_bits", [24, 32, None])
@parametrize("config", CORE)
def test_save_load_continue_is_bit_identical(config, master_bits):
    """Save after K steps (through torch.save / torch.load(weights_only=True)), load into a
    fresh optimizer over fresh params holding the saved values, continue to N: equal to the
    uninterrupted run in every param and every state tensor."""
    make = lambda params: config.make(params, master_bits=master_bits, page_bytes=4096)
    params = make_params()
    opt = make(params)
    run(opt, params, 0, N)

    first = make_params()
    opt_first = make(first)
    run(opt_first, first, 0, K)
    buffer = io.BytesIO()
    torch.save({"optimizer": opt_first.state_dict(),
                "params": [p.detach() for p in first]}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    saved_state = saved["optimizer"]["state"]
    # State indices follow the optimizer's groups (SkewAdam's experts come last).
    for i, p in enumerate(q for group in opt_first.param_groups for q in group["params"]):
        assert set(saved_state[i]) == expected_stream_keys(config, p, master_bits), (
            i, sorted(saved_state[i]))

    second = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
    opt_second = make(second)
    opt_second.load_state_dict(saved["optimizer"])
    run(opt_second, second, K, N)
    assert_bit_identical(params, second, state_tensors(opt), state_tensors(opt_second))


def tensor_bytes(state_dict):
    return sum(v.numel() * v.element_size() for s in state_dict["state"].values()
               for v in s.values() if torch.is_tensor(v))


def test_8bit_state_dict_is_at_least_half_the_size_of_torch_adamw():
    """Same fp32 params, one step each: 8-bit AdamW keeps 2 x (1 B code + 2/32 B scale) per
    element against torch's 2 x 4 B, so the checkpoint's tensors are about 73% smaller (the
    1-D param keeps fp32 moments, as torch's)."""
    shapes = [(10, 1000), (64, 33), (7,)]
    gen = torch.Generator().manual_seed(0)
    ours_params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
    ours, theirs = po.AdamW(ours_params, min_8bit_size=0), torch.optim.AdamW(torch_params)
    for p, q in zip(ours_params, torch_params):
        p.grad = torch.randn(p.shape, generator=gen)
        q.grad = p.grad.clone()
    ours.step()
    theirs.step()
    ours_bytes, torch_bytes = tensor_bytes(ours.state_dict()), tensor_bytes(theirs.state_dict())
    assert ours_bytes <= 0.5 * torch_bytes, (ours_bytes, torch_bytes)
    numel = sum(p.numel() for p in ours_params[:2])
    groups = 10 * 32 + 64 * 2  # rows of 1000 and of 33: 32 and 2 groups each
    # codes, scales, the 1-D param's fp32 moments, steps
    assert ours_bytes == 2 * numel + 2 * 2 * groups + 2 * 4 * 7 + 4 * len(shapes)


def adamw_pair(fp32_seed=3, shape=(40, 48)):
    gen = torch.Generator().manual_seed(fp32_seed)
    p = torch.nn.Parameter(torch.randn(shape, generator=gen))
    grads = [torch.randn(shape, generator=gen) * 0.1 for _ in range(30)]
    return p, grads


def test_torch_state_dict_loads_into_torch_adamw_and_continues_close():
    """torch_state_dict() dequantizes m and v to fp32. Loaded into torch.optim.AdamW, the first
    continued step sees the very moments our kernel decodes, so it agrees to fp32 rounding
    (FP32 tolerance 1e-6 of max|p|, about 8 ulp), except on elements whose v code is 0, where
    our denominator takes the floor (those are excluded and must be few). Over 20 more steps
    the runs drift apart only by the requantization of our moments each step; the distance
    must stay below 10% of how far the params moved (the moments' codec error is below 1%
    of the group scale per step, docs/compression.md)."""
    p, grads = adamw_pair()
    ours = po.AdamW([p], lr=1e-3, weight_decay=0.1, min_8bit_size=0)
    for g in grads[:10]:
        p.grad = g.clone()
        ours.step()
    exported = ours.torch_state_dict()
    state = exported["state"][0]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].shape == p.shape
    codes = ours.state_dict()["state"][0]
    assert torch.equal(state["exp_avg"],
                       native.decode_moment(codes["exp_avg_codes"], codes["exp_avg_scales"],
                                            row_length(p)))
    code_zero = codes["exp_avg_sq_codes"] == 0

    q = torch.nn.Parameter(p.detach().clone())
    theirs = torch.optim.AdamW([q], lr=1e-3, weight_decay=0.1)
    theirs.load_state_dict(exported)
    start = p.detach().clone()
    for i, g in enumerate(grads[10:]):
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
        if i == 0:
            assert code_zero.float().mean() < 0.01
            diff = (p.detach() - q.detach()).abs()[~code_zero].max().item()
            assert diff <= 1e-6 * start.abs().max().item()
    moved = (q.detach() - start).abs().max().item()
    assert (p.detach() - q.detach()).abs().max().item() <= 0.1 * moved


def test_torch_adamw_state_dict_is_quantized_on_load():
    """A torch.optim.AdamW state_dict loads into the 8-bit optimizer as the codes the native
    encoder (and the reference, identical) gives for torch's fp32 moments."""
    p, grads = adamw_pair()
    theirs = torch.optim.AdamW([p], lr=1e-3)
    for g in grads[:5]:
        p.grad = g.clone()
        theirs.step()
    torch_sd = theirs.state_dict()
    moments = torch_sd["state"][0]
    ours = po.AdamW([p], lr=1e-3, min_8bit_size=0)
    ours.load_state_dict(torch_sd)
    state = ours.state_dict()["state"][0]
    for name, encode in (("exp_avg", native.encode_moment),
                         ("exp_avg_sq", native.encode_second_moment)):
        codes, scales = encode(moments[name], row_length(p))
        assert torch.equal(state[f"{name}_codes"], codes)
        assert torch.equal(state[f"{name}_scales"].reshape(-1), scales)
        ref_encode = (reference.encode_second_moment if name == "exp_avg_sq"
                      else reference.encode_moment)
        ref_codes, _ = ref_encode(moments[name])
        assert torch.equal(codes, ref_codes)
    assert state["step"].item() == 5.0
    p.grad = grads[5].clone()
    ours.step()  # continues from the loaded state
    assert ours.state_dict()["state"][0]["step"].item() == 6.0


@parametrize("config", CORE)
def test_conversion_between_32_and_8_bit_state(config):
    """state_bits=32 -> 8: codes = encode(fp32 moments); 8 -> 32: fp32 moments =
    decode(codes, scales); and 8 -> 32 -> 8 gives back the same codes and scales. What the
    8-bit format keeps in fp32 (SkewAdam's second moments) passes through unchanged."""
    params = make_params()
    exact = config.make(params, state_bits=32)
    run(exact, params, 0, 3)
    sd32 = exact.state_dict()
    quantized = config.make(params, state_bits=8)
    quantized.load_state_dict(sd32)
    sd8 = quantized.state_dict()
    back = config.make(params, state_bits=32)
    back.load_state_dict(sd8)
    sd32_back = back.state_dict()
    again = config.make(params, state_bits=8)
    again.load_state_dict(sd32_back)
    for i in sd32["state"]:
        for name, value in sd32["state"][i].items():
            if name in ("step", "master_residual"):
                continue
            if f"{name}_codes" not in sd8["state"][i]:
                assert torch.equal(sd8["state"][i][name], value), (i, name)
                assert torch.equal(sd32_back["state"][i][name], value), (i, name)
                continue
            second = name.endswith("_sq")
            encode = native.encode_second_moment if second else native.encode_moment
            decode = native.decode_second_moment if second else native.decode_moment
            codes, scales = encode(value, row_length(value))
            assert torch.equal(sd8["state"][i][f"{name}_codes"], codes), (i, name)
            assert torch.equal(sd8["state"][i][f"{name}_scales"].reshape(-1), scales), (i, name)
            assert torch.equal(sd32_back["state"][i][name],
                               decode(codes, scales, row_length(value)).view(value.shape))
    for key, value in state_tensors(again).items():
        assert torch.equal(value, sd8["state"][key[0]][key[1]]), key


def test_second_moment_decode_encode_is_idempotent():
    """encode(decode(codes, scales)) == (codes, scales): converting 8 -> 32 -> 8 bit (e.g.
    torch_state_dict() into torch.optim.AdamW and back) should not change the state."""
    gen = torch.Generator().manual_seed(0)
    v = (torch.randn(32 * 1000, generator=gen) * 10 ** torch.empty(32 * 1000).uniform_(
        -4, 0, generator=gen)) ** 2
    codes, scales = native.encode_second_moment(v)
    codes2, scales2 = native.encode_second_moment(native.decode_second_moment(codes, scales))
    assert torch.equal(codes2, codes)
    assert torch.equal(scales2.view(torch.int16), scales.view(torch.int16))


def test_first_moment_decode_encode_is_idempotent():
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(32 * 1000, generator=gen) * 10 ** torch.empty(32 * 1000).uniform_(
        -4, 0, generator=gen)
    codes, scales = native.encode_moment(m)
    codes2, scales2 = native.encode_moment(native.decode_moment(codes, scales))
    assert torch.equal(codes2, codes)
    assert torch.equal(scales2.view(torch.int16), scales.view(torch.int16))


def test_a_moment_given_in_both_formats_is_refused_not_guessed():
    """DCP's full_state_dict load can hand over this optimizer's own (stale) codes beside a
    checkpoint's fp32 moment: loading must say so instead of picking one."""
    param = torch.nn.Parameter(torch.randn(64, 64))
    optimizer = po.AdamW([param], lr=1e-2)
    param.grad = torch.randn(64, 64)
    optimizer.step()
    state = optimizer.state_dict()
    state["state"][0]["exp_avg"] = torch.zeros(64, 64)
    before = optimizer.state_dict()
    with pytest.raises(ValueError, match="holds 'exp_avg' both as fp32 and as 8-bit codes"):
        optimizer.load_state_dict(state)
    after = optimizer.state_dict()
    assert all(torch.equal(after["state"][0][k], v) for k, v in before["state"][0].items())
