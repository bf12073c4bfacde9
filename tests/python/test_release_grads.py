"""release_grads=True: each parameter is stepped inside backward by a post-accumulate-grad hook
and its gradient freed. The step math is the same kernel on the same per-parameter state, so
the result must equal the ordinary path (backward, then step()) bit for bit, for every
optimizer and every state_bits / master_bits setting. Where the mode cannot work (gradient
accumulation across backward calls, step(closure), GradScaler) it must raise."""

import pytest
import torch
from torch import nn

import pagedoptim as po

STEPS = 4
OPTIMIZERS = {
    "AdamW": (po.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "AdamW-amsgrad": (po.AdamW, dict(lr=1e-2, amsgrad=True, maximize=True)),
    "SGD": (po.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
    "Lion": (po.Lion, dict(lr=1e-3, weight_decay=0.1)),
}
SETTINGS = [(8, 24), (8, 32), (8, None), (32, 24), (32, None)]


class Net(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(50, 24)
        self.hidden = nn.Linear(24, 40)
        self.out = nn.Linear(40, 50)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        self.to(dtype)

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens))))


def batch(step):
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, 50, (16,), generator=gen), torch.randint(0, 50, (16,), generator=gen)


def loss_of(model, step):
    tokens, targets = batch(step)
    return nn.functional.cross_entropy(model(tokens).float(), targets)


def train(case, dtype, state_bits, master_bits, release):
    cls, hyper = OPTIMIZERS[case]
    model = Net(dtype)
    opt = cls(model.parameters(), **hyper, state_bits=state_bits, master_bits=master_bits,
              release_grads=release)
    for step in range(STEPS):
        loss_of(model, step).backward()
        if release:
            assert all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("state_bits,master_bits", SETTINGS,
                         ids=[f"state{s}-master{m}" for s, m in SETTINGS])
@pytest.mark.parametrize("case", list(OPTIMIZERS))
def test_release_grads_matches_the_step_path_bit_for_bit(case, state_bits, master_bits, dtype):
    ours, opt = train(case, dtype, state_bits, master_bits, release=True)
    ref, ref_opt = train(case, dtype, state_bits, master_bits, release=False)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), name
    sd, ref_sd = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert sd.keys() == ref_sd.keys()
    for i in sd:
        assert sd[i].keys() == ref_sd[i].keys()
        for key in sd[i]:
            assert torch.equal(sd[i][key], ref_sd[i][key]), (i, key)


def live_grad_peak(release):
    """Largest number of params holding a gradient at any point of one backward, seen from a
    hook registered before the optimizer's (it runs first, right after accumulation)."""
    model = Net(torch.float32)
    params = list(model.parameters())
    peak = [0]

    def count(_):
        peak[0] = max(peak[0], sum(p.grad is not None for p in params))

    for p in params:
        p.register_post_accumulate_grad_hook(count)
    opt = po.AdamW(params, lr=1e-3, release_grads=release)
    loss_of(model, 0).backward()
    opt.step()
    return peak[0], len(params)


def test_at_most_one_gradient_is_alive_during_backward():
    peak, num_params = live_grad_peak(release=True)
    assert peak == 1
    peak_plain, _ = live_grad_peak(release=False)
    assert peak_plain == num_params


def test_grads_are_none_and_state_exists_after_backward():
    model = Net(torch.bfloat16)
    opt = po.AdamW(model.parameters(), lr=1e-3, release_grads=True)
    before = [p.detach().clone() for p in model.parameters()]
    loss_of(model, 0).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert all(opt.state[p]["step"].item() == 1.0 for p in model.parameters())
    opt.step()


def test_second_backward_without_step_raises():
    model = Net(torch.float32)
    opt = po.AdamW(model.parameters(), lr=1e-3, release_grads=True)
    loss_of(model, 0).backward()
    with pytest.raises(RuntimeError, match="accumulate"):
        loss_of(model, 1).backward()
    opt.step()
    loss_of(model, 2).backward()  # a new round after step() works again
    opt.step()


def test_step_with_closure_raises():
    model = Net(torch.float32)
    opt = po.AdamW(model.parameters(), lr=1e-3, release_grads=True)

    def closure():
        loss = loss_of(model, 0)
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="closure"):
        opt.step(closure)


class CheckpointedNet(Net):
    """Every param inside a reentrant activation checkpoint, as in the usual QLoRA setup:
    its gradients come from an inner backward, a graph task of its own."""

    def forward(self, tokens):
        import torch.utils.checkpoint as checkpoint
        hidden = self.embed(tokens)
        hidden = checkpoint.checkpoint(lambda h: torch.tanh(self.hidden(h)), hidden,
                                       use_reentrant=True)
        return checkpoint.checkpoint(self.out, hidden, use_reentrant=True)


@pytest.mark.parametrize("net", [Net, CheckpointedNet], ids=["plain", "reentrant-checkpoint"])
def test_grad_scaler_is_refused_before_any_param_changes(net):
    model = net(torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    opt = po.AdamW(model.parameters(), lr=1e-3, release_grads=True)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(RuntimeError, match="GradScaler.*Nothing was stepped"):
        scaler.scale(loss_of(model, 0)).backward()
    for p, old in zip(model.parameters(), before):
        assert torch.equal(p, old)
    # The refusal belongs to that backward: one from an unscaled loss releases as usual.
    opt.zero_grad()
    loss_of(model, 1).backward()
    opt.step()
    assert any(not torch.equal(p, old) for p, old in zip(model.parameters(), before))



def _released_steps(model, opt, first, count):
    for step in range(first, first + count):
        loss_of(model, step).backward()
        opt.step()


def test_a_deleted_release_optimizer_is_collected_and_a_new_one_on_the_same_params_steps():
    """The hooks hold their optimizer weakly. Before, a deleted optimizer lived on through
    its params' hooks, stepped them with its old lr inside every backward and freed their
    gradients, so a new optimizer on the same params never stepped."""
    import gc
    import weakref
    model = Net(torch.float32)
    old = po.AdamW(model.parameters(), lr=1e-2, release_grads=True)
    _released_steps(model, old, 0, 2)
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None

    twin = Net(torch.float32)
    twin.load_state_dict(model.state_dict())
    new = po.AdamW(model.parameters(), lr=5e-2, release_grads=True)
    fresh = po.AdamW(twin.parameters(), lr=5e-2, release_grads=True)
    _released_steps(model, new, 2, 2)
    _released_steps(twin, fresh, 2, 2)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    assert all(int(new.state[p]["step"]) == 2 for p in model.parameters())


def test_a_newer_release_optimizer_takes_the_params_of_a_live_one_and_says_so():
    model = Net(torch.float32)
    old = po.AdamW(model.parameters(), lr=1e-2, release_grads=True)
    _released_steps(model, old, 0, 1)
    with pytest.warns(RuntimeWarning, match="takes over releasing the gradients"):
        new = po.AdamW(model.parameters(), lr=1e-2, release_grads=True)
    _released_steps(model, new, 1, 1)
    assert all(int(old.state[p]["step"]) == 1 for p in model.parameters())  # not stepped again
    assert all(int(new.state[p]["step"]) == 1 for p in model.parameters())
    new.close()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        po.AdamW(model.parameters(), lr=1e-2, release_grads=True)  # a closed one lets go


def test_a_param_unfrozen_after_construction_is_stepped_from_then_on():
    """It had no release hook: its gradient grew over the steps and it never moved. Now
    step() steps it (as the ordinary path would) and hooks it, so later backwards release
    it. Checked against the same run without release, bit for bit."""
    def run(release):
        model = Net(torch.float32)
        model.hidden.weight.requires_grad_(False)
        opt = po.AdamW(model.parameters(), lr=1e-2, release_grads=release,
                       state_bits=32, master_bits=None)
        for step in range(4):
            if step == 1:
                model.hidden.weight.requires_grad_(True)
            loss_of(model, step).backward()
            opt.step()
            opt.zero_grad()
        return model, opt
    released, opt = run(True)
    plain, _ = run(False)
    assert int(opt.state[released.hidden.weight]["step"]) == 3
    for (name, p), q in zip(released.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    assert released.hidden.weight.grad is None


def test_zero_grad_ends_the_round_so_a_backward_that_raised_can_be_retried():
    """A backward that raises midway (an out-of-memory error; Trainer's auto_find_batch_size
    retries) leaves the params it had stepped stepped. The retry after zero_grad() runs;
    without zero_grad the error says to call it."""
    model = Net(torch.float32)
    opt = po.AdamW(model.parameters(), lr=1e-2, release_grads=True)
    calls = []

    def out_of_memory_on_the_second(grad):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return grad
    handle = model.embed.weight.register_hook(out_of_memory_on_the_second)
    with pytest.raises(torch.OutOfMemoryError):
        loss_of(model, 0).backward()
    stepped = [name for name, p in model.named_parameters() if p in opt.state]
    assert stepped and len(stepped) < len(list(model.parameters()))  # half applied
    with pytest.raises(RuntimeError, match="call zero_grad\\(\\) before retrying"):
        loss_of(model, 0).backward()
    opt.zero_grad()
    loss_of(model, 0).backward()
    opt.step()
    handle.remove()
    assert all(p.grad is None for p in model.parameters())
