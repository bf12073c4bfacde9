"""release_grads=True: each gradient goes into a gradient stream of the param's pages as soon as
autograd has produced it (a post-accumulate-grad hook) and p.grad is freed; step() steps from
the streams. The step math is the same kernel on the same per-parameter state and the same
gradient, so the result must equal the ordinary path (backward, then step()) bit for bit, for
every optimizer and every state_bits / master_bits setting. Where the mode cannot work
(step(closure)) it must raise. Clipping, accumulation, AMP, DDP and Trainer:
test_release_exact.py."""

import os

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


def test_grads_are_none_and_no_param_moves_before_step():
    model = Net(torch.bfloat16)
    opt = po.AdamW(model.parameters(), lr=1e-3, release_grads=True)
    before = [p.detach().clone() for p in model.parameters()]
    loss_of(model, 0).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    opt.step()
    assert all(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert all(opt.state[p]["step"].item() == 1.0 for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradients_accumulate_over_backward_calls_as_p_grad_does(dtype):
    """Three backward calls, then step(): the streams sum the gradients in the param's dtype,
    in the order p.grad would, so the step is the one the ordinary path takes."""
    def run(release):
        model = Net(dtype)
        opt = po.AdamW(model.parameters(), lr=1e-2, release_grads=release)
        for step in range(3):
            for micro in range(3):
                loss_of(model, 10 * step + micro).backward()
            opt.step()
            opt.zero_grad()
        return model, opt
    released, opt = run(True)
    plain, ref = run(False)
    for (name, p), q in zip(released.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    assert all(int(opt.state[p]["step"]) == 3 for p in released.parameters())


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
def test_grad_scaler_sees_released_gradients_also_from_reentrant_checkpoints(net):
    """The scaled loss marks its backward, and the mark reaches the inner backward calls of
    reentrant checkpoints: their releases are unscaled and checked for infs as p.grad would
    be, so the run equals the one without release (more in test_release_exact.py)."""
    def run(release):
        model = net(torch.float32)
        opt = po.AdamW(model.parameters(), lr=1e-3, release_grads=release)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=1)
        overflow = [True]  # the first step's gradient of the output layer overflows
        model.out.weight.register_hook(
            lambda grad: grad * float("inf") if overflow[0] else grad)
        scales = []
        for step in range(4):
            scaler.scale(loss_of(model, step)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            overflow[0] = False
            opt.zero_grad()
        return model, scales
    released, scales = run(True)
    plain, plain_scales = run(False)
    assert scales == plain_scales
    assert scales == [2.0 ** 15, 2.0 ** 16, 2.0 ** 17, 2.0 ** 18]  # the first step skipped
    for (name, p), q in zip(released.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name


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


def test_a_backward_that_raised_midway_changes_no_param_and_zero_grad_drops_its_gradients():
    """A backward that raises midway (an out-of-memory error; Trainer's auto_find_batch_size
    retries) has only released some gradients into their streams: no param moved. As with
    p.grad, zero_grad() drops them, and the retry trains exactly as a run that never failed."""
    def run(fail):
        model = Net(torch.float32)
        opt = po.AdamW(model.parameters(), lr=1e-2, release_grads=True)
        before = [p.detach().clone() for p in model.parameters()]
        if fail:
            def out_of_memory(grad):
                raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
            handle = model.embed.weight.register_hook(out_of_memory)
            with pytest.raises(torch.OutOfMemoryError):
                loss_of(model, 0).backward()
            handle.remove()
            assert opt.state_store.engine is None  # nothing was stepped
            for p, old in zip(model.parameters(), before):
                assert torch.equal(p, old)
            opt.zero_grad()
        for step in range(2):
            loss_of(model, step).backward()
            opt.step()
            opt.zero_grad()
        return model
    for (name, p), q in zip(run(True).named_parameters(), run(False).parameters()):
        assert torch.equal(p, q), name


def test_a_param_shared_by_two_reentrant_checkpoints_is_released_twice_and_summed():
    """transformers' default activation checkpointing is reentrant: a param used in two
    checkpointed blocks gets two gradients from two inner backward calls, and its hook fires
    twice. The stream sums both, as p.grad does; the step equals the ordinary path's."""
    import torch.utils.checkpoint as checkpoint

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.embed = nn.Embedding(50, 24)
            self.block = nn.Linear(24, 24)  # used by both checkpointed blocks
            self.out = nn.Linear(24, 50)

        def forward(self, tokens):
            hidden = self.embed(tokens)
            for _ in range(2):
                hidden = checkpoint.checkpoint(lambda h: torch.tanh(self.block(h)), hidden,
                                               use_reentrant=True)
            return self.out(hidden)

    def run(release):
        model = Shared()
        opt = po.AdamW(model.parameters(), lr=1e-2, release_grads=release, max_grad_norm=0.5)
        calls = []
        model.block.weight.register_post_accumulate_grad_hook(lambda p: calls.append(1))
        for step in range(3):
            loss_of(model, step).backward()
            opt.step()
            opt.zero_grad()
        return model, opt, len(calls)
    released, opt, calls = run(True)
    plain, ref, _ = run(False)
    assert calls == 6  # two per backward
    for (name, p), q in zip(released.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(opt.last_grad_norm, ref.last_grad_norm)


def test_the_gradient_streams_page_like_the_state_and_are_reported(tmp_path):
    """With offload="nvme" the gradient streams go to a page file of their own in nvme_dir,
    behind a cache of a few pages; memory_report() and paging_stats() say so."""
    model = Net(torch.float32)
    opt = po.AdamW(model.parameters(), release_grads=True, offload="nvme",
                   nvme_dir=str(tmp_path), page_bytes=4096, cache_bytes=4 * 4096)
    assert opt.paging_stats()["grad_streams"] is None  # nothing released yet
    for step in range(2):
        loss_of(model, step).backward()
    report = opt.memory_report()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert report["grad_bytes"] == 0  # nothing in p.grad
    assert grad_bytes <= report["grad_stream_bytes"] < grad_bytes + 4096 * 4
    assert report["grad_stream_placement"]["nvme"] == report["grad_stream_bytes"]
    stats = opt.paging_stats()["grad_streams"]
    assert stats["offload"] == "nvme" and stats["cache_bytes"] == 4 * 4096
    assert stats["bytes_written"]["nvme"] > 0 and stats["bytes_read"]["nvme"] > 0
    assert os.path.dirname(stats["page_file"]).startswith(str(tmp_path))
    opt.step()

    def open_page_files():  # the page file is unlinked once open: its descriptor holds it
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # the descriptor listdir itself used
                continue
            if target.startswith(stats["page_file"]):
                found.append(target)
        return found
    assert open_page_files()
    opt.close()  # the gradient streams' page file goes with the state's
    assert not open_page_files()


def test_a_clip_grad_norm_bound_before_the_optimizer_raises_rather_than_leave_gradients_out():
    """`from torch.nn.utils import clip_grad_norm_` before the first release optimizer
    exists binds torch's function, which never sees released gradients: its norm would
    leave them out and it would clip nothing. It raises instead, before clipping."""
    import subprocess
    import sys
    script = (
        "import torch\n"
        "from torch.nn.utils import clip_grad_norm_\n"
        "import pagedoptim as po\n"
        "model = torch.nn.Linear(4, 3)\n"
        "opt = po.AdamW(model.parameters(), release_grads=True)\n"
        "model(torch.randn(2, 4)).sum().backward()\n"
        "try:\n"
        "    clip_grad_norm_(model.parameters(), 1.0)\n"
        "except RuntimeError as error:\n"
        "    print('refused:', error)\n"
        "try:\n"
        "    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, torch.tensor(2.0))\n"
        "except RuntimeError as error:\n"
        "    print('refused public:', error)\n"
        "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "opt.step()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    assert "refused: gradients released by release_grads=True reached torch's clipping" \
        in done.stdout
    assert "refused public: gradients released" in done.stdout


def _zero_grad_loop(release, set_to_none, module):
    model = Net(torch.float32)
    opt = po.AdamW(model.parameters(), lr=1e-2, release_grads=release, max_grad_norm=0.5)
    frozen_after_first = model.hidden
    for step in range(4):
        if step == 1:  # from now on no gradient: zero_grad(False) leaves it zeros, stepped
            frozen_after_first.requires_grad_(False)
        loss_of(model, step).backward()
        opt.step()
        (model if module else opt).zero_grad(set_to_none=set_to_none)
    return model, opt


@pytest.mark.parametrize("module", [False, True], ids=["optimizer", "module"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_empties_or_zeroes_the_streams_as_it_does_p_grad(set_to_none, module):
    """optimizer.zero_grad() and a module's zero_grad() (HF Trainer's) act on the streams as
    on p.grad: set_to_none=False leaves zero gradients, with which the params whose
    gradients stopped coming are still stepped (weight decay, moments), as without release."""
    released, opt = _zero_grad_loop(True, set_to_none, module)
    plain, ref = _zero_grad_loop(False, set_to_none, module)
    for (name, p), q in zip(released.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    assert int(opt.state[released.hidden.weight]["step"]) == (4 if not set_to_none else 1)
    assert torch.equal(opt.last_grad_norm, ref.last_grad_norm)


def test_a_module_zero_grad_drops_a_backward_that_raised():
    """Trainer's auto_find_batch_size retries a batch after an out-of-memory error with
    model.zero_grad(): the gradients the failed backward had released are dropped."""
    def run(fail):
        model = Net(torch.float32)
        opt = po.AdamW(model.parameters(), lr=1e-2, release_grads=True)
        if fail:
            handle = model.embed.weight.register_hook(
                lambda grad: (_ for _ in ()).throw(torch.OutOfMemoryError("stand-in")))
            with pytest.raises(torch.OutOfMemoryError):
                loss_of(model, 0).backward()
            handle.remove()
            assert opt._release.gradients.filled()  # some were released
            model.zero_grad()
        loss_of(model, 0).backward()
        opt.step()
        return model
    for (name, p), q in zip(run(True).named_parameters(), run(False).parameters()):
        assert torch.equal(p, q), name


def test_a_param_twice_in_a_group_and_in_a_clip_call_is_treated_as_torch_treats_it():
    """torch steps a param given twice in a group twice, and clip_grad_norm_ given a param
    twice counts its norm twice and multiplies its gradient twice: so does release."""
    def run(release):
        model = Net(torch.float32)
        params = list(model.parameters())
        with pytest.warns(UserWarning, match="duplicate"):
            opt = po.AdamW(params + [params[1]], lr=1e-2, release_grads=release)
        norms = []
        for step in range(3):
            loss_of(model, step).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(params + [params[2]], 0.5))
            opt.step()
            opt.zero_grad()
        return model, opt, norms
    released, opt, norms = run(True)
    plain, _, ref_norms = run(False)
    for (name, p), q in zip(released.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    assert all(torch.equal(a, b) for a, b in zip(norms, ref_norms))
    assert int(opt.state[released.hidden.weight]["step"]) == 6  # stepped twice a step


def test_complex_params_sum_their_norms_in_torchs_order():
    """torch groups gradients by dtype before it adds their norms up: a complex64 gradient's
    norm (float32) is added in the complex group, not with the fp32 ones."""
    def run(release, seed):
        gen = torch.Generator().manual_seed(seed)
        params = [nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype))
                  for shape, dtype in [((7, 5), torch.float32), ((6,), torch.complex64),
                                       ((9,), torch.float32), ((4, 3), torch.complex64)]]
        opt = po.AdamW(params, lr=1e-2, release_grads=release)
        sum((p * torch.randn(p.shape, generator=gen, dtype=p.dtype)).abs().sum()
            for p in params).backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 0.1)
        opt.step()
        return params, norm
    for seed in range(40):
        params, norm = run(True, seed)
        ref_params, ref_norm = run(False, seed)
        assert torch.equal(norm, ref_norm), seed
        assert all(torch.equal(p, q) for p, q in zip(params, ref_params)), seed
