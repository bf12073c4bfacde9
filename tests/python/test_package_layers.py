"""The package's compatibility across its own reorganisations: pickles of optimizers written
by the version with flat modules (pagedoptim.adamw, pagedoptim.options, pagedoptim.stand_ins;
tests/python/data/make_old_pickles.py) load and keep training."""

from __future__ import annotations

import pathlib
import pickle

import pytest
import torch

import pagedoptim as po

DATA = pathlib.Path(__file__).resolve().parent / "data"
OLD_PICKLES = sorted(DATA.glob("old_pickle_*.pkl"))


def test_the_old_pickles_are_there():
    assert {p.stem for p in OLD_PICKLES} == {
        "old_pickle_adamw_8bit", "old_pickle_sgd_exact", "old_pickle_lion_paged",
        "old_pickle_skewadam", "old_pickle_patched_adamw"}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("path", OLD_PICKLES, ids=lambda p: p.stem)
def test_an_optimizer_pickled_by_the_flat_layout_loads_and_steps(path):
    opt = pickle.loads(path.read_bytes())
    assert isinstance(opt, po.PagedOptimizer)
    params = [p for group in opt.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in params]
    counted = "step" in opt.state[params[0]]  # torch's SGD keeps no step count, nor do we
    assert not counted or {int(opt.state[p]["step"]) for p in params} == {2}
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert not counted or {int(opt.state[p]["step"]) for p in params} == {3}
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))
