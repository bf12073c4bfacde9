"""torch.optim's contract at its edges, against torch's own optimizers wherever torch defines
the behaviour: state-dict hooks, optimizer.state[p], torch's keyword arguments and group keys,
edge cases, gradient release that never silently changes training, and PEFT-sized state.

Exact mode (state_bits=32, master_bits=None) matches torch.optim.AdamW to fp32 rounding and
SGD bit for bit, so exact mode is what compares states with torch's.
"""

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

import pagedoptim as po
from pagedoptim.state.param_state import StaleStateWriteError
from support import FP32_TOL, relative_error

EXACT = dict(state_bits=32, master_bits=None)


def make_pair(shape=(6, 5), seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    value = torch.randn(shape, generator=gen, dtype=dtype)
    return nn.Parameter(value.clone()), nn.Parameter(value.clone())


def set_grads(params, step, dtype=None):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=dtype or p.dtype)


def run_both(ours, theirs, ours_params, torch_params, steps, start=0):
    for step in range(start, start + steps):
        set_grads(ours_params, step)
        set_grads(torch_params, step)
        ours.step()
        theirs.step()


def assert_close(a, b, what):
    a, b = a.detach(), b.detach()
    err = relative_error(a, b, b.abs().max().item() or 1.0)
    assert err <= FP32_TOL, f"{what}: relative error {err}"


# -- 1. state-dict hooks ---------------------------------------------------------------------

def test_state_dict_post_hook_sees_and_controls_the_moments_as_torch_does():
    p, q = make_pair()
    ours, theirs = po.AdamW([p], **EXACT), torch.optim.AdamW([q])
    run_both(ours, theirs, [p], [q], 2)
    seen = {}

    def hook(name):
        def post_hook(optimizer, state_dict):
            seen[name] = sorted(state_dict["state"][0])
            state_dict["state"][0]["exp_avg"] = state_dict["state"][0]["exp_avg"] * 0 + 7
            return state_dict
        return post_hook

    ours.register_state_dict_post_hook(hook("ours"))
    theirs.register_state_dict_post_hook(hook("torch"))
    assert seen == {} and ours.state_dict()["state"][0]["exp_avg"].eq(7).all()
    assert theirs.state_dict()["state"][0]["exp_avg"].eq(7).all()
    assert seen["ours"] == seen["torch"] == ["exp_avg", "exp_avg_sq", "step"]


def test_state_dict_pre_hook_runs_before_the_state_is_gathered():
    p, _ = make_pair()
    ours = po.AdamW([p], **EXACT)
    set_grads([p], 0)
    ours.step()
    ours.register_state_dict_pre_hook(lambda opt: opt.state[p]["exp_avg"].fill_(3.0))
    assert ours.state_dict()["state"][0]["exp_avg"].eq(3.0).all()


def test_non_param_keys_in_state_survive_state_dict_and_load_as_in_torch():
    p, q = make_pair()
    ours, theirs = po.AdamW([p], **EXACT), torch.optim.AdamW([q])
    run_both(ours, theirs, [p], [q], 1)
    for opt in (ours, theirs):
        opt.state["global_counter"] = 3
    saved_ours, saved_torch = ours.state_dict(), theirs.state_dict()
    assert saved_ours["state"]["global_counter"] == saved_torch["state"]["global_counter"] == 3
    fresh = po.AdamW([make_pair()[0]], **EXACT)
    fresh.load_state_dict(saved_ours)
    assert fresh.state["global_counter"] == 3


def test_load_pre_hook_edits_take_effect_as_in_torch():
    p, q = make_pair()
    ours, theirs = po.AdamW([p], **EXACT), torch.optim.AdamW([q])
    run_both(ours, theirs, [p], [q], 2)
    saved_ours, saved_torch = ours.state_dict(), theirs.state_dict()
    original = saved_torch["state"][0]["exp_avg"].clone()

    def double_exp_avg(optimizer, state_dict):
        state_dict["state"][0]["exp_avg"] = state_dict["state"][0]["exp_avg"] * 2
        return state_dict

    p2, q2 = nn.Parameter(p.detach().clone()), nn.Parameter(q.detach().clone())
    ours2, theirs2 = po.AdamW([p2], **EXACT), torch.optim.AdamW([q2])
    ours2.register_load_state_dict_pre_hook(double_exp_avg)
    theirs2.register_load_state_dict_pre_hook(double_exp_avg)
    ours2.load_state_dict(saved_ours)
    theirs2.load_state_dict(saved_torch)
    assert_close(ours2.state[p2]["exp_avg"], theirs2.state[q2]["exp_avg"], "loaded exp_avg")
    assert_close(ours2.state[p2]["exp_avg"], 2 * original, "doubled")
    run_both(ours2, theirs2, [p2], [q2], 2, start=2)
    assert_close(p2, q2, "params after the edited load")


def test_load_post_hook_runs_after_the_load_and_sees_the_loaded_state():
    p, _ = make_pair()
    ours = po.AdamW([p], **EXACT)
    set_grads([p], 0)
    ours.step()
    saved = ours.state_dict()
    p2, _ = make_pair(seed=1)
    ours2 = po.AdamW([p2], **EXACT)
    set_grads([p2], 5)
    ours2.step()
    inside = {}
    ours2.register_load_state_dict_post_hook(
        lambda opt: inside.update(opt.state_dict()["state"][0]))
    ours2.load_state_dict(saved)
    assert torch.equal(inside["exp_avg"], saved["state"][0]["exp_avg"])


def test_a_bad_state_dict_changes_nothing():
    p, _ = make_pair()
    ours = po.AdamW([p], **EXACT)
    set_grads([p], 0)
    ours.step()
    before = ours.state_dict()
    bad = copy.deepcopy(before)
    bad["state"][0]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match="exp_avg"):
        ours.load_state_dict(bad)
    after = ours.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for key in before["state"][0]:
        assert torch.equal(after["state"][0][key], before["state"][0][key]), key


# -- 2. optimizer.state[p] -------------------------------------------------------------------

def test_state_of_a_param_holds_the_moments_torch_holds():
    p, q = make_pair()
    ours, theirs = po.AdamW([p], **EXACT, amsgrad=True), torch.optim.AdamW([q], amsgrad=True)
    run_both(ours, theirs, [p], [q], 3)
    assert sorted(ours.state[p]) == sorted(theirs.state[q])
    for key in theirs.state[q]:
        assert_close(ours.state[p][key], theirs.state[q][key], key)


def test_8bit_state_lists_stored_streams_and_reads_fp32_moments():
    p, q = make_pair(shape=(64, 64))  # 4096 elements: 8-bit moments by default
    ours, theirs = po.AdamW([p]), torch.optim.AdamW([q])
    run_both(ours, theirs, [p], [q], 3)
    state = ours.state[p]
    assert set(state) == {"step", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes",
                          "exp_avg_sq_scales"}
    assert "exp_avg" in state and state["exp_avg"].dtype == torch.float32
    # companded to 8 bits: close to torch's moment, not equal
    reference = theirs.state[q]["exp_avg"]
    err = relative_error(state["exp_avg"], reference, reference.abs().max().item())
    assert 0 < err < 0.05, err


@pytest.mark.parametrize("how", ["in_place", "assignment"])
def test_writes_to_state_take_effect_as_in_torch(how):
    p, q = make_pair()
    ours, theirs = po.AdamW([p], **EXACT), torch.optim.AdamW([q])
    run_both(ours, theirs, [p], [q], 2)
    for opt, param in ((ours, p), (theirs, q)):
        if how == "in_place":
            opt.state[param]["exp_avg"].mul_(-3.0)
            opt.state[param]["exp_avg_sq"].add_(1.0)
        else:
            opt.state[param]["exp_avg"] = opt.state[param]["exp_avg"] * -3.0
    assert_close(ours.state[p]["exp_avg"], theirs.state[q]["exp_avg"], "written exp_avg")
    run_both(ours, theirs, [p], [q], 2, start=2)
    assert_close(p, q, "params after the write")
    assert_close(ours.state[p]["exp_avg_sq"], theirs.state[q]["exp_avg_sq"], "exp_avg_sq")


def test_8bit_fp32_name_writes_are_encoded():
    p, _ = make_pair(shape=(64, 64))
    ours = po.AdamW([p])
    set_grads([p], 0)
    ours.step()
    ours.state[p]["exp_avg"] = torch.zeros(64, 64)
    assert ours.state[p]["exp_avg"].eq(0).all()
    assert ours.state_dict()["state"][0]["exp_avg_scales"].eq(0).all()


def test_a_write_to_a_copy_made_stale_by_a_step_raises_instead_of_being_lost():
    p, _ = make_pair()
    ours = po.AdamW([p], **EXACT)
    set_grads([p], 0)
    ours.step()
    old = ours.state[p]["exp_avg"]
    set_grads([p], 1)
    ours.step()
    old.zero_()
    set_grads([p], 2)
    with pytest.raises(StaleStateWriteError, match="exp_avg"):
        ours.step()
    ours.step()  # said once; the state itself is intact
    assert not ours.state[p]["exp_avg"].eq(0).all()


def test_wrong_writes_raise_with_the_key():
    p, _ = make_pair()
    ours = po.AdamW([p], **EXACT)
    set_grads([p], 0)
    ours.step()
    with pytest.raises(ValueError, match="exp_avg"):
        ours.state[p]["exp_avg"] = torch.zeros(3)
    with pytest.raises(TypeError, match="exp_avg"):
        ours.state[p]["exp_avg"] = 1.0
    with pytest.raises(ValueError, match="exp_avg_codes"):
        ours.state[p]["exp_avg_codes"] = torch.zeros(30, dtype=torch.int8)
    with pytest.raises(KeyError, match="exp_avg"):
        del ours.state[p]["exp_avg"]


def test_deleting_a_params_state_resets_it_as_in_torch():
    p, q = make_pair()
    ours, theirs = po.AdamW([p], **EXACT), torch.optim.AdamW([q])
    run_both(ours, theirs, [p], [q], 3)
    del ours.state[p]
    del theirs.state[q]
    assert p not in ours.state
    run_both(ours, theirs, [p], [q], 2, start=3)
    assert float(ours.state[p]["step"]) == float(theirs.state[q]["step"]) == 2.0
    assert_close(p, q, "params after the reset")


def test_copies_and_pickles_keep_state_and_plain_entries():
    p, _ = make_pair()
    ours = po.SGD([p], lr=0.1, momentum=0.9, **EXACT)
    set_grads([p], 0)
    ours.step()
    ours.state[p]["note"] = "kept"
    for clone in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        q = clone.param_groups[0]["params"][0]
        assert clone.state[q]["note"] == "kept"
        assert torch.equal(clone.state[q]["momentum_buffer"], ours.state[p]["momentum_buffer"])
        set_grads([q], 1)
        clone.step()  # continues from the copied buffer (and hidden step)


# -- 3. torch's keyword arguments and group keys -----------------------------------------------

@pytest.mark.parametrize("ours_cls,torch_cls", [(po.AdamW, torch.optim.AdamW),
                                                (po.SGD, torch.optim.SGD)])
def test_groups_carry_torchs_keys(ours_cls, torch_cls):
    ours = ours_cls([make_pair()[0]], lr=0.1, foreach=False, fused=True)
    theirs = torch_cls([make_pair()[0]], lr=0.1)
    assert set(ours.param_groups[0]) == set(theirs.param_groups[0])
    assert ours.param_groups[0]["fused"] is None and ours.param_groups[0]["foreach"] is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(capturable=True), "capturable=True is not supported"),
    (dict(differentiable=True), "differentiable=True is not supported"),
    (dict(fused=True, foreach=True), "`fused` and `foreach` cannot be `True` together"),
    (dict(foreach="yes"), "foreach must be a bool or None"),
])
def test_flags_that_cannot_hold_raise(kwargs, match):
    with pytest.raises((ValueError, RuntimeError, TypeError), match=match):
        po.AdamW([make_pair()[0]], **kwargs)


def test_state_dict_round_trips_through_torch_unchanged():
    p, q = make_pair()
    ours = po.AdamW([p], lr=0.01, weight_decay=0.1, **EXACT)
    set_grads([p], 0)
    ours.step()
    saved = ours.state_dict()
    theirs = torch.optim.AdamW([q])
    theirs.load_state_dict(saved)
    through_torch = theirs.state_dict()
    assert through_torch["param_groups"] == saved["param_groups"]
    back = po.AdamW([make_pair()[0]], **EXACT)
    back.load_state_dict(through_torch)
    assert back.state_dict()["param_groups"] == saved["param_groups"]
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(back.state_dict()["state"][0][key], saved["state"][0][key]), key


def test_a_fused_torch_state_dict_leaves_no_misleading_flag():
    q = make_pair()[1]
    theirs = torch.optim.AdamW([q], fused=True)
    set_grads([q], 0)
    theirs.step()
    ours = po.AdamW([make_pair()[0]], **EXACT)
    ours.load_state_dict(theirs.state_dict())
    assert ours.param_groups[0]["fused"] is None
    assert ours.param_groups[0]["capturable"] is False


def test_torch_adam_with_l2_weight_decay_is_not_taken_for_adamw():
    q = make_pair()[1]
    theirs = torch.optim.Adam([q], weight_decay=0.1)
    set_grads([q], 0)
    theirs.step()
    ours = po.AdamW([make_pair()[0]], **EXACT)
    with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
        ours.load_state_dict(theirs.state_dict())


# -- 4. edge cases ---------------------------------------------------------------------------

def test_duplicate_params_in_a_group_warn_and_step_as_in_torch():
    p, q = make_pair()
    with warnings.catch_warnings(record=True) as ours_warnings:
        warnings.simplefilter("always")
        ours = po.AdamW([p, p], **EXACT)
    with warnings.catch_warnings(record=True) as torch_warnings:
        warnings.simplefilter("always")
        theirs = torch.optim.AdamW([q, q])
    assert [str(w.message) for w in ours_warnings] == [str(w.message) for w in torch_warnings]
    run_both(ours, theirs, [p], [q], 3)
    assert float(ours.state[p]["step"]) == float(theirs.state[q]["step"]) == 6.0
    assert_close(p, q, "params stepped twice per step")


@pytest.mark.parametrize("ours_cls,torch_cls,kwargs", [
    (po.AdamW, torch.optim.AdamW, dict(lr=0.01)),
    (po.SGD, torch.optim.SGD, dict(lr=0.01, momentum=0.9, nesterov=True)),
])
def test_complex_params_step_as_in_torch(ours_cls, torch_cls, kwargs):
    p, q = make_pair(shape=(7, 3), dtype=torch.complex64)
    ours, theirs = ours_cls([p], **kwargs, **EXACT), torch_cls([q], **kwargs)
    run_both(ours, theirs, [p], [q], 4)
    assert_close(torch.view_as_real(p), torch.view_as_real(q), "complex params")
    for key, value in theirs.state[q].items():
        assert ours.state[p][key].dtype == value.dtype, key
        assert_close(torch.view_as_real(ours.state[p][key]) if value.is_complex()
                     else ours.state[p][key],
                     torch.view_as_real(value) if value.is_complex() else value, key)
    resumed = torch_cls([nn.Parameter(q.detach().clone())], **kwargs)
    resumed.load_state_dict(ours.state_dict())  # torch reads our complex state


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_takes_sparse_gradients_as_torch_does(momentum):
    ours_emb, torch_emb = nn.Embedding(10, 4, sparse=True), nn.Embedding(10, 4, sparse=True)
    torch_emb.load_state_dict(ours_emb.state_dict())
    ours = po.SGD(ours_emb.parameters(), lr=0.1, momentum=momentum, **EXACT)
    theirs = torch.optim.SGD(torch_emb.parameters(), lr=0.1, momentum=momentum)
    for step in range(3):
        ids = torch.tensor([step, step + 1, 7])
        for emb, opt in ((ours_emb, ours), (torch_emb, theirs)):
            opt.zero_grad()
            emb(ids).pow(2).sum().backward()
            assert emb.weight.grad.is_sparse
            opt.step()
    assert torch.equal(ours_emb.weight, torch_emb.weight)


def test_sgd_with_weight_decay_refuses_sparse_gradients_as_torch_does():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = po.SGD(emb.parameters(), lr=0.1, weight_decay=0.1)
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_sgd_state_holds_what_torchs_holds():
    p, q = make_pair()
    ours = po.SGD([p], lr=0.1, momentum=0.9, **EXACT)
    theirs = torch.optim.SGD([q], lr=0.1, momentum=0.9)
    run_both(ours, theirs, [p], [q], 2)
    assert set(ours.state[p]) == set(theirs.state[q]) == {"momentum_buffer"}
    assert set(ours.state_dict()["state"][0]) == set(theirs.state_dict()["state"][0])
    plain_p, plain_q = make_pair()
    ours, theirs = po.SGD([plain_p], lr=0.1, **EXACT), torch.optim.SGD([plain_q], lr=0.1)
    run_both(ours, theirs, [plain_p], [plain_q], 1)
    assert ours.state_dict()["state"] == theirs.state_dict()["state"] == {}


@pytest.mark.parametrize("kwargs", [
    dict(lr=-1.0), dict(eps=-1.0), dict(weight_decay=-1.0), dict(betas=(1.0, 0.99)),
    dict(betas=(0.9, -0.1)), dict(betas=(0.9, torch.tensor(0.99))),
    dict(lr=torch.tensor([0.1, 0.2])),
])
def test_adamw_errors_say_what_torchs_say(kwargs):
    with pytest.raises(ValueError) as torch_info:
        torch.optim.AdamW([make_pair()[1]], **kwargs)
    with pytest.raises(ValueError) as ours_info:
        po.AdamW([make_pair()[0]], **kwargs)
    assert str(ours_info.value).startswith(str(torch_info.value)), (
        str(ours_info.value), str(torch_info.value))


@pytest.mark.parametrize("kwargs", [dict(lr=-0.1), dict(momentum=-1.0),
                                    dict(weight_decay=-1.0)])
def test_sgd_errors_say_what_torchs_say(kwargs):
    kwargs = {"lr": 0.1, **kwargs}
    with pytest.raises(ValueError) as torch_info:
        torch.optim.SGD([make_pair()[1]], **kwargs)
    with pytest.raises(ValueError) as ours_info:
        po.SGD([make_pair()[0]], **kwargs)
    assert str(ours_info.value).startswith(str(torch_info.value)), (
        str(ours_info.value), str(torch_info.value))


# -- 8. gradient release never silently changes training ---------------------------------------

def released_model():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = po.AdamW(model.parameters(), release_grads=True)
    return model, opt


def test_clipping_released_gradients_is_torchs_clip_of_the_same_gradients():
    """clip_grad_norm_ of released params returns the norm torch returns for the same
    gradients in p.grad (and the step clips them by it); what cannot be kept exact raises:
    clip_grad_value_, another norm_type, a second clip of the same gradients."""
    def run(release):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        opt = po.AdamW(model.parameters(), release_grads=release)
        model(torch.randn(3, 4)).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if release:
            with pytest.raises(RuntimeError, match="clip_grad_value_.*release_grads=True"):
                torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=0.5)
            with pytest.raises(ValueError, match="norm_type=inf"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=float("inf"))
            with pytest.raises(RuntimeError, match="called twice"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return model, norm
    model, norm = run(False)
    released, released_norm = run(True)
    assert torch.equal(released_norm, norm) and float(norm) > 0.5
    for p, q in zip(released.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_clipping_other_params_is_torchs_own():
    released_model()
    other = nn.Linear(3, 3)
    other(torch.randn(2, 3)).pow(2).sum().backward()
    reference = [p.grad.clone() for p in other.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(other.parameters(), 0.1)
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in reference]))
    assert torch.allclose(norm, expected)
    assert torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in other.parameters()])) <= 0.1 + 1e-6


def test_released_steps_refuse_data_parallel_runs(monkeypatch):
    model, opt = released_model()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="data parallelism.*register_ddp"):
        model(torch.randn(3, 4)).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# -- 9. PEFT-sized state -----------------------------------------------------------------------

def payload_bytes(opt):
    report = opt.memory_report()
    return report["moment_bytes"] + report["scale_bytes"] + report["residual_bytes"]


def test_lora_sized_state_costs_its_payload_plus_at_most_a_page():
    # Rank 32: the B matrices' rows are whole groups. (Rows shorter than 32 take a whole
    # group's page slot each: docs/compression.md, benchmarks/row_groups.py.)
    params = [nn.Parameter(torch.randn(32, 64)), nn.Parameter(torch.randn(64, 32)),
              nn.Parameter(torch.randn(32, 96)), nn.Parameter(torch.randn(96, 32))]
    assert sum(p.numel() for p in params) == 10240
    opt = po.AdamW(params, min_8bit_size=0)  # 8-bit moments, as a LoRA on 4096 wide gets
    set_grads(params, 0)
    opt.step()
    report = opt.memory_report()
    assert report["state_bytes"] - report["step_bytes"] - payload_bytes(opt) < 4096
    assert report["state_bytes_per_param"] < 4.0  # was 585 B/param with 2 MiB pages


def test_an_optimizer_per_param_does_not_cost_a_big_page_each():
    params = [nn.Parameter(torch.randn(n)) for n in (5, 100, 3000)]
    for p in params:
        opt = po.AdamW([p], **EXACT)
        set_grads([p], 0)
        opt.step()
        report = opt.memory_report()
        assert report["page_bytes"] == 4096 * -(-(8 * p.numel() + 64) // 4096)
        assert report["state_bytes"] - report["step_bytes"] - payload_bytes(opt) < 4096


def test_paged_state_chooses_pages_that_fit_the_cache():
    params = [nn.Parameter(torch.randn(200_000))]
    opt = po.AdamW(params, offload="host", cache_bytes=256 << 10)
    set_grads(params, 0)
    opt.step()
    assert opt.memory_report()["page_bytes"] == 32 << 10
    fixed = po.AdamW([nn.Parameter(torch.randn(100))], page_bytes=8192)
    set_grads(fixed.param_groups[0]["params"], 0)
    fixed.step()
    assert fixed.memory_report()["page_bytes"] == 8192


@pytest.mark.parametrize("kwargs,match", [
    (dict(offload="host", cache_bytes=100), "cache_bytes=100 must hold at least one page"),
    (dict(offload="nvme", cache_bytes=8192, page_bytes=16384),
     "cache_bytes=8192 must hold at least one page"),
])
def test_a_cache_below_one_page_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        po.AdamW([make_pair()[0]], **kwargs)


def _ddp_release_worker(rank, world_size, init_file, results):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
        opt = po.AdamW(model.parameters(), release_grads=True)
        before = [p.detach().clone() for p in model.parameters()]
        message = ""
        try:
            model(torch.randn(3, 4) + rank).sum().backward()
        except RuntimeError as error:
            message = str(error)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        results.put((rank, message, unchanged, len(opt.state)))
    finally:
        dist.destroy_process_group()


def test_release_grads_under_ddp_raises_on_every_rank(tmp_path):
    """Two gloo ranks under DDP: the released step would use the gradient from before the
    all-reduce, so the first backward raises on each rank and no param changes."""
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    torch.multiprocessing.start_processes(_ddp_release_worker,
                                          args=(2, str(tmp_path / "init"), results),
                                          nprocs=2, join=True, start_method="spawn")
    outcomes = sorted(results.get(timeout=60) for _ in range(2))
    for rank, message, unchanged, num_states in outcomes:
        assert "data parallelism" in message, (rank, message)
        assert unchanged and num_states == 0, rank


# -- what a review found -------------------------------------------------------------------

@pytest.mark.parametrize("when", ["before_the_first_step", "replacing_the_entry"])
def test_sgd_steps_from_a_momentum_buffer_written_through_state_as_torch(when):
    p, q = make_pair()
    ours = po.SGD([p], lr=0.1, momentum=0.9, **EXACT)
    theirs = torch.optim.SGD([q], lr=0.1, momentum=0.9)
    if when == "replacing_the_entry":
        run_both(ours, theirs, [p], [q], 3)
        ours.state[p] = dict(ours.state[p])
        theirs.state[q] = dict(theirs.state[q])
    else:
        ours.state[p]["momentum_buffer"] = torch.full(p.shape, 10.0)
        theirs.state[q]["momentum_buffer"] = torch.full(q.shape, 10.0)
    run_both(ours, theirs, [p], [q], 2, start=3)
    assert torch.equal(ours.state[p]["momentum_buffer"], theirs.state[q]["momentum_buffer"])
    assert torch.equal(p, q)


def test_state_dict_steps_are_snapshots_and_loads_copy_them():
    p, q = make_pair()
    theirs = torch.optim.AdamW([q])
    set_grads([q], 0)
    theirs.step()
    ours = po.AdamW([p], **EXACT)
    ours.load_state_dict(theirs.state_dict())
    saved = ours.state_dict()
    set_grads([p], 1)
    ours.step()
    assert float(theirs.state[q]["step"]) == 1.0  # the torch optimizer is left as it was
    assert float(saved["state"][0]["step"]) == 1.0  # the snapshot too
    assert float(ours.state[p]["step"]) == 2.0


def test_a_copy_read_before_a_load_is_stale_after_it():
    p, _ = make_pair()
    ours = po.AdamW([p], **EXACT)
    set_grads([p], 0)
    ours.step()
    saved = ours.state_dict()
    old = ours.state[p]["exp_avg"]
    ours.load_state_dict(saved)
    old.fill_(123.0)
    with pytest.raises(StaleStateWriteError, match="a load"):
        ours.step()


def _stepped_report(params, **kwargs):
    opt = po.AdamW(params, min_8bit_size=0, **kwargs)
    set_grads(params, 0)
    opt.step()
    return opt.memory_report()


@pytest.mark.parametrize("kwargs", [
    dict(), dict(amsgrad=True), dict(weight_decay=0.0)])
@pytest.mark.parametrize("state_bits", [8, 32])
def test_pages_chosen_for_the_state_hold_all_of_it(kwargs, state_bits):
    """choose_page_bytes lays pages out as the native geometry does (stream alignment
    included): a state of one kind under 2 MiB fits one page, exactly; a state of two kinds
    (fp32 params, bf16 params with a residual) costs no more pages and bytes than one page
    per kind sized for the larger would. The params are 2-D with rows of 9 and more, so that
    each dtype is one kind (1-D params and shorter rows keep fp32 moments, a kind of their
    own)."""
    gen = torch.Generator().manual_seed(state_bits)
    charge = po.paging.PAGE_OVERHEAD_CHARGE
    for trial in range(5):
        shapes = [(int(torch.randint(1, 300, (1,), generator=gen)),
                   int(torch.randint(9, 300, (1,), generator=gen)))
                  for _ in range(int(torch.randint(2, 9, (1,), generator=gen)))]
        params = [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s, dtype in
                  zip(shapes, [torch.float32, torch.bfloat16] * 5)]
        one_kind = [_stepped_report([p.detach().clone().requires_grad_() for p in params
                                     if p.dtype == dtype], state_bits=state_bits, **kwargs)
                    for dtype in (torch.float32, torch.bfloat16)]
        assert [r["num_pages"] for r in one_kind] == [1, 1], shapes
        both = _stepped_report(params, state_bits=state_bits, **kwargs)
        one_page_each = 2 * (max(r["page_bytes"] for r in one_kind) + charge)
        assert both["num_pages"] * (both["page_bytes"] + charge) <= one_page_each, shapes
        assert both["page_slack_bytes"] < both["num_pages"] * both["page_bytes"]


def test_small_tiers_of_skewadam_share_a_page_size_that_fits_them():
    """A tiny MoE model (as examples/moe_skewadam.py builds): the router's and the experts'
    factored state is a fraction of the backbone's. One page per page kind sized for the
    largest (the rule before) left 59% of these pages as slack; the chosen size, 24% in 54%
    of the bytes, and
    at most the pages and bytes of any smaller size."""
    backbone = [torch.randn(256, 64)] + [torch.randn(128, 64) for _ in range(4)]
    tiers = [("backbone", backbone), ("experts", [torch.randn(8, 128, 64)]),
             ("router", [torch.randn(8, 64)])]

    def stepped(**kwargs):
        opt = po.SkewAdam([{"params": [nn.Parameter(t.clone()) for t in tensors], "tier": tier}
                           for tier, tensors in tiers], min_8bit_size=0, **kwargs)
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.ones_like(p)
        opt.step()
        report = opt.memory_report()
        kinds = opt.state_store.stream_kinds()
        return report, len({kind for kind, *_ in opt.state_store.planned_state()
                            if kinds[kind]})

    charge = po.paging.PAGE_OVERHEAD_CHARGE
    chosen, kinds_in_use = stepped()
    cost = chosen["num_pages"] * (chosen["page_bytes"] + charge)
    one_page_per_kind = None
    for page in range(4096, 1 << 20, 4096):
        report, _ = stepped(page_bytes=page)
        if page < chosen["page_bytes"]:
            assert report["num_pages"] * (page + charge) >= cost, page
        if report["num_pages"] <= kinds_in_use:
            one_page_per_kind = report
            break
    assert (chosen["num_pages"] * chosen["page_bytes"]
            < 0.6 * one_page_per_kind["num_pages"] * one_page_per_kind["page_bytes"])
    assert chosen["page_slack_bytes"] < 0.3 * chosen["num_pages"] * chosen["page_bytes"]
    assert one_page_per_kind["page_slack_bytes"] > 0.5 * (one_page_per_kind["num_pages"]
                                                          * one_page_per_kind["page_bytes"])


@pytest.mark.parametrize("numel,dtype,master_bits", [
    (301 * 32, torch.float32, None),   # fits 20 KiB without the streams' alignment, not with
    (81 * 32, torch.bfloat16, 24),     # the same at 8 KiB
    (31 * 32, torch.bfloat16, 32),     # and at 4 KiB
])
def test_pages_chosen_for_the_state_count_the_streams_alignment(numel, dtype, master_bits):
    p = nn.Parameter(torch.randn(numel).to(dtype))
    opt = po.AdamW([p], master_bits=master_bits)
    set_grads([p], 0)
    opt.step()
    assert opt.memory_report()["num_pages"] == 1


def test_a_whole_state_entry_that_cannot_be_written_leaves_the_state_as_it_was():
    p, q = make_pair()
    ours = po.AdamW([p], lr=0.1, **EXACT)
    theirs = torch.optim.AdamW([q], lr=0.1)
    run_both(ours, theirs, [p], [q], 2)
    before = {k: v.clone() for k, v in ours.state[p].items()}
    with pytest.raises(ValueError, match="'exp_avg' has 3 elements"):
        ours.state[p] = {"step": torch.tensor(5.0), "exp_avg": torch.zeros(3),
                         "exp_avg_sq": torch.zeros(p.shape)}
    assert set(ours.state[p]) == set(before)
    assert all(torch.equal(ours.state[p][k], v) for k, v in before.items())
    run_both(ours, theirs, [p], [q], 2, start=2)  # and it goes on as torch's does
    assert torch.equal(ours.state[p]["exp_avg"], theirs.state[q]["exp_avg"])


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.AdamW(params, lr=1e-2),
    lambda params: po.AdamW(params, lr=1e-2),
    lambda params: po.AdamW(params, lr=1e-2, offload="host", page_bytes=4096, cache_bytes=4096),
    lambda params: po.SGD(params, lr=1e-2, momentum=0.9),
    lambda params: po.Lion(params, lr=1e-3),
], ids=["torch", "adamw", "adamw-paged", "sgd", "lion"])
def test_a_graph_that_saved_a_param_refuses_backward_after_a_step_as_torch_does(make):
    # The kernels write through the params' pointers; autograd must still learn of it, or a
    # backward through a graph built before the step uses the new values silently.
    p = nn.Parameter(torch.randn(300))
    opt = make([p])
    version = p._version
    saved_p = (p * p).sum()  # saves p for its backward
    p.grad = torch.randn(300)
    opt.step()
    assert p._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved_p.backward()
