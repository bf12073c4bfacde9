"""8-bit state under FSDP2 for any shape and any world size, bit for bit like one process.

8-bit groups of 32 follow the rows of a param's last dimension (state_format.group_shape),
so a dim-0 shard holds whole groups whatever the widths and the number of ranks. Each rank
keeps an unsharded copy of the model and its own optimizer on it; both take the same
gradients (the copy's, handed to the sharded params as DTensors placed like them, so no
reduction rounding comes in), and after every step the gathered sharded params and state
must equal the copy's bit for bit. The widths are the ones that used to be refused (20, 72,
40, 6: rows that end in partial groups, shards of 24 or 18 rows) and 4096-like ones (a norm
of 4096 on 3 ranks, 1366-element shards), on 2, 3 and 4 ranks, HSDP on 4.

DCP: state saved on N ranks continues on M ranks, N, M in {1, 2, 3}, bit for bit like one
process that never stopped.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
from torch import nn

import pagedoptim as po
from ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch was built without torch.distributed")

STEPS = 3
EIGHT_BIT = dict(state_bits=8, min_8bit_size=0)  # small test params keep 8-bit state too

# name: (optimizer class, kwargs, param dtype)
OPTIMIZERS = {
    "adamw": (po.AdamW, dict(lr=1e-2, weight_decay=0.1, **EIGHT_BIT), torch.float32),
    "adamw-amsgrad": (po.AdamW, dict(lr=1e-2, amsgrad=True, **EIGHT_BIT), torch.float32),
    "sgd-momentum": (po.SGD, dict(lr=0.05, momentum=0.9, **EIGHT_BIT), torch.float32),
    "lion": (po.Lion, dict(lr=1e-3, weight_decay=0.1, **EIGHT_BIT), torch.float32),
    "adamw-bf16-master24": (po.AdamW, dict(lr=1e-2, master_bits=24, **EIGHT_BIT),
                            torch.bfloat16),
    # The default: min_8bit_size 4096, so these small params keep fp32 moments (and the
    # 4096-wide ones 8-bit), as a new user's po.AdamW(model.parameters()) gets.
    "adamw-defaults": (po.AdamW, dict(lr=1e-2), torch.float32),
}


class Widths(nn.Module):
    """Linear(20, 72), Linear(72, 40), Linear(40, 6): every weight's rows end in a partial
    group, and no dim-0 shard on 3 ranks is a multiple of 32 elements."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(20, 72), nn.Linear(72, 40), nn.Linear(40, 6)])


class Wide(nn.Module):
    """4096-like widths: a norm weight of 4096 (1366-element shards on 3 ranks) and weights
    of rows 4096 and 20 long."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4096)
        self.down = nn.Linear(4096, 20)
        self.up = nn.Linear(20, 4096)


MODELS = {"widths": Widths, "wide": Wide}


def _mesh(world_size: int, hsdp: bool) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    if hsdp:
        return init_device_mesh("cpu", (2, world_size // 2),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world_size,))


def _sharded_and_plain(model_name: str, dtype: torch.dtype, world_size: int,
                       hsdp: bool = False) -> tuple[nn.Module, nn.Module]:
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = MODELS[model_name]().to(dtype)
    plain = copy.deepcopy(model)
    mesh = _mesh(world_size, hsdp)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm)):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, plain


def _gradients(plain: nn.Module, step: int) -> list[torch.Tensor]:
    """Gradients for every param of the plain model, the same on every rank."""
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=generator).to(p.dtype) for p in plain.parameters()]


def _step_both(model: nn.Module, plain: nn.Module, optimizer: Any, single: Any,
               step: int) -> None:
    from torch.distributed.tensor import distribute_tensor
    for p, q, grad in zip(model.parameters(), plain.parameters(), _gradients(plain, step)):
        q.grad = grad.clone()
        p.grad = distribute_tensor(grad.clone(), p.device_mesh, p.placements)
    optimizer.step()
    single.step()
    optimizer.zero_grad(set_to_none=True)
    single.zero_grad(set_to_none=True)


def _full(value: Any) -> Any:
    """The whole tensor behind a DTensor (gloo gathers no int16: through int32)."""
    if not hasattr(value, "full_tensor"):
        return value
    if value.dtype == torch.int16:
        return value.to(torch.int32).full_tensor().to(torch.int16)
    return value.full_tensor()


def _differences(model: nn.Module, plain: nn.Module, optimizer: Any, single: Any) -> list:
    """What differs between the sharded run and the one-process run (empty: nothing)."""
    found = []
    for index, (p, q) in enumerate(zip(model.parameters(), plain.parameters())):
        if not torch.equal(_full(p).detach(), q.detach()):
            found.append(("param", index))
    state, single_state = optimizer.state_dict()["state"], single.state_dict()["state"]
    if set(state) != set(single_state):
        found.append(("state params", sorted(state), sorted(single_state)))
    for index, entry in state.items():
        theirs = single_state.get(index, {})
        if set(entry) != set(theirs):
            found.append(("state keys", index, sorted(entry), sorted(theirs)))
            continue
        for key, value in entry.items():
            if not torch.equal(_full(value), theirs[key]):
                found.append(("state", index, key))
    return found


def _kinds_of_state(single: Any) -> set[str]:
    """Which formats the one-process state holds: '8bit' (codes with scales), 'fp32'."""
    kinds = set()
    for entry in single.state_dict()["state"].values():
        kinds |= {"8bit" if key.endswith("_codes") else "fp32"
                  for key in entry if key not in ("step",) and not key.endswith("_scales")
                  and key != "master_residual"}
    return kinds


def _equivalence_worker(rank: int, world_size: int, cases: list[tuple[str, str, bool]]
                        ) -> dict:
    results = {}
    for model_name, optimizer_name, hsdp in cases:
        cls, kwargs, dtype = OPTIMIZERS[optimizer_name]
        model, plain = _sharded_and_plain(model_name, dtype, world_size, hsdp)
        initial = [p.detach().clone() for p in plain.parameters()]
        optimizer, single = cls(model.parameters(), **kwargs), cls(plain.parameters(), **kwargs)
        differences = []
        for step in range(STEPS):
            _step_both(model, plain, optimizer, single, step)
            differences += [(step, *d) for d in _differences(model, plain, optimizer, single)]
        moved = all(not torch.equal(p, q) for p, q in zip(plain.parameters(), initial))
        results[model_name, optimizer_name, hsdp] = {
            "differences": differences, "moved": moved, "kinds": _kinds_of_state(single)}
    return results


# (world size, model, optimizer, HSDP): every model and optimizer on 2, 3 and 4 ranks, and
# HSDP on a 2 x 2 mesh (4 ranks).
CASES = [(world_size, model, optimizer, False) for world_size in (2, 3, 4)
         for model in MODELS for optimizer in OPTIMIZERS]
CASES += [(4, model, "adamw", True) for model in MODELS]


@pytest.fixture(scope="module")
def on_ranks(tmp_path_factory):
    """The equivalence results of CASES, by world size (one spawn of ranks each)."""
    results = {}
    for world_size in (2, 3, 4):
        cases = [case[1:] for case in CASES if case[0] == world_size]
        tmp_path = tmp_path_factory.mktemp(f"any-shard-{world_size}")
        results[world_size] = run_ranks(_equivalence_worker, world_size, cases,
                                        tmp_path=tmp_path)
    return results


@pytest.mark.parametrize("world_size,model_name,optimizer_name,hsdp", CASES)
def test_8bit_state_under_fsdp2_steps_like_one_process(on_ranks, world_size, model_name,
                                                       optimizer_name, hsdp):
    for rank, results in enumerate(on_ranks[world_size]):
        case = results[model_name, optimizer_name, hsdp]
        assert case["moved"], "a param never moved"
        assert case["differences"] == [], (rank, case["differences"])
        # The 8-bit cases really keep 8-bit state (and the defaults fp32 for small params).
        if optimizer_name == "adamw-defaults":
            assert "fp32" in case["kinds"]
            assert ("8bit" in case["kinds"]) == (model_name == "wide")
        else:
            assert "8bit" in case["kinds"]


# -- DCP: saved on N ranks, continued on M ---------------------------------------------------

DCP_OPTIMIZERS = ("adamw", "adamw-bf16-master24")
SAVED_STEPS, MORE_STEPS = 2, 2


def _dcp_model(optimizer_name: str, world_size: int) -> tuple[nn.Module, Any]:
    cls, kwargs, dtype = OPTIMIZERS[optimizer_name]
    model, _ = _sharded_and_plain("widths", dtype, world_size)
    return model, cls(model.parameters(), **kwargs)


def _train_sharded(model: nn.Module, optimizer: Any, steps: range) -> None:
    from torch.distributed.tensor import distribute_tensor
    for step in steps:
        for p, grad in zip(model.parameters(), _gradients(model, step)):
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _save_worker(rank: int, world_size: int, directory: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    for name in DCP_OPTIMIZERS:
        model, optimizer = _dcp_model(name, world_size)
        _train_sharded(model, optimizer, range(SAVED_STEPS))
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state},
                 checkpoint_id=f"{directory}/{name}-{world_size}")


def _continue_worker(rank: int, world_size: int, directory: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    results = {}
    for name, saved_on in itertools.product(DCP_OPTIMIZERS, (1, 2, 3)):
        model, optimizer = _dcp_model(name, world_size)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=f"{directory}/{name}-{saved_on}")
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        _train_sharded(model, optimizer, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
        results[name, saved_on] = [_full(p).detach() for p in model.parameters()]
    return results


def _uninterrupted(name: str) -> list[torch.Tensor]:
    """The one-process run of SAVED_STEPS + MORE_STEPS steps, never stopped."""
    cls, kwargs, dtype = OPTIMIZERS[name]
    torch.manual_seed(0)
    plain = Widths().to(dtype)
    optimizer = cls(plain.parameters(), **kwargs)
    for step in range(SAVED_STEPS + MORE_STEPS):
        for p, grad in zip(plain.parameters(), _gradients(plain, step)):
            p.grad = grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach() for p in plain.parameters()]


@pytest.fixture(scope="module")
def continued(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dcp-any-shard")
    for world_size in (1, 2, 3):
        run_ranks(_save_worker, world_size, str(directory), tmp_path=directory)
    return {world_size: run_ranks(_continue_worker, world_size, str(directory),
                                  tmp_path=directory)
            for world_size in (1, 2, 3)}


@pytest.mark.parametrize("name", DCP_OPTIMIZERS)
@pytest.mark.parametrize("saved_on,continued_on", list(itertools.product((1, 2, 3), (1, 2, 3))))
def test_dcp_saved_on_n_ranks_continues_on_m_bit_for_bit(continued, name, saved_on,
                                                         continued_on):
    expected = _uninterrupted(name)
    for rank, results in enumerate(continued[continued_on]):
        got = results[name, saved_on]
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), rank


# -- DCP checkpoints of the flat layout (pagedoptim before 0.2), loaded on 2 ranks ----------

def _flat_layout_state(model: nn.Module, generator: torch.Generator) -> dict[int, dict]:
    """8-bit AdamW state of every param of `model` as pagedoptim before 0.2 kept it: groups
    in flat order (1-D scales), 1-D params 8-bit too."""
    from pagedoptim._native import native
    state = {}
    for index, p in enumerate(model.parameters()):
        entry = {"step": torch.tensor(2.0)}
        for name, encode in (("exp_avg", native.encode_moment),
                             ("exp_avg_sq", native.encode_second_moment)):
            values = torch.randn(p.shape, generator=generator)
            values = values.square() if name == "exp_avg_sq" else values
            codes, scales = encode(values.reshape(-1))
            entry[f"{name}_codes"], entry[f"{name}_scales"] = codes.view(p.shape), scales
        state[index] = entry
    return state


def _load_flat_layout_worker(rank: int, world_size: int, directory: str) -> list:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    model, _ = _sharded_and_plain("widths", torch.float32, world_size)
    optimizer = po.AdamW(model.parameters(), lr=1e-2, **EIGHT_BIT)
    target = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(target, checkpoint_id=directory, planner=po.dcp.StateFormatLoadPlanner())
    set_optimizer_state_dict(model, optimizer, target["optimizer"])
    state = optimizer.state_dict()["state"]
    return [{key: _full(value) for key, value in state[index].items()}
            for index in sorted(state)]


def test_a_flat_layout_dcp_checkpoint_loads_on_ranks_as_in_one_process(tmp_path):
    """Sharded, a rank's row groups cannot be cut out of flat groups: the whole stream is
    gathered, decoded and each rank encodes its part, which must equal what one process
    loading the same state with load_state_dict holds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    torch.manual_seed(0)
    plain = Widths()
    single = po.AdamW(plain.parameters(), lr=1e-2, **EIGHT_BIT)
    saved = get_optimizer_state_dict(plain, single)  # the FQN keys and groups DCP uses
    names = [name for name, _ in plain.named_parameters()]
    old = _flat_layout_state(plain, torch.Generator().manual_seed(9))
    dcp.save({"optimizer": {"state": {names[i]: entry for i, entry in old.items()},
                            "param_groups": saved["param_groups"]}},
             checkpoint_id=str(tmp_path / "old"), no_dist=True)
    single.load_state_dict({"state": old, "param_groups": single.state_dict()["param_groups"]})
    expected = single.state_dict()["state"]
    for rank, loaded in enumerate(run_ranks(_load_flat_layout_worker, 2, str(tmp_path / "old"),
                                            tmp_path=tmp_path)):
        for index, entry in enumerate(loaded):
            assert set(entry) == set(expected[index]), (rank, index)
            for key, value in entry.items():
                assert torch.equal(value, expected[index][key]), (rank, index, key)
