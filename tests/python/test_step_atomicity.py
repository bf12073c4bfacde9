"""Steps are all or nothing from the caller's view (docs/reliability.md, "Steps that fail").

A step that raises part way (a read that keeps failing, Ctrl-C at a batch boundary) is
finished by calling step() again with the same gradients: params and every bit of state
then equal those of a run that never failed, and keep equalling them as training goes on.
Each test injects the failure at every page (or batch boundary) of one step in turn.
"""

import errno

import pytest
import torch

import pagedoptim as po
from pagedoptim import paging

PAGE = 4096
CACHE_PAGES = 3
FAILING_STEP = 2
STEPS = 5


def adamw(params, **kw):
    return po.AdamW(params, lr=1e-2, weight_decay=0.1, **kw)


def sgd(params, **kw):
    return po.SGD(params, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3, **kw)


def lion(params, **kw):
    return po.Lion(params, lr=1e-3, weight_decay=0.1, **kw)


def skewadam(params, **kw):
    return po.SkewAdam(params, lr=1e-2, **kw)


# name: (optimizer, its options, param shapes, dtype). Each has 10-40 pages of state; the
# (17, 61) shape is a transposed view: stepped on a contiguous copy and copied back.
CONFIGS = {
    "adamw-fp32": (adamw, dict(state_bits=32, master_bits=None),
                   [(5000,), (17, 61), (5,), (4000,)], torch.float32),
    "adamw-8bit": (adamw, dict(state_bits=8),
                   [(12000,), (17, 61), (5,), (9000,)], torch.float32),
    "adamw-bf16-master": (adamw, dict(state_bits=8, master_bits=24),
                          [(9000,), (17, 61), (5,), (7000,)], torch.bfloat16),
    "sgd-momentum": (sgd, dict(state_bits=32, master_bits=None),
                     [(8000,), (17, 61), (5,), (6000,)], torch.float32),
    "lion": (lion, dict(state_bits=32, master_bits=None),
             [(8000,), (17, 61), (5,), (6000,)], torch.float32),
    "skewadam": (skewadam, dict(state_bits=32, master_bits=None),
                 [(64, 96), (17, 61), (5,), (2, 40, 48), (3000,)], torch.float32),
}
# Larger twins for the simulated device, whose device cache sits on 16 host bounce buffers
# above the page file: a page is read from the file only past those.
SIMULATED = {
    f"{name}-large": (*CONFIGS[name][:2], shapes, CONFIGS[name][3])
    for name, shapes in [("adamw-fp32", [(12000,), (17, 61), (5,), (9000,)]),
                         ("sgd-momentum", [(16000,), (17, 61), (5,), (12000,)]),
                         ("skewadam", [(128, 192), (17, 61), (5,), (2, 40, 48), (8000,)])]
}
SKEWADAM_NAMES = ["layers.0.w", "layers.0.v", "layers.0.b", "layers.0.experts.w",
                  "layers.0.gate.bias"]


def config(name):
    return CONFIGS[name] if name in CONFIGS else SIMULATED[name]


def make_params(name):
    _, _, shapes, dtype = config(name)
    g = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        if shape == (17, 61):
            value = torch.randn(61, 17, generator=g).t()  # not contiguous
        else:
            value = torch.randn(shape, generator=g)
        params.append(value.to(dtype).requires_grad_())
    return params


def grads_for(params, index):
    g = torch.Generator().manual_seed(1000 + index)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


def set_grads(params, index):
    for p, grad in zip(params, grads_for(params, index)):
        p.grad = grad


def build(name, params, **paging_kw):
    make, options, _, _ = config(name)
    given = list(zip(SKEWADAM_NAMES, params)) if make is skewadam else params
    return make(given, page_bytes=PAGE, **options, **paging_kw)


def paged(name, params, tmp_path):
    """An nvme-paged optimizer over a 3-page cache whose page file takes injected faults."""
    with paging.store_overrides(faults=[]):
        opt = build(name, params, offload="nvme", nvme_dir=tmp_path,
                    cache_bytes=CACHE_PAGES * PAGE, prefetch=1)
        opt.state_store.ensure_engine()
    return opt


def snapshot(params, opt):
    state = opt.state_dict()["state"]
    return ([p.detach().clone() for p in params],
            {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for i, s in state.items()})


def assert_equal(snap, other):
    (params_a, state_a), (params_b, state_b) = snap, other
    for i, (p, q) in enumerate(zip(params_a, params_b)):
        assert torch.equal(p, q), f"param {i}"
    assert state_a.keys() == state_b.keys()
    for i in state_a:
        assert state_a[i].keys() == state_b[i].keys()
        for key, value in state_a[i].items():
            assert torch.equal(value, state_b[i][key]), (i, key)


_references = {}


def reference(name):
    """Snapshots of an unpaged run that never fails, after FAILING_STEP and after STEPS."""
    if name not in _references:
        params = make_params(name)
        opt = build(name, params)
        snaps = {}
        for index in range(STEPS):
            set_grads(params, index)
            opt.step()
            if index in (FAILING_STEP, STEPS - 1):
                snaps[index] = snapshot(params, opt)
        _references[name] = snaps
    return _references[name]


def before_failing_step(name, tmp_path):
    """A paged optimizer stepped up to FAILING_STEP, whose gradients are set; its params."""
    params = make_params(name)
    opt = paged(name, params, tmp_path)
    for index in range(FAILING_STEP):
        set_grads(params, index)
        opt.step()
    set_grads(params, FAILING_STEP)
    return params, opt


def run_with_failure(name, tmp_path, fail):
    """Steps a paged optimizer; `fail(opt)` arms a failure before step FAILING_STEP and
    returns the exception type it causes. Retries that step, then checks it and the steps
    after it against the reference. Returns whether the step raised."""
    ref = reference(name)
    params, opt = before_failing_step(name, tmp_path)
    expected = fail(opt)
    raised = False
    try:
        opt.step()
    except expected:
        raised = True
    paging.set_fault_rules(opt, [])
    if raised:
        journal = opt.interrupted_step
        assert journal is not None and journal["resumable"]
        # (<=: SkewAdam's running means are written after the pages of its plan.)
        assert 0 <= journal["pages_done"] <= journal["pages"]
        opt.step()  # the retry: the same gradients
        assert opt.interrupted_step is None
    assert_equal(snapshot(params, opt), ref[FAILING_STEP])
    for index in range(FAILING_STEP + 1, STEPS):
        set_grads(params, index)
        opt.step()
    assert_equal(snapshot(params, opt), ref[STEPS - 1])
    return raised


def num_pages(name, tmp_path):
    """(pages of the state, pages of a step's plan, pages pinned per batch)."""
    params = make_params(name)
    opt = paged(name, params, tmp_path)
    set_grads(params, 0)
    paging.sigint_before_batch(opt, 1)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    pages, pin_limit = opt.memory_report()["num_pages"], opt.paging_stats()["pin_limit"]
    plan = opt.interrupted_step["pages"]
    assert 10 <= plan <= pages <= 48, (plan, pages)
    return pages, plan, pin_limit


def failing_read_of(page):
    """A read of `page` that fails every time (past the pager's retries) until cleared."""
    def arm(opt):
        paging.set_fault_rules(opt, [{"kind": "eio", "ops": "read",
                                      "offset_begin": page * PAGE,
                                      "offset_end": (page + 1) * PAGE}])
        return po.PageIOError
    return arm


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_read_failing_at_any_page_is_finished_exactly_by_a_retry(name, tmp_path):
    pages, _, _ = num_pages(name, tmp_path)
    raised = sum(run_with_failure(name, tmp_path, failing_read_of(page))
                 for page in range(pages))
    # A page still resident from the step before is not read, so it cannot fail; every
    # other one must have made the step raise.
    assert raised >= pages - CACHE_PAGES


@pytest.mark.parametrize("name", list(SIMULATED))
def test_a_read_failure_under_the_simulated_device_cache_is_finished_by_a_retry(name, tmp_path):
    with paging.simulated_device():
        pages, _, _ = num_pages(name, tmp_path)
        raised = sum(run_with_failure(name, tmp_path, failing_read_of(page))
                     for page in range(0, pages, 5))
    # The first pages of a step are still in the bounce buffers; the later ones are read.
    assert raised >= 2


def step_counters(opt, params):
    """Each param's step counter (SGD keeps its own out of the state_dict), read without
    touching a page."""
    states = [opt.state[p] for p in params]
    return [float(s["step"]) if s.hidden_step() is None else s.hidden_step() for s in states]


@pytest.mark.parametrize("name", list(SIMULATED))
def test_a_step_failing_before_its_first_kernel_advances_its_counters_once_on_retry(name, tmp_path):
    """On a device the step counters advance with the step's first kernel: a step whose first
    batch cannot be pinned has changed nothing, and its retry must advance them (a retry that
    took them as advanced left them one behind, and made a first AdamW step NaN; the C++
    journal tests show that first step)."""
    ref = reference(name)
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    with paging.simulated_device():
        params, stepped = before_failing_step(name, tmp_path / "first")
        # A second optimizer over the same params, loaded from the first: loading writes
        # every page, so the first pages of the next plan are back in the page file.
        opt = paged(name, params, tmp_path / "second")
        with paging.store_overrides(faults=[]):  # loading builds the state anew
            opt.load_state_dict(stepped.state_dict())
        counters = step_counters(opt, params)
        paging.set_fault_rules(opt, [{"kind": "eio", "ops": "read"}])
        with pytest.raises(po.PageIOError):
            opt.step()
        assert opt.interrupted_step["pages_done"] == 0
        # SkewAdam's statistics kernels run before the first batch is pinned: its counters
        # advanced with them, and the retry must leave them there.
        ran_a_kernel = name.startswith("skewadam")
        assert step_counters(opt, params) == [c + ran_a_kernel for c in counters]
        paging.set_fault_rules(opt, [])
        opt.step()
        assert_equal(snapshot(params, opt), ref[FAILING_STEP])
        for index in range(FAILING_STEP + 1, STEPS):
            set_grads(params, index)
            opt.step()
        assert_equal(snapshot(params, opt), ref[STEPS - 1])


def sigint_before(batch):
    def arm(opt):
        paging.sigint_before_batch(opt, batch)
        return KeyboardInterrupt
    return arm


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ctrl_c_at_any_batch_boundary_is_finished_exactly_by_a_retry(name, tmp_path):
    _, plan, pin_limit = num_pages(name, tmp_path)
    batches = -(-plan // pin_limit)
    assert batches >= 3
    for batch in range(1, batches):
        assert run_with_failure(name, tmp_path, sigint_before(batch))


def interrupted(name, tmp_path, page=None):
    """A paged optimizer whose step FAILING_STEP raised at a read of `page` (default: a
    page past the cache), faults cleared; its params."""
    params, opt = before_failing_step(name, tmp_path)
    pages = opt.memory_report()["num_pages"]
    failing_read_of(pages // 2 if page is None else page)(opt)
    with pytest.raises(po.PageIOError):
        opt.step()
    paging.set_fault_rules(opt, [])
    return params, opt


@pytest.mark.parametrize("change", ["new grads", "grad accumulated in place", "lr"])
def test_a_step_that_is_not_a_retry_is_refused_with_the_ways_out(change, tmp_path):
    params, opt = interrupted("adamw-8bit", tmp_path)
    journal = opt.interrupted_step
    before = snapshot(params, opt)
    if change == "new grads":
        set_grads(params, FAILING_STEP + 1)
    elif change == "grad accumulated in place":
        params[0].grad.add_(1.0)
    else:
        opt.param_groups[0]["lr"] = 5e-3
    with pytest.raises(po.InterruptedStepError) as info:
        opt.step()
    message = str(info.value)
    assert (f"interrupted after {journal['pages_done']} of {journal['pages']} pages"
            in message)
    assert "PageIOError" in message
    assert "same gradients" in message and "discard_interrupted_step()" in message
    assert "checkpoint" in message
    assert_equal(snapshot(params, opt), before)  # refused: nothing changed
    assert opt.interrupted_step == journal


def test_discard_keeps_the_half_step_and_goes_on(tmp_path):
    """discard_interrupted_step() accepts the step as it is: the optimizer continues exactly
    like one loaded from a checkpoint taken right after the failure."""
    name = "adamw-8bit"
    params, opt = interrupted(name, tmp_path)
    checkpoint = opt.state_dict()
    twin_params = [p.detach().clone().requires_grad_() for p in params]
    twin = build(name, twin_params)
    twin.load_state_dict(checkpoint)
    assert twin.interrupted_step is None
    opt.discard_interrupted_step()
    assert opt.interrupted_step is None
    opt.discard_interrupted_step()  # nothing to discard: no-op
    for index in range(FAILING_STEP + 1, STEPS):
        for o, ps in ((opt, params), (twin, twin_params)):
            set_grads(ps, index)
            o.step()
    assert_equal(snapshot(params, opt), snapshot(twin_params, twin))


def test_state_dict_of_an_interrupted_step_shows_it_half_applied(tmp_path):
    """state_dict() after a failure is the state as it is: the step counters advanced, the
    pages before the failure stepped. Taking it changes nothing: the retry still finishes
    the step exactly, and the checkpoint loads into an optimizer with no step to finish."""
    name = "adamw-8bit"
    ref = reference(name)
    params, opt = interrupted(name, tmp_path)
    saved = opt.state_dict()
    assert all(float(s["step"]) == FAILING_STEP + 1 for s in saved["state"].values())
    half = snapshot(params, opt)
    with pytest.raises(AssertionError):
        assert_equal(half, ref[FAILING_STEP])  # some pages were not stepped yet
    loaded_params = [p.detach().clone().requires_grad_() for p in params]
    loaded = paged(name, loaded_params, tmp_path)
    loaded.load_state_dict(saved)
    assert loaded.interrupted_step is None
    set_grads(loaded_params, FAILING_STEP + 1)
    loaded.step()  # a new step, not refused
    opt.step()
    assert_equal(snapshot(params, opt), ref[FAILING_STEP])


def test_a_step_failing_again_on_retry_is_finished_by_the_next_retry(tmp_path):
    name = "adamw-fp32"
    ref = reference(name)
    params, opt = interrupted(name, tmp_path, page=4)
    first = opt.interrupted_step["pages_done"]
    pages = opt.memory_report()["num_pages"]
    failing_read_of(pages - 2)(opt)
    with pytest.raises(po.PageIOError):
        opt.step()
    assert opt.interrupted_step["pages_done"] >= first
    paging.set_fault_rules(opt, [])
    opt.step()
    assert_equal(snapshot(params, opt), ref[FAILING_STEP])


def test_a_closed_or_reloaded_optimizer_forgets_the_interrupted_step(tmp_path):
    params, opt = interrupted("adamw-8bit", tmp_path)
    opt.load_state_dict(opt.state_dict())
    assert opt.interrupted_step is None
    set_grads(params, FAILING_STEP + 1)
    opt.step()  # a new step
    opt.close()


def test_a_failed_write_back_step_is_not_applied_twice_by_a_retry(tmp_path):
    """A failed write-back surfaces after the whole step ran: the step is complete, so a
    retry with the same gradients does nothing, and a new step is not refused."""
    name = "adamw-fp32"
    ref = reference(name)
    params, opt = before_failing_step(name, tmp_path)
    paging.set_fault_rules(opt, [{"kind": "eio", "ops": "write"}])
    with pytest.raises(po.PageIOError) as info:
        opt.step()
    assert info.value.errno == errno.EIO
    assert opt.interrupted_step is None  # nothing left to finish
    opt.step()  # the retry
    assert_equal(snapshot(params, opt), ref[FAILING_STEP])
    paging.set_fault_rules(opt, [])
    for index in range(FAILING_STEP + 1, STEPS):
        set_grads(params, index)
        opt.step()
    assert_equal(snapshot(params, opt), ref[STEPS - 1])
