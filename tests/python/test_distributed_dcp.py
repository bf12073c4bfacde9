"""torch.distributed.checkpoint with pagedoptim's optimizers under FSDP2, on gloo ranks.

A checkpoint is saved with dcp.save after a few steps, and training goes on from it. The
reference for what must follow is the run that never stopped: the saving ranks keep
training after the save, and because every rank sees the same batches, a run on any number
of ranks computes the same gradients (test_distributed_fsdp.py), so a checkpoint loaded on
1 or 2 ranks must continue bit for bit. A checkpoint of another state format loads through
`po.dcp.StateFormatLoadPlanner`, and must continue exactly as an unsharded optimizer that
load_state_dict()-ed the same state does.
"""

from __future__ import annotations

import pytest
import torch

import pagedoptim as po
from ranks import run_ranks
from test_distributed_fsdp import EXACT, full, sharded_and_plain, train

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch was built without torch.distributed")

BEFORE, AFTER = 3, 3


def _optimizer(kind: str, params, nvme_dir: str):
    if kind == "torch":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    # nvme: a cache of one page, so saving and loading go through the page file.
    kwargs = {"8bit": {}, "exact": EXACT, "nvme": dict(offload="nvme", nvme_dir=nvme_dir,
                                                         cache_bytes=1 << 12,
                                                         page_bytes=1 << 12)}[kind]
    return po.AdamW(params, lr=1e-2, weight_decay=0.1, **kwargs)


# name: (the saving optimizer, the loading one, model dtype, DCP's state dict options)
VARIANTS = {
    "8bit": ("8bit", "8bit", torch.float32, {}),
    "exact": ("exact", "exact", torch.float32, {}),
    "bf16-residual": ("8bit", "8bit", torch.bfloat16, {}),
    "nvme": ("nvme", "nvme", torch.float32, {}),
    "flattened": ("8bit", "8bit", torch.float32, {"flatten_optimizer_state_dict": True}),
    "8bit-into-exact": ("8bit", "exact", torch.float32, {}),
    "exact-into-8bit": ("exact", "8bit", torch.float32, {}),
    "torch-into-8bit": ("torch", "8bit", torch.float32, {}),
}


def _options(flags: dict):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(**flags)


def _state_dicts(model, optimizer, flags):
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)
    return {"model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=_options(flags))}


def _save_worker(rank: int, world_size: int, root: str, names: list[str]) -> dict:
    """Trains, saves each variant's checkpoint under root/name, trains on; returns the params
    each loading run must end with."""
    import torch.distributed.checkpoint as dcp
    expected = {}
    for name in names:
        source, target, dtype, flags = VARIANTS[name]
        model, plain = sharded_and_plain(dtype)
        optimizer = _optimizer(source, model.parameters(), root)
        train(model, optimizer, BEFORE, seed=1)
        dcp.save(_state_dicts(model, optimizer, flags), checkpoint_id=f"{root}/{name}")
        if source == target:
            train(model, optimizer, AFTER, seed=2)
            expected[name] = [full(p).detach() for p in model.parameters()]
            continue
        # Another format: as an unsharded optimizer of the target's kind that loads the
        # unsharded source's state_dict.
        unsharded_source = _optimizer(source, plain.parameters(), root)
        train(plain, unsharded_source, BEFORE, seed=1)
        converted = _optimizer(target, plain.parameters(), root)
        converted.load_state_dict(unsharded_source.state_dict())
        train(plain, converted, AFTER, seed=2)
        expected[name] = [p.detach().clone() for p in plain.parameters()]
    return expected


def _load_worker(rank: int, world_size: int, root: str, names: list[str]) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                         set_optimizer_state_dict)
    continued = {}
    for name in names:
        source, target, dtype, flags = VARIANTS[name]
        model, _ = sharded_and_plain(dtype)
        torch.manual_seed(1234)  # a different init: everything must come from the checkpoint
        for p in model.parameters():
            p.data.copy_(torch.randn_like(p))
        optimizer = _optimizer(target, model.parameters(), root)
        state = _state_dicts(model, optimizer, flags)
        planner = po.dcp.StateFormatLoadPlanner() if source != target else None
        dcp.load(state, checkpoint_id=f"{root}/{name}", planner=planner)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=_options(flags))
        train(model, optimizer, AFTER, seed=2)
        continued[name] = [full(p).detach() for p in model.parameters()]
        if target == "nvme":
            continued["nvme-evictions"] = optimizer.paging_stats()["evictions"]
    return continued


def _assert_continues(expected: list[dict], continued: list[dict], name: str) -> None:
    for rank, results in enumerate(continued):
        for index, (ours, reference) in enumerate(zip(results[name], expected[0][name])):
            assert torch.equal(ours, reference), (name, rank, index)


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp2")
    return root, run_ranks(_save_worker, 2, str(root), list(VARIANTS), tmp_path=root)


@pytest.mark.parametrize("world_size", [2, 1])
def test_a_checkpoint_saved_on_two_ranks_continues_exactly(saved_on_two, world_size):
    root, expected = saved_on_two
    continued = run_ranks(_load_worker, world_size, str(root), list(VARIANTS), tmp_path=root)
    for name in VARIANTS:
        _assert_continues(expected, continued, name)
    assert all(results["nvme-evictions"] > 0 for results in continued)  # it really paged


def test_a_checkpoint_saved_on_one_rank_continues_exactly_on_two(tmp_path):
    names = ["8bit", "exact-into-8bit"]
    expected = run_ranks(_save_worker, 1, str(tmp_path), names, tmp_path=tmp_path)
    continued = run_ranks(_load_worker, 2, str(tmp_path), names, tmp_path=tmp_path)
    for name in names:
        _assert_continues(expected, continued, name)


def _full_state_dict_worker(rank: int, world_size: int, root: str) -> dict:
    """full_state_dict=True, cpu_offload=True gathers the unsharded state on rank 0, and
    broadcast_from_rank0 loads it back into fresh sharded optimizers."""
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    results = {}
    for kind in ("8bit", "exact"):
        model, plain = sharded_and_plain(torch.float32)
        optimizer = _optimizer(kind, model.parameters(), root)
        unsharded = _optimizer(kind, plain.parameters(), root)
        train(model, optimizer, BEFORE, seed=1)
        train(plain, unsharded, BEFORE, seed=1)
        gathered = get_optimizer_state_dict(
            model, optimizer, options=_options(dict(full_state_dict=True, cpu_offload=True)))
        if rank == 0:
            reference = unsharded.state_dict()["state"]
            names = [name for name, _ in plain.named_parameters()]
            results[f"{kind}-gathered"] = all(
                torch.equal(value, reference[index][key]) and not hasattr(value, "placements")
                for index, name in enumerate(names)
                for key, value in gathered["state"][name].items()) and len(names) == len(
                gathered["state"])
        fresh_model, _ = sharded_and_plain(torch.float32)
        fresh = _optimizer(kind, fresh_model.parameters(), root)
        for p, q in zip(fresh_model.parameters(), model.parameters()):
            p.data.copy_(q.data)
        set_optimizer_state_dict(fresh_model, fresh, gathered if rank == 0 else {},
                                 options=_options(dict(full_state_dict=True,
                                                       broadcast_from_rank0=True)))
        train(fresh_model, fresh, AFTER, seed=2)
        train(model, optimizer, AFTER, seed=2)
        results[f"{kind}-continues"] = all(torch.equal(full(p), full(q)) for p, q in
                                           zip(fresh_model.parameters(), model.parameters()))
    return results


def test_full_state_dicts_gather_the_unsharded_state_and_load_back(tmp_path):
    results = run_ranks(_full_state_dict_worker, 2, str(tmp_path), tmp_path=tmp_path)
    assert results[0]["8bit-gathered"] and results[0]["exact-gathered"]
    for rank_results in results:
        assert rank_results["8bit-continues"] and rank_results["exact-continues"]


def test_a_checkpoint_with_flat_scales_loads_through_the_planner(tmp_path):
    """8-bit DCP checkpoints saved before scales took their param's shape hold them flat."""
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    optimizer = po.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()  # else torch's helpers take the fresh optimizer below as stepped
    saved = get_optimizer_state_dict(model, optimizer)
    old = {"state": {name: {key: value.reshape(-1) if key.endswith("_scales") else value
                            for key, value in entry.items()}
                     for name, entry in saved["state"].items()},
           "param_groups": saved["param_groups"]}
    assert saved["state"]["weight"]["exp_avg_scales"].shape == (64, 2)
    dcp.save({"optimizer": old}, checkpoint_id=str(tmp_path / "old"), no_dist=True)
    fresh = po.AdamW(model.parameters(), lr=1e-2)
    target = {"optimizer": get_optimizer_state_dict(model, fresh)}
    dcp.load(target, checkpoint_id=str(tmp_path / "old"),
             planner=po.dcp.StateFormatLoadPlanner(), no_dist=True)
    set_optimizer_state_dict(model, fresh, target["optimizer"])
    loaded = get_optimizer_state_dict(model, fresh)["state"]
    assert all(torch.equal(loaded[name][key], value) for name, entry in saved["state"].items()
               for key, value in entry.items())
