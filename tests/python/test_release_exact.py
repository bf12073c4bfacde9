"""Gradient release changes memory and nothing else: a tiny Llama trained with clipping,
gradient accumulation and bf16 autocast, with release_grads=True, ends with the parameters and
optimizer state of the same run without release bit for bit, and every step's clip norm is
the one clip_grad_norm_ returned there.

The run without release is the ordinary loop: k micro-batches accumulated in p.grad (in the
param's dtype), `torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)`, step(),
zero_grad(). The released run is the same loop, unchanged (clip_grad_norm_ is given params
whose gradients are in gradient streams and computes the same norm from the norms taken at
release), and once more with the optimizer's own `max_grad_norm=` instead of the call.
Covered: accumulation of 1 and 4 micro-batches, exact and 8-bit state, offload None, host and
nvme, on the CPU and on the simulated device (the GPU paging orchestration, docs/gpu_paging.md),
fp32 params under bf16 autocast and bf16 params (bf16 gradients, summed in bf16).
"""

import contextlib
import os
import warnings

import pytest
import torch
import transformers

import pagedoptim as po
from pagedoptim import paging

STEPS = 30
SEQ = 16
BATCH = 2
# Small enough to clip most steps (asserted below, so the test keeps exercising clipping).
MAX_NORM = 0.5
LR = 3e-3
PAGE = 4096
EXACT = dict(state_bits=32, master_bits=None)
EIGHT_BIT = dict(state_bits=8, min_8bit_size=0)  # the tiny matrices keep 8-bit moments


def tiny_llama(dtype=torch.float32):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config).to(dtype)


def byte_batches(count):
    """Batches of bytes of a file every Python has."""
    text = open(os.path.join(os.path.dirname(os.__file__), "textwrap.py"), "rb").read()
    rows = torch.tensor(list(text[:count * BATCH * SEQ]), dtype=torch.long)
    return rows.view(count, BATCH, SEQ)


def train(*, release, accumulation, settings, clip="call", dtype=torch.float32,
          autocast=True, simulated=False, steps=STEPS):
    """(model, optimizer, the clip norm of each step)."""
    model = tiny_llama(dtype)
    kwargs = dict(settings)
    if clip == "option":
        kwargs["max_grad_norm"] = MAX_NORM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # offload="host" for CPU params says it saves nothing
        if simulated:
            with paging.simulated_device():
                opt = po.AdamW(model.parameters(), lr=LR, release_grads=release, **kwargs)
                opt.step()  # no gradient yet: creates nothing, inside the block as the rest
                norms = _loop(model, opt, accumulation, clip, autocast, steps)
        else:
            opt = po.AdamW(model.parameters(), lr=LR, release_grads=release, **kwargs)
            norms = _loop(model, opt, accumulation, clip, autocast, steps)
    return model, opt, norms


def _loop(model, opt, accumulation, clip, autocast, steps):
    batches = byte_batches(steps * accumulation)
    norms = []
    for step in range(steps):
        for micro in range(accumulation):
            tokens = batches[step * accumulation + micro]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=tokens, labels=tokens).loss / accumulation
            loss.backward()
        if clip == "call":
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
        if clip == "option":
            norms.append(opt.last_grad_norm)
        opt.zero_grad()
    return norms


def assert_same_training(released, plain, where):
    (model, opt, norms), (ref_model, ref_opt, ref_norms) = released, plain
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), f"{where}: {name} differs"
    state, ref_state = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert state.keys() == ref_state.keys()
    for index in state:
        for key, value in state[index].items():
            assert torch.equal(value, ref_state[index][key]), f"{where}: state {index} {key}"
    assert len(norms) == len(ref_norms) == STEPS
    for step, (norm, ref_norm) in enumerate(zip(norms, ref_norms)):
        assert norm.dtype == ref_norm.dtype and torch.equal(norm, ref_norm), \
            f"{where}: the clip norm of step {step}: {norm} vs {ref_norm}"
    clipped = sum(float(n) > MAX_NORM for n in ref_norms)
    assert clipped >= STEPS // 2, f"{where}: only {clipped} of {STEPS} steps clipped"


def paged(offload, tmp_path):
    if offload is None:
        return {}
    settings = dict(offload=offload, page_bytes=PAGE, cache_bytes=32 * PAGE)
    if offload == "nvme":
        settings["nvme_dir"] = str(tmp_path)
    return settings


FORMATS = {"exact": EXACT, "8bit": EIGHT_BIT}


@pytest.mark.parametrize("offload", [None, "host", "nvme"])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("accumulation", [1, 4])
def test_release_equals_the_ordinary_loop_on_the_cpu(accumulation, fmt, offload, tmp_path):
    settings = {**FORMATS[fmt], **paged(offload, tmp_path)}
    plain = train(release=False, accumulation=accumulation, settings=settings)
    released = train(release=True, accumulation=accumulation, settings=settings)
    assert_same_training(released, plain, f"{fmt} accumulation={accumulation} "
                                          f"offload={offload}")
    if offload is not None:
        assert released[1].paging_stats()["misses"] > 0  # the state did page


@pytest.mark.parametrize("offload", ["host", "nvme"])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("accumulation", [1, 4])
def test_release_equals_the_ordinary_loop_on_the_simulated_device(accumulation, fmt, offload,
                                                                  tmp_path):
    settings = {**FORMATS[fmt], **paged(offload, tmp_path)}
    plain = train(release=False, accumulation=accumulation, settings=settings, simulated=True)
    released = train(release=True, accumulation=accumulation, settings=settings,
                     simulated=True)
    assert released[1].paging_stats()["device"] == "simulated"
    assert released[1]._release.gradients.engine.device == "simulated"
    assert_same_training(released, plain, f"simulated {fmt} accumulation={accumulation} "
                                          f"offload={offload}")


@pytest.mark.parametrize("accumulation", [1, 4])
def test_max_grad_norm_clips_as_the_clip_call_does(accumulation):
    """The optimizer's own max_grad_norm= (for loops that do not call clip_grad_norm_), with
    and without release, equals clip_grad_norm_(model.parameters()) in the loop; its norm is
    last_grad_norm."""
    plain = train(release=False, accumulation=accumulation, settings=EIGHT_BIT)
    for release in (False, True):
        option = train(release=release, accumulation=accumulation, settings=EIGHT_BIT,
                       clip="option")
        assert_same_training(option, plain, f"max_grad_norm release={release}")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_bf16_params_sum_their_gradients_in_bf16_as_p_grad_does(fmt):
    settings = FORMATS[fmt]
    plain = train(release=False, accumulation=4, settings=settings, dtype=torch.bfloat16,
                  autocast=False)
    released = train(release=True, accumulation=4, settings=settings, dtype=torch.bfloat16,
                     autocast=False)
    assert_same_training(released, plain, f"bf16 params {fmt}")


def _gradient_bytes_during_backward(release):
    """The device bytes of gradients at each point of backward where autograd has just
    completed a gradient (a post-accumulate-grad hook registered before the optimizer's, so
    it runs before the release): the gradients in p.grad, and the gradient pages resident in
    the device cache of the released run. Two steps of two micro-batches on the simulated
    device; returns (the samples, the full gradient bytes, the largest param's, the cache's)."""
    settings = dict(EIGHT_BIT, offload="host", page_bytes=PAGE, cache_bytes=4 * PAGE)
    model = tiny_llama()
    params = list(model.parameters())
    samples = []
    with warnings.catch_warnings(), paging.simulated_device():
        warnings.simplefilter("ignore")

        def sample(_):
            live = sum(p.grad.numel() * p.grad.element_size() for p in params
                       if p.grad is not None)
            pages = opt._release.gradients.memory_usage()["resident_bytes"] if release else 0
            samples.append(live + pages)

        for p in params:
            p.register_post_accumulate_grad_hook(sample)
        opt = po.AdamW(params, lr=LR, release_grads=release, **settings)
        batches = byte_batches(4)
        for step in range(2):
            for micro in range(2):
                tokens = batches[2 * step + micro]
                model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad()
    cache = opt._release.gradients.paging_stats()["cache_bytes"] if release else 0
    return (samples, sum(p.numel() * p.element_size() for p in params),
            max(p.numel() * p.element_size() for p in params), cache)


def test_backward_on_the_simulated_device_never_holds_a_whole_gradient():
    """Without release the device ends every backward holding every gradient; with release
    it holds at most the gradient being released and the gradient cache's pages."""
    samples, full, _, _ = _gradient_bytes_during_backward(release=False)
    assert max(samples) == full
    samples, full, largest, cache = _gradient_bytes_during_backward(release=True)
    assert len(samples) == 4 * len(list(tiny_llama().parameters()))
    assert max(samples) <= largest + cache < full, (max(samples), largest, cache, full)


# -- GradScaler ------------------------------------------------------------------------------

def train_scaled(*, release, accumulation, settings, unscale, clip, simulated=False, steps=12):
    """fp16 autocast with GradScaler (an initial scale so large that the first steps overflow
    and are skipped, then grown every 3 steps); (model, optimizer, clip norms, scales)."""
    model = tiny_llama()
    kwargs = dict(settings)
    if clip == "option":
        kwargs["max_grad_norm"] = MAX_NORM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        context = paging.simulated_device() if simulated else contextlib.nullcontext()
        with context:
            opt = po.AdamW(model.parameters(), lr=LR, release_grads=release, **kwargs)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=3)
            batches = byte_batches(steps * accumulation)
            norms, scales = [], []
            for step in range(steps):
                for micro in range(accumulation):
                    tokens = batches[step * accumulation + micro]
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = model(input_ids=tokens, labels=tokens).loss / accumulation
                    scaler.scale(loss).backward()
                if unscale:
                    scaler.unscale_(opt)
                if clip == "call":
                    norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
                opt.zero_grad()
    return model, opt, norms, scales


SCALED = [(True, "call"), (False, None), (True, "option"), (False, "call")]


@pytest.mark.parametrize("simulated", [False, True], ids=["cpu", "simulated"])
@pytest.mark.parametrize("unscale,clip", SCALED,
                         ids=["unscale-clip", "plain", "unscale-max_grad_norm", "clip-scaled"])
@pytest.mark.parametrize("accumulation", [1, 4])
def test_grad_scaler_unscales_skips_and_clips_released_gradients_as_p_grad(
        accumulation, unscale, clip, simulated, tmp_path):
    """Released gradients under GradScaler: found_inf reaches unscale_, step() and update()
    (the first steps overflow: skipped, the scale backs off, as without release), unscale_
    and clipping see the unscaled gradients, and the step equals the loop without release
    bit for bit."""
    settings = dict(EIGHT_BIT, **(paged("host", tmp_path) if simulated else {}))
    plain = train_scaled(release=False, accumulation=accumulation, settings=settings,
                         unscale=unscale, clip=clip, simulated=simulated)
    released = train_scaled(release=True, accumulation=accumulation, settings=settings,
                            unscale=unscale, clip=clip, simulated=simulated)
    model, opt, norms, scales = released
    ref_model, ref_opt, ref_norms, ref_scales = plain
    assert scales == ref_scales and scales[0] < 2.0 ** 24  # the first steps overflowed
    assert len(norms) == len(ref_norms)
    for norm, ref_norm in zip(norms, ref_norms):  # an overflowed step's norm is inf or NaN
        torch.testing.assert_close(norm, ref_norm, rtol=0, atol=0, equal_nan=True)
    assert any(torch.isfinite(n) for n in ref_norms) or clip != "call"
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
    state, ref_state = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    for index in ref_state:
        for key, value in ref_state[index].items():
            assert torch.equal(state[index][key], value), (index, key)


def test_skewadam_under_grad_scaler_releases_as_without_release():
    """SkewAdam's kernels take no grad_scale (its statistics need the unscaled gradient):
    the release unscales and skips itself, as GradScaler does for it without release."""
    def run(release):
        model = tiny_llama()
        opt = po.SkewAdam(list(model.named_parameters()), lr=LR, release_grads=release)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=3)
        batches = byte_batches(8)
        for tokens in batches:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(input_ids=tokens, labels=tokens).loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return model, scaler.get_scale()
    released, scale = run(True)
    plain, plain_scale = run(False)
    assert scale == plain_scale < 2.0 ** 24
    for (name, p), q in zip(released.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
