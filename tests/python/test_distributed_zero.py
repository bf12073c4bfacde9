"""ZeRO, optimizer-in-backward and DDP: torch.distributed's wrappers around pagedoptim.

torch's wrappers reach our state through `optimizer.state[p]` (DESIGN.md section 8):
`ZeroRedundancyOptimizer.load_state_dict` assigns `self.optim.state[param] = {...}` for the
params of its rank and never calls the inner optimizer's `load_state_dict`, so a reload is
right only if that assignment lands in the pages. Each run here is two gloo ranks on the CPU
(spawned, file:// rendezvous) with a tiny model; torch.optim.AdamW under the same wrapper is
the oracle where torch defines the result:

- ZeRO save (consolidate_state_dict + state_dict), load into a fresh ZeRO and continue:
  exact mode matches torch.optim.AdamW under ZeRO to fp32 rounding; every mode continues
  bit for bit as the run that was never interrupted, and the loaded state is live, not an
  echo of the checkpoint;
- per-param optimizers (`_apply_optimizer_in_backward`) step as torch's do, and each costs
  its payload plus less than one 4 KiB page, not a 2 MiB page;
- DDP without release_grads keeps the ranks bit-identical.
"""

import copy
import functools
import traceback

import pytest
import torch
from torch import nn

import pagedoptim as po
from pagedoptim.checkpoint import conversion as checkpoint_conversion
from pagedoptim.checkpoint.algorithms import ADAMW
from support import FP32_TOL, max_abs, relative_error
from ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="this torch has no torch.distributed")

EXACT = dict(state_bits=32, master_bits=None)
WORLD_SIZE = 2
SAVE_AT, STEPS = 3, 6
LR = 1e-2
# The seconds a two-rank run may take (start-up dominates: each rank imports torch).
TIMEOUT_S = 120.0

# The tiny model's matrices keep 8-bit moments (below the default min_8bit_size).
EIGHT_BIT = dict(min_8bit_size=0)
# name -> (optimizer class, its kwargs, param dtype, ZeRO's kwargs). torch's is the oracle.
ZERO_CASES = {
    "torch": (torch.optim.AdamW, {}, torch.float32, {}),
    "exact": (po.AdamW, EXACT, torch.float32, {}),
    "8bit": (po.AdamW, EIGHT_BIT, torch.float32, {}),
    "8bit_bf16": (po.AdamW, EIGHT_BIT, torch.bfloat16, {}),  # 8-bit moments, master residual
    # ZeRO's flat buckets make every param a view of one tensor.
    "exact_bucket_view": (po.AdamW, EXACT, torch.float32, dict(parameters_as_bucket_view=True)),
    "lion": (po.Lion, EIGHT_BIT, torch.float32, {}),
    "sgd": (functools.partial(po.SGD, momentum=0.9), EIGHT_BIT, torch.float32, {}),
}
# Paged state, a cache of one page (4 KiB) on each rank, so pages are evicted and read back;
# both ranks' page files go to one directory.
PAGED = dict(offload="nvme", cache_bytes=4096)


def _tiny_model(dtype):
    # Four params of unequal sizes, so ZeRO gives each rank some of them (rank 0 the
    # largest, rank 1 the rest); their state takes several 4 KiB pages.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8)).to(dtype)


def _backward(model, step, rank=0):
    """The same loss on every rank unless `rank` shifts the inputs (DDP's case)."""
    gen = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(5, 32, generator=gen) + rank
    dtype = next(model.parameters()).dtype
    model(inputs.to(dtype)).float().square().mean().backward()


def _two_ranks(tmp_path, function):
    """function(rank, world_size, directory) on two gloo ranks. It returns a dict of named
    runs; they come back as {name: [rank 0's, rank 1's]}."""
    by_rank = run_ranks(function, WORLD_SIZE, str(tmp_path), tmp_path=tmp_path,
                        timeout=TIMEOUT_S)
    return {name: [results[name] for results in by_rank] for name in by_rank[0]}


# -- ZeroRedundancyOptimizer ---------------------------------------------------------------

def _zero(model, case, directory):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    optimizer_class, kwargs, _, zero_kwargs = ZERO_CASES[case.removesuffix("_paged")]
    if case.endswith("_paged"):
        kwargs = {**kwargs, **PAGED, "nvme_dir": directory}
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class,
                                   lr=LR, **kwargs, **zero_kwargs)


def _consolidated(zero):
    """The full state dict on rank 0 (None elsewhere), as a user saves it."""
    zero.consolidate_state_dict(to=0)
    return copy.deepcopy(zero.state_dict()) if torch.distributed.get_rank() == 0 else None


def _train(model, zero, steps):
    for step in steps:
        _backward(model, step)
        zero.step()
        zero.zero_grad()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _zero_case(rank, case, directory):
    """Runs STEPS steps, saving a checkpoint at SAVE_AT. Then resumes from it twice: a fresh
    model and ZeRO load it, and the first ZeRO loads it back (its state is live then). What
    each run ends with, and what the fresh ZeRO holds right after the load."""
    import torch.distributed as dist
    dtype = ZERO_CASES[case.removesuffix("_paged")][2]
    model = _tiny_model(dtype)
    zero = _zero(model, case, directory)
    checkpoint = f"{directory}/{case}.pt"
    _train(model, zero, range(SAVE_AT))
    saved = _consolidated(zero)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": saved}, checkpoint)
    _train(model, zero, range(SAVE_AT, STEPS))
    run = {"saved": saved, "uninterrupted": _consolidated(zero), "params": _params(model)}
    dist.barrier()  # the checkpoint file is complete

    # load_state_dict() changes the state dict it is given: each load reads the file.
    loaded = torch.load(checkpoint, weights_only=True)
    resumed_model = _tiny_model(dtype)
    resumed_model.load_state_dict(loaded["model"])
    resumed = _zero(resumed_model, case, directory)
    resumed.load_state_dict(loaded["optimizer"])
    run["after_load"] = _consolidated(resumed)  # read back from the inner optimizers
    _train(resumed_model, resumed, range(SAVE_AT, STEPS))
    run.update(resumed=_consolidated(resumed), resumed_params=_params(resumed_model))

    loaded = torch.load(checkpoint, weights_only=True)
    model.load_state_dict(loaded["model"])
    zero.load_state_dict(loaded["optimizer"])
    _train(model, zero, range(SAVE_AT, STEPS))
    run.update(rolled_back=_consolidated(zero), rolled_back_params=_params(model))
    if case.endswith("_paged"):
        run["paging_stats"] = zero.optim.paging_stats()
    return run


def _resume_from(rank, directory, saved_by, case):
    """The checkpoint of run `saved_by`, resumed by a fresh ZeRO of `case`: what it holds
    right after the load, and how it ends. torch's optimizer is given the checkpoint in
    torch.optim's format (checkpoint_conversion); ours load any format."""
    loaded = torch.load(f"{directory}/{saved_by}.pt", weights_only=True)
    optimizer_state = loaded["optimizer"]
    if case == "torch" and saved_by != "torch":
        optimizer_state = checkpoint_conversion.to_torch_format(optimizer_state, ADAMW)
    model = _tiny_model(torch.float32)
    model.load_state_dict(loaded["model"])
    zero = _zero(model, case, directory)
    try:
        zero.load_state_dict(optimizer_state)
        error = None
    except Exception:
        error = traceback.format_exc()
    # Both ranks go on, or neither: a rank that skipped a collective would leave the other
    # waiting in it until the collective timeout fails the whole run.
    failed = torch.tensor([error is not None], dtype=torch.int32)
    torch.distributed.all_reduce(failed)
    if failed.item():
        return {"error": error or "the load failed on the other rank"}
    after_load = _consolidated(zero)
    _train(model, zero, range(SAVE_AT, STEPS))
    return {"after_load": after_load, "resumed": _consolidated(zero),
            "resumed_params": _params(model), "error": None}


def _run_of(zero_runs, name):
    """Rank 0's results of a run that may have failed to load its checkpoint."""
    run = zero_runs[name][0]
    assert run.get("error") is None, run["error"]
    return run


ZERO_RUNS = [*ZERO_CASES, "8bit_paged", "exact_paged"]
# A checkpoint resumed in another state format: name -> (the run that saved it, the ZeRO
# case that resumes it).
CROSS_FORMAT_RUNS = {
    "torch_into_exact": ("torch", "exact"),
    "8bit_into_exact": ("8bit", "exact"),
    "8bit_into_torch": ("8bit", "torch"),
    "exact_into_8bit": ("exact", "8bit"),
}


def _zero_cases(rank, world_size, directory):
    runs = {case: _zero_case(rank, case, directory) for case in ZERO_RUNS}
    for name, (saved_by, case) in CROSS_FORMAT_RUNS.items():
        runs[name] = _resume_from(rank, directory, saved_by, case)
    return runs


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """Every ZeRO run, once, on two ranks: {run: [rank 0's results, rank 1's]}."""
    return _two_ranks(tmp_path_factory.mktemp("zero"), _zero_cases)


def _tensors(value, prefix=""):
    """Every tensor in a nested state dict, by path (for bitwise comparison)."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            yield from _tensors(value[key], f"{prefix}/{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{prefix}/{index}")


def assert_bitwise_equal(ours, expected):
    ours, expected = dict(_tensors(ours)), dict(_tensors(expected))
    assert ours.keys() == expected.keys()
    for path, tensor in expected.items():
        assert ours[path].dtype == tensor.dtype and torch.equal(ours[path], tensor), path


def _moments(state_dict):
    return {index: {k: v for k, v in entry.items() if k != "step"}
            for index, entry in state_dict["state"].items()}


@pytest.mark.parametrize("case", ZERO_RUNS)
@pytest.mark.parametrize("how", ["resumed", "rolled_back"])
def test_zero_reload_continues_bit_for_bit_as_the_uninterrupted_run(zero_runs, case, how):
    """Fresh ZeRO and model from the checkpoint (resumed), or the same ZeRO loading it
    back after more steps (rolled_back): every rank ends as the run never interrupted."""
    for rank, run in enumerate(zero_runs[case]):
        assert all(torch.equal(a, b) for a, b in zip(run[f"{how}_params"], run["params"])), \
            rank
    run = zero_runs[case][0]
    if case.endswith("_paged"):
        assert run["paging_stats"]["evictions"] > 0, run["paging_stats"]
    assert_bitwise_equal(run[how]["state"], run["uninterrupted"]["state"])
    assert run[how]["param_groups"] == run["uninterrupted"]["param_groups"]


@pytest.mark.parametrize("case", ZERO_RUNS)
def test_zero_reload_puts_the_checkpoint_into_the_inner_optimizers(zero_runs, case):
    """Consolidated right after the load, the state read back from each rank's inner
    optimizer is the checkpoint: every param's state, moments and all."""
    run = zero_runs[case][0]
    saved, after_load = run["saved"], run["after_load"]
    num_params = sum(len(g["params"]) for g in saved["param_groups"])
    assert sorted(saved["state"]) == list(range(num_params))
    assert all(_moments(saved).values())  # moments, not only 'step'
    assert_bitwise_equal(after_load["state"], saved["state"])
    assert after_load["param_groups"] == saved["param_groups"]


@pytest.mark.parametrize("case,reference", [
    ("exact", "torch"), ("exact_bucket_view", "torch"), ("exact_paged", "torch"),
    ("torch_into_exact", "torch"), ("8bit_into_exact", "8bit_into_torch")])
def test_zero_exact_mode_matches_torch_adamw_under_zero(zero_runs, case, reference):
    """po.AdamW(state_bits=32, master_bits=None) inside ZeRO, saved, reloaded and continued
    (or resuming torch's checkpoint, or an 8-bit one), against torch.optim.AdamW inside
    ZeRO resuming the same checkpoint."""
    ours, theirs = _run_of(zero_runs, case), _run_of(zero_runs, reference)
    for p, ref in zip(ours["resumed_params"], theirs["resumed_params"]):
        assert relative_error(p, ref, max_abs(ref)) <= FP32_TOL
    ours_state, torch_state = ours["resumed"]["state"], theirs["resumed"]["state"]
    assert sorted(ours_state) == sorted(torch_state)
    for index, expected in torch_state.items():
        assert set(ours_state[index]) == set(expected)
        assert torch.equal(ours_state[index]["step"], expected["step"])
        for name in ("exp_avg", "exp_avg_sq"):
            ref = expected[name]
            assert relative_error(ours_state[index][name], ref, max_abs(ref)) <= FP32_TOL, \
                (index, name)



@pytest.mark.parametrize("name", ["8bit_into_exact", "exact_into_8bit"])
def test_zero_reload_converts_a_checkpoint_of_the_other_state_format(zero_runs, name):
    """ZeRO assigns each param's whole entry (`state[p] = {...}`): codes and scales load
    into fp32 state, and fp32 into codes, as the checkpoint converter converts them."""
    saved_by, case = CROSS_FORMAT_RUNS[name]
    saved = zero_runs[saved_by][0]["saved"]
    if case == "exact":
        expected = checkpoint_conversion.to_torch_format(saved, ADAMW)
    else:
        expected = checkpoint_conversion.to_pagedoptim_format(saved, ADAMW, state_bits=8,
                                                              **EIGHT_BIT)
    assert_bitwise_equal(_run_of(zero_runs, name)["after_load"]["state"], expected["state"])


def test_state_entry_assigned_whole_converts_as_load_state_dict():
    """What ZeRO's load relies on, in one process: `state[p] = entry` in another format
    gives the state load_state_dict gives, stream for stream."""
    for saved_kwargs, kwargs in ((EIGHT_BIT, EXACT), (EXACT, EIGHT_BIT)):
        source = _tiny_model(torch.float32)
        saved = po.AdamW(source.parameters(), lr=LR, **saved_kwargs)
        _backward(source, 0)
        saved.step()
        entries = saved.state_dict()
        loaded, assigned = (po.AdamW(_tiny_model(torch.float32).parameters(), lr=LR, **kwargs)
                            for _ in range(2))
        loaded.load_state_dict(copy.deepcopy(entries))
        for index, p in enumerate(assigned.param_groups[0]["params"]):
            assigned.state[p] = entries["state"][index]
        assert_bitwise_equal(assigned.state_dict()["state"], loaded.state_dict()["state"])


# -- optimizer in backward: one optimizer per param ------------------------------------------

def _payload_bytes(report):
    return report["moment_bytes"] + report["scale_bytes"] + report["residual_bytes"]


@pytest.mark.parametrize("mode,dtype", [("exact", torch.float32), ("8bit", torch.float32),
                                        ("8bit", torch.bfloat16)],
                         ids=["exact", "8bit", "8bit_bf16"])
def test_optimizer_in_backward_steps_as_one_optimizer_without_a_page_per_param(mode, dtype):
    """`_apply_optimizer_in_backward` builds one optimizer per param and steps it as the
    param's gradient is accumulated. Exact mode steps as torch.optim.AdamW built the same
    way; 8-bit steps bit for bit as one po.AdamW over every param. Each optimizer's state is
    its payload plus less than one 4 KiB page, not a 2 MiB page per param."""
    from torch.distributed.optim import (_apply_optimizer_in_backward,
                                         _get_in_backward_optimizers)
    kwargs = EXACT if mode == "exact" else EIGHT_BIT
    model = _tiny_model(dtype)
    _apply_optimizer_in_backward(po.AdamW, model.parameters(), {"lr": LR, **kwargs})
    reference = _tiny_model(dtype)
    if mode == "exact":
        _apply_optimizer_in_backward(torch.optim.AdamW, reference.parameters(), {"lr": LR})
        one_optimizer = None
    else:
        one_optimizer = po.AdamW(reference.parameters(), lr=LR, **EIGHT_BIT)
    for step in range(STEPS):
        _backward(model, step)
        _backward(reference, step)
        if one_optimizer is not None:
            one_optimizer.step()
            one_optimizer.zero_grad()
    for p, ref in zip(model.parameters(), reference.parameters()):
        assert p.grad is None
        if mode == "exact":
            assert relative_error(p, ref, max_abs(ref)) <= FP32_TOL
        else:
            assert torch.equal(p, ref)

    optimizers = _get_in_backward_optimizers(model)
    assert len(optimizers) == len(list(model.parameters()))
    for opt in optimizers:
        report = opt.memory_report()
        assert report["num_elements"] == opt.param_groups[0]["params"][0].numel()
        assert report["step_bytes"] == 4
        slack = report["state_bytes"] - report["step_bytes"] - _payload_bytes(report)
        assert 0 <= slack < 4096, report
    if one_optimizer is not None:
        total = sum(_payload_bytes(opt.memory_report()) for opt in optimizers)
        assert total == _payload_bytes(one_optimizer.memory_report())


# -- DDP --------------------------------------------------------------------------------------

# name -> (optimizer class, kwargs); "{directory}" / "{rank}" fill in nvme_dir.
DDP_CASES = {
    "torch": (torch.optim.AdamW, {}),
    "exact": (po.AdamW, EXACT),
    "8bit": (po.AdamW, EIGHT_BIT),
    "8bit_paged_shared_dir": (po.AdamW, dict(PAGED, nvme_dir="{directory}", **EIGHT_BIT)),
    "8bit_paged_dir_per_rank": (po.AdamW, dict(PAGED, nvme_dir="{directory}/rank{rank}",
                                               **EIGHT_BIT)),
    "lion": (po.Lion, EIGHT_BIT),
}


def _ddp_cases(rank, world_size, directory):
    import os
    runs = {}
    for case, (optimizer_class, kwargs) in DDP_CASES.items():
        kwargs = dict(kwargs)
        if "nvme_dir" in kwargs:
            kwargs["nvme_dir"] = kwargs["nvme_dir"].format(directory=directory, rank=rank)
            os.makedirs(kwargs["nvme_dir"], exist_ok=True)
        model = nn.parallel.DistributedDataParallel(_tiny_model(torch.float32))
        opt = optimizer_class(model.parameters(), lr=LR, **kwargs)
        for step in range(STEPS):
            _backward(model, step, rank)  # each rank its own inputs: DDP averages the grads
            opt.step()
            opt.zero_grad()
        runs[case] = {"params": _params(model.module)}
        if "nvme_dir" in kwargs:
            stats = opt.paging_stats()
            runs[case]["page_file"], runs[case]["evictions"] = stats["page_file"], \
                stats["evictions"]
    return runs


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """Every DDP run, once, on two ranks: {run: [rank 0's results, rank 1's]}."""
    return _two_ranks(tmp_path_factory.mktemp("ddp"), _ddp_cases)


@pytest.mark.parametrize("case", list(DDP_CASES))
def test_ddp_without_release_keeps_the_ranks_bit_identical(ddp_runs, case):
    rank0, rank1 = ddp_runs[case]
    initial = _params(_tiny_model(torch.float32))
    assert not any(torch.equal(p, q) for p, q in zip(rank0["params"], initial))
    assert all(torch.equal(p, q) for p, q in zip(rank0["params"], rank1["params"]))


def test_ddp_exact_mode_matches_torch_adamw_under_ddp(ddp_runs):
    for p, ref in zip(ddp_runs["exact"][0]["params"], ddp_runs["torch"][0]["params"]):
        assert relative_error(p, ref, max_abs(ref)) <= FP32_TOL


@pytest.mark.parametrize("case", ["8bit_paged_shared_dir", "8bit_paged_dir_per_rank"])
def test_ddp_paged_state_is_the_unpaged_state_and_each_rank_has_its_page_file(ddp_runs, case):
    runs = ddp_runs[case]
    assert all(run["evictions"] > 0 for run in runs)
    assert runs[0]["page_file"] != runs[1]["page_file"]
    for run, unpaged in zip(runs, ddp_runs["8bit"]):
        assert all(torch.equal(p, q) for p, q in zip(run["params"], unpaged["params"]))
