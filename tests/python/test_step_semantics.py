"""What step() does around the update: closures, step hooks, and torch.amp.GradScaler's
skipped steps (on CPU)."""

import pytest
import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from support import (FP32_TOL, OURS, REFERENCE, TinyModel, TrajectoryScale,
                      assert_params_close, model_loss, state_tensors)

ALL = ["AdamW", "SGD", "Lion"]
HYPER = {"AdamW": {"lr": 1e-2}, "SGD": {"lr": 1e-2, "momentum": 0.9}, "Lion": {"lr": 1e-3}}


def make(name, model):
    return OURS[name](model.parameters(), **HYPER[name])


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("outer_grad_mode", ["enabled", "no_grad"])
def test_closure_is_called_once_with_grad_and_its_loss_returned(name, outer_grad_mode,
                                                                 batches):
    model, ref_model = TinyModel(), TinyModel()
    opt = make(name, model)
    ref = REFERENCE[name](ref_model.parameters(), **HYPER[name])
    scale = TrajectoryScale(list(ref_model.parameters()))
    for t, batch in enumerate(batches[:5]):
        calls = []

        def closure(m=model, o=opt):
            calls.append(torch.is_grad_enabled())
            o.zero_grad()
            loss = model_loss(m, batch)
            loss.backward()
            return loss

        def ref_closure():
            ref.zero_grad()
            loss = model_loss(ref_model, batch)
            loss.backward()
            return loss

        if outer_grad_mode == "no_grad":
            with torch.no_grad():
                loss = opt.step(closure)
        else:
            loss = opt.step(closure)
        ref_loss = ref.step(ref_closure)
        assert calls == [True], f"step {t + 1}: closure calls (grad enabled?) {calls}"
        assert torch.is_tensor(loss) and loss.requires_grad
        # The contract is fp32 rounding (FP32_TOL), not bit equality with torch.
        assert torch.allclose(loss.detach(), ref_loss.detach(), rtol=FP32_TOL, atol=0), \
            f"step {t + 1}: returned loss"
        scale.update(list(ref_model.parameters()))
        assert_params_close(list(model.parameters()), list(ref_model.parameters()), scale,
                            FP32_TOL, f"{name} closure step {t + 1}")


@pytest.mark.parametrize("name", ALL)
def test_step_without_closure_returns_none(name, tiny_model, batches):
    opt = make(name, tiny_model)
    model_loss(tiny_model, batches[0]).backward()
    assert opt.step() is None


@pytest.mark.parametrize("name", ALL)
def test_step_hooks_fire_once_per_step(name, tiny_model, batches):
    opt = make(name, tiny_model)
    params = list(tiny_model.parameters())
    events = []

    def pre(o, args, kwargs):
        assert o is opt
        events.append(("pre", [p.detach().clone() for p in params]))

    def post(o, args, kwargs):
        assert o is opt
        events.append(("post", [p.detach().clone() for p in params]))

    pre_handle = opt.register_step_pre_hook(pre)
    post_handle = opt.register_step_post_hook(post)
    for batch in batches[:3]:
        opt.zero_grad()
        model_loss(tiny_model, batch).backward()
        opt.step()
    assert [e for e, _ in events] == ["pre", "post"] * 3
    for i in range(0, 6, 2):
        before, after = events[i][1], events[i + 1][1]
        assert any(not torch.equal(a, b) for a, b in zip(after, before)), (
            "pre hook ran after the update, or post hook before it")

    def closure():
        opt.zero_grad()
        loss = model_loss(tiny_model, batches[3])
        loss.backward()
        return loss

    opt.step(closure)
    assert [e for e, _ in events[6:]] == ["pre", "post"], "hooks around a closure step"

    pre_handle.remove()
    post_handle.remove()
    opt.step()
    assert len(events) == 8, "removed hooks still fire"


@pytest.mark.parametrize("name", ALL)
def test_global_step_hooks_fire_once_per_step(name, tiny_model, batches):
    opt = make(name, tiny_model)
    calls = []
    pre = register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("pre", o)))
    post = register_optimizer_step_post_hook(lambda o, a, k: calls.append(("post", o)))
    try:
        for batch in batches[:3]:
            opt.zero_grad()
            model_loss(tiny_model, batch).backward()
            opt.step()
    finally:
        pre.remove()
        post.remove()
    assert [c for c, _ in calls] == ["pre", "post"] * 3
    assert all(o is opt for _, o in calls)


def test_grad_scaler_is_enabled_on_cpu():
    """The GradScaler tests below rely on this; if torch ever disables it on CPU they would
    test nothing, so this fails instead of letting them pass vacuously."""
    assert torch.amp.GradScaler("cpu").is_enabled()


@pytest.mark.parametrize("name", ALL)
def test_grad_scaler_skips_steps_with_inf(name, batches):
    """Steps whose scaled grads hold inf are skipped: params and state untouched, no state
    created by a skipped first step, scale backed off; the others follow the reference
    under its own scaler."""
    model, ref_model = TinyModel(), TinyModel()
    opt = make(name, model)
    ref = REFERENCE[name](ref_model.parameters(), **HYPER[name])
    kwargs = dict(init_scale=2.0 ** 10, growth_interval=1000)
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    ref_scaler = torch.amp.GradScaler("cpu", **kwargs)
    params, ref_params = list(model.parameters()), list(ref_model.parameters())
    scale = TrajectoryScale(ref_params)
    skip_at = {0, 3}
    for t, batch in enumerate(batches[:6]):
        for m, o, s in ((model, opt, scaler), (ref_model, ref, ref_scaler)):
            o.zero_grad()
            s.scale(model_loss(m, batch)).backward()
            if t in skip_at:
                m.fc1.weight.grad[1, 2] = float("inf")
        before_params = [p.detach().clone() for p in params]
        before_state = state_tensors(opt)
        before_scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        ref_scaler.step(ref)
        ref_scaler.update()
        if t in skip_at:
            assert scaler.get_scale() == before_scale * 0.5, "scale not reduced after inf"
            for i, (p, b) in enumerate(zip(params, before_params)):
                assert torch.equal(p.detach(), b), f"step {t + 1} skipped but param {i} moved"
            after_state = state_tensors(opt)
            assert after_state.keys() == before_state.keys()
            for k in after_state:
                assert torch.equal(after_state[k], before_state[k]), f"state {k} changed"
            if t == 0:
                assert len(opt.state) == 0, "a skipped first step created state"
        else:
            assert scaler.get_scale() == before_scale
            assert any(not torch.equal(p.detach(), b) for p, b in zip(params, before_params))
        scale.update(ref_params)
        assert_params_close(params, ref_params, scale, FP32_TOL,
                            f"{name} under GradScaler after step {t + 1}")


@pytest.mark.parametrize("release_grads", [False, True])
def test_a_step_inside_cuda_graph_capture_is_refused_before_anything_changes(
        monkeypatch, release_grads, batches):
    # What torch reports while a stream captures; a real capture is in test_cuda_step.py.
    model = TinyModel()
    before = [p.detach().clone() for p in model.parameters()]
    opt = OURS["AdamW"](model.parameters(), lr=1e-2, release_grads=release_grads)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA graph"):
        model_loss(model, batches[0]).backward()
        opt.step()
    assert all(torch.equal(p, old) for p, old in zip(model.parameters(), before))
    assert not opt.state or all(not s for s in opt.state.values())


def test_a_step_that_raises_drops_what_grad_scaler_handed_over(monkeypatch):
    # GradScaler.step sets grad_scale / found_inf, calls step() and deletes them after it
    # returns; left after a raise, the retry's scaler.step() multiplies the old scale into the
    # new one (torch/amp/grad_scaler.py), dividing the gradients by the scale twice.
    model = TinyModel()
    opt = OURS["AdamW"](model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)

    def failing_step(*args, **kwargs):  # a page that cannot be read, say
        raise OSError("the page file is gone")

    monkeypatch.setattr(opt, "_step_params", failing_step)
    opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(0.0)
    with pytest.raises(OSError, match="page file"):
        opt.step()
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
