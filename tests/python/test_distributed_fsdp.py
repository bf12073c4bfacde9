"""FSDP2 (DTensor params) on two gloo ranks: pagedoptim steps the local shards.

Every rank trains the same tiny MLP, sharded with fully_shard, on the same batches, so the
reduce-scattered gradient ((g + g) / 2) is bit for bit the gradient of an unsharded copy
of the model trained in the same process. That makes three references exact:

- torch.optim under the same FSDP2 setup (exact mode must match it to fp32 rounding);
- the same pagedoptim optimizer on the unsharded copy (any mode must match it bit for bit:
  the kernels are elementwise, and 8-bit scale groups never straddle a shard here);
- the unsharded optimizer's state_dict, which the gathered DTensor state must equal.

All cases run in one spawn of two ranks (a module fixture), and each test reads its case.
"""

from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch
from torch import nn

import pagedoptim as po
from support import FP32_TOL, LionReference, max_abs, relative_error
from ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch was built without torch.distributed")

STEPS = 4
EXACT = dict(state_bits=32, master_bits=None)
# These params are small: every one of two or more dimensions keeps 8-bit moments.
SMALL_8BIT = dict(min_8bit_size=0)

# name: (our optimizer, its kwargs, torch's equivalent or None, the model's dtype)
CASES = {
    "adamw-exact": (po.AdamW, dict(lr=1e-2, weight_decay=0.1, **EXACT),
                    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)), torch.float32),
    "adamw-amsgrad-exact": (po.AdamW, dict(lr=1e-2, amsgrad=True, **EXACT),
                            (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)), torch.float32),
    "sgd-nesterov-exact": (po.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, **EXACT),
                           (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
                           torch.float32),
    "lion-exact": (po.Lion, dict(lr=1e-3, weight_decay=0.1, **EXACT),
                   (LionReference, dict(lr=1e-3, weight_decay=0.1)), torch.float32),
    "adamw-8bit": (po.AdamW, dict(lr=1e-2, weight_decay=0.1), None, torch.float32),
    "adamw-8bit-bf16-residual": (po.AdamW, dict(lr=1e-2), None, torch.bfloat16),
    "sgd-8bit": (po.SGD, dict(lr=0.05, momentum=0.9), None, torch.float32),
    "lion-8bit-bf16-int16-residual": (po.Lion, dict(lr=1e-3, master_bits=32), None,
                                      torch.bfloat16),
    # A cache of one page: every step reads and writes most pages (checked below).
    "adamw-nvme": (po.AdamW, dict(lr=1e-2, offload="nvme", cache_bytes=1 << 12,
                                  page_bytes=1 << 12), None, torch.float32),
}


class Net(nn.Module):
    """Every last dimension and every 1-D shard on two ranks is a multiple of 32."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def sharded_and_plain(dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """The same freshly initialised Net twice: FSDP2-sharded, and an unsharded copy."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = Net().to(dtype)
    plain = copy.deepcopy(model)
    fully_shard(model.fc1)
    fully_shard(model.fc2)
    fully_shard(model)
    return model, plain


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(8, 64, generator=generator).to(dtype)
        model(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def full(value: object) -> object:
    """The whole tensor behind a DTensor (gloo gathers no int16: the int16 master residual
    goes through int32)."""
    if not hasattr(value, "full_tensor"):
        return value
    if value.dtype == torch.int16:
        return value.to(torch.int32).full_tensor().to(torch.int16)
    return value.full_tensor()


def _equivalence_worker(rank: int, world_size: int, nvme_dir: str) -> dict:
    from torch.distributed.tensor import DTensor
    results = {}
    for name, (ours_cls, kwargs, reference, dtype) in CASES.items():
        kwargs = dict(kwargs, nvme_dir=nvme_dir) if "offload" in kwargs else kwargs
        model, plain = sharded_and_plain(dtype)
        optimizer = ours_cls(model.parameters(), **kwargs)
        single = ours_cls(plain.parameters(), **kwargs)
        train(model, optimizer, STEPS, seed=1)
        train(plain, single, STEPS, seed=1)
        case = {"params": [full(p).detach() for p in model.parameters()],
                "single_params": [p.detach().clone() for p in plain.parameters()],
                "initial_params": [p.detach() for p in sharded_and_plain(dtype)[1].parameters()]}
        state, single_state = optimizer.state_dict(), single.state_dict()
        case["state_equal"] = {
            (index, key): torch.equal(full(value), single_state["state"][index][key])
            for index, entry in state["state"].items() for key, value in entry.items()}
        params = list(model.parameters())
        case["dtensor_placements_match"] = all(
            isinstance(value, DTensor) and value.placements == params[index].placements
            for index, entry in state["state"].items() for key, value in entry.items()
            if key != "step")
        case["state_keys_match"] = all(
            set(entry) == set(single_state["state"][index]) for index, entry in
            state["state"].items()) and set(state["state"]) == set(single_state["state"])
        report, single_report = optimizer.memory_report(), single.memory_report()
        case["num_elements"] = (report["num_elements"], single_report["num_elements"],
                                sum(p.to_local().numel() for p in params))
        case["moment_bytes"] = (report["moment_bytes"], single_report["moment_bytes"])
        case["evictions"] = optimizer.paging_stats().get("evictions", 0)
        if reference is not None:
            torch_model, _ = sharded_and_plain(dtype)
            torch_cls, torch_kwargs = reference
            torch_optimizer = torch_cls(torch_model.parameters(), **torch_kwargs)
            train(torch_model, torch_optimizer, STEPS, seed=1)
            case["torch_params"] = [full(p).detach() for p in torch_model.parameters()]
            # LionReference marks the elements whose sign() was a rounding-level tie (gloo
            # gathers no bool tensors, hence the uint8).
            case["ties"] = [full(torch_optimizer.state[p]["tie"].to(torch.uint8)).bool()
                            if "tie" in torch_optimizer.state[p] else None
                            for p in torch_model.parameters()]
        results[name] = case
    return results


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("fsdp")
    return run_ranks(_equivalence_worker, 2, str(tmp_path), tmp_path=tmp_path)


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp2_steps_like_one_process_bit_for_bit(equivalence, name):
    for rank, results in enumerate(equivalence):
        case = results[name]
        for index, (ours, single) in enumerate(zip(case["params"], case["single_params"])):
            assert torch.equal(ours, single), (rank, index)
        assert not any(torch.equal(ours, initial) for ours, initial in
                       zip(case["params"], case["initial_params"])), "a param never moved"


def test_fsdp2_paged_state_really_pages(equivalence):
    assert all(results["adamw-nvme"]["evictions"] > 0 for results in equivalence)


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[2] is not None])
def test_fsdp2_exact_mode_matches_torch_under_fsdp2(equivalence, name):
    for results in equivalence:
        case = results[name]
        for ours, theirs, initial, ties in zip(case["params"], case["torch_params"],
                                               case["initial_params"], case["ties"]):
            scale = max(max_abs(theirs), max_abs(initial))
            if ties is not None:  # only Lion's reference records ties; they are excluded
                ours, theirs = ours[~ties], theirs[~ties]
            assert relative_error(ours, theirs, scale) <= FP32_TOL


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp2_state_is_the_shard_of_the_unsharded_state(equivalence, name):
    for rank, results in enumerate(equivalence):
        case = results[name]
        assert case["state_keys_match"], rank
        assert case["dtensor_placements_match"], rank
        assert all(case["state_equal"].values()), (rank, [k for k, v in
                                                          case["state_equal"].items() if not v])


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp2_memory_report_counts_the_local_shard(equivalence, name):
    for results in equivalence:
        local, single, shards = results[name]["num_elements"]
        assert local == shards and 2 * local == single
        local_moments, single_moments = results[name]["moment_bytes"]
        assert 2 * local_moments == single_moments


# -- placements other than FSDP2's default, SkewAdam, and what is refused ------------------

class Moe(nn.Module):
    """A router, [experts, rows, cols] expert weights and a norm: SkewAdam's tiers."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(64, 4, bias=False)
        self.experts = nn.Parameter(torch.randn(4, 32, 64) * 0.1)
        self.norm = nn.LayerNorm(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.gate(x), dim=-1)                # [batch, experts]
        hidden = torch.einsum("bd,erd->ber", x, self.experts)       # [batch, experts, rows]
        return self.norm((weights.unsqueeze(-1) * hidden).sum(1).repeat(1, 2))


def _shard(model: nn.Module, **kwargs) -> None:
    from torch.distributed.fsdp import fully_shard
    fully_shard(model, **kwargs)


def _bit_for_bit(make_model, make_optimizer, shard, dtype=torch.float32) -> bool:
    """Whether the sharded model steps exactly as its unsharded copy does (and moves)."""
    torch.manual_seed(0)
    model = make_model().to(dtype)
    plain = copy.deepcopy(model)
    initial = [p.detach().clone() for p in plain.parameters()]
    shard(model)
    optimizer, single = make_optimizer(model), make_optimizer(plain)
    train(model, optimizer, STEPS, seed=2)
    train(plain, single, STEPS, seed=2)
    moved = all(not torch.equal(p, q) for p, q in zip(plain.parameters(), initial))
    return moved and all(torch.equal(full(p), q)
                         for p, q in zip(model.parameters(), plain.parameters()))


class Free(nn.Module):
    """Params of the given shapes and dtypes, each in the loss (complex ones by |p|^2)."""

    def __init__(self, shapes: dict[str, tuple], dtypes: Optional[dict] = None) -> None:
        super().__init__()
        for name, shape in shapes.items():
            dtype = (dtypes or {}).get(name, torch.float32)
            self.register_parameter(name, nn.Parameter(torch.randn(shape, dtype=dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.mean()
        for index, p in enumerate(self.parameters()):
            values = torch.view_as_real(p) if p.is_complex() else p
            total = total + (values * (x.mean() + index)).sin().sum()
        return total


def _error(make) -> str:
    try:
        make()
    except (ValueError, TypeError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _placements_worker(rank: int, world_size: int) -> dict:
    from torch.distributed.tensor import Shard
    results = {}
    # Shard(1): 8-bit scale groups of [rows, cols / 32] split along their rows' columns.
    results["shard1-8bit"] = _bit_for_bit(
        Net, lambda m: po.AdamW(m.parameters(), lr=1e-2, **SMALL_8BIT),
        lambda m: _shard(m, shard_placement_fn=lambda p: Shard(p.dim() - 1)))
    # Uneven and empty shards: (3, 64) splits 2 + 1 rows, (1, 64) and (1,) leave rank 1
    # nothing; (5, 96) 3 + 2 rows; (5, 40) rows ending in partial groups.
    results["uneven-8bit"] = _bit_for_bit(
        lambda: Free({"a": (3, 64), "b": (1, 64), "c": (1,), "d": (5, 96), "e": (5, 40)}),
        lambda m: po.AdamW(m.parameters(), lr=1e-2, **SMALL_8BIT), _shard)
    # HSDP on a 2 x 1 mesh (replicated across the ranks, each shard whole), and a 1 x 2
    # mesh, sharded across the ranks (1-D params keep fp32 moments in either).
    from torch.distributed.device_mesh import init_device_mesh
    for shape in ((2, 1), (1, 2)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        results[f"hsdp-{shape[0]}x{shape[1]}-8bit"] = _bit_for_bit(
            lambda: Free({"w": (4, 64), "b": (64,)} if shape == (1, 2) else
                         {"w": (4, 64), "b": (48,), "one": (1,)}),
            lambda m: po.AdamW(m.parameters(), lr=1e-2, **SMALL_8BIT),
            lambda m, mesh=mesh: _shard(m, mesh=mesh))
    # Complex params: stepped as their real view (fp32 moments), sharded like the param.
    results["complex-8bit"] = _bit_for_bit(
        lambda: Free({"z": (4, 64), "y": (64,)}, {"z": torch.complex64, "y": torch.complex64}),
        lambda m: po.AdamW(m.parameters(), lr=1e-2, **SMALL_8BIT), _shard)
    # SkewAdam: experts sharded along dim 0 keep whole matrices; the router and the norm
    # keep exact second moments, which shard like any element stream.
    results["skewadam-experts"] = _bit_for_bit(
        Moe, lambda m: po.SkewAdam(m.named_parameters(), lr=1e-2), _shard)

    def edited_through_to_local():
        """A change made through to_local() of a state DTensor is written back, as a change
        to a plain param's state tensor is."""
        model, plain = sharded_and_plain(torch.float32)
        optimizer, single = (po.AdamW(m.parameters(), lr=1e-2, **EXACT) for m in (model, plain))
        train(model, optimizer, 1, seed=4)
        train(plain, single, 1, seed=4)
        for p, q in zip(model.parameters(), plain.parameters()):
            optimizer.state[p]["exp_avg"].to_local().mul_(-3.0)
            single.state[q]["exp_avg"].mul_(-3.0)
        train(model, optimizer, 2, seed=5)
        train(plain, single, 2, seed=5)
        return all(torch.equal(full(p), q) for p, q in zip(model.parameters(),
                                                           plain.parameters()))
    results["edited-through-to-local"] = edited_through_to_local()

    def misaligned():
        torch.manual_seed(0)
        model = nn.Linear(48, 64)  # Shard(1) of the [64, 48] weight: rows of 24 columns
        _shard(model, shard_placement_fn=lambda p: Shard(p.dim() - 1))
        optimizer = po.AdamW(model.parameters(), **SMALL_8BIT)
        model(torch.randn(2, 48)).sum().backward()
        optimizer.step()
    results["misaligned-8bit"] = _error(misaligned)

    # The same shards in exact mode have no groups to cut.
    results["misaligned-exact"] = _bit_for_bit(
        lambda: nn.Linear(64, 48), lambda m: po.AdamW(m.parameters(), **EXACT), _shard)

    def skewadam_backbone():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64))
        _shard(model)
        optimizer = po.SkewAdam(model.named_parameters())
        model(torch.randn(2, 64)).sum().backward()
        optimizer.step()
    results["skewadam-backbone"] = _error(skewadam_backbone)

    def release():
        model = Net()
        _shard(model)
        po.AdamW(model.parameters(), release_grads=True)
    results["release-grads"] = _error(release)

    def plain_grad_of_a_dtensor():
        model = Net()
        _shard(model)
        optimizer = po.AdamW(model.parameters())
        for p in model.parameters():
            p.grad = torch.zeros(p.shape)
        optimizer.step()
    results["plain-grad"] = _error(plain_grad_of_a_dtensor)
    return results


@pytest.fixture(scope="module")
def placements(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("placements")
    return run_ranks(_placements_worker, 2, tmp_path=tmp_path)


@pytest.mark.parametrize("name", ["shard1-8bit", "skewadam-experts", "misaligned-exact",
                                  "uneven-8bit", "hsdp-2x1-8bit", "hsdp-1x2-8bit",
                                  "complex-8bit", "edited-through-to-local"])
def test_other_placements_step_like_one_process(placements, name):
    assert all(results[name] is True for results in placements)


@pytest.mark.parametrize("name,expected", [
    ("misaligned-8bit", "ValueError: param 0 .* does not hold whole groups of 32 elements"),
    ("skewadam-backbone", "ValueError: param 0 .* matrices, whose second moment SkewAdam "
                          "factors into row and column means, are split across ranks"),
    ("release-grads", "ValueError: params\\[0\\] is a DTensor .* use release_grads=False"),
    ("plain-grad", "ValueError: the grad of param 0 .* is a plain tensor and its param a "
                   "DTensor"),
])
def test_what_cannot_be_exact_raises_a_clear_error(placements, name, expected):
    import re
    for results in placements:
        assert re.match(expected, results[name]), results[name]


def test_a_tensor_subclass_it_cannot_step_raises():
    from torch.testing._internal.two_tensor import TwoTensor
    param = nn.Parameter(TwoTensor(torch.zeros(4), torch.zeros(4)))
    with pytest.raises(TypeError, match=r"params\[0\] is a TwoTensor, a tensor subclass "
                                        "pagedoptim cannot step"):
        po.AdamW([param])


def _host_state_on_another_devices_mesh(rank, world_size):
    # A mesh whose device is not the state's, as a CUDA mesh is for offloaded (host) state.
    # On the CPU the "meta" device stands in for CUDA: DTensor.from_local moves a local
    # tensor to the mesh's device, to CUDA there and to meta (losing the values) here.
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from pagedoptim.state import sharding as sharded_params
    mesh = DeviceMesh("meta", list(range(world_size)))
    local = torch.arange(8, dtype=torch.float32) + 8 * rank
    layout = sharded_params.ShardLayout(
        mesh, (Shard(0),), sharded_params.Box((8 * world_size,), (8,), (8 * rank,)))
    state = sharded_params.as_dtensor(layout, local, per_group=False, where=lambda: "state")
    return state.to_local().device.type, state.to_local().data_ptr() == local.data_ptr(), \
        tuple(state.shape)


def test_state_dict_dtensors_keep_host_state_where_it_is(tmp_path):
    for device, same_memory, shape in run_ranks(_host_state_on_another_devices_mesh, 2,
                                                tmp_path=tmp_path):
        assert (device, same_memory, shape) == ("cpu", True, (16,))


def _backward_through_a_saved_dtensor_after_a_step(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world_size,))
    p = nn.Parameter(distribute_tensor(torch.randn(64, 8, generator=torch.Generator()
                                                   .manual_seed(0)), mesh, [Shard(0)]))
    opt = po.AdamW([p], lr=1e-2)
    saved_p = (p * p).sum()  # tensor parallelism: the graph saves the DTensor param
    p.grad = distribute_tensor(torch.ones(64, 8), mesh, [Shard(0)])
    opt.step()
    try:
        saved_p.backward()
    except RuntimeError as error:
        return "modified by an inplace operation" in str(error)
    return False


def test_a_graph_that_saved_a_dtensor_param_refuses_backward_after_a_step(tmp_path):
    assert run_ranks(_backward_through_a_saved_dtensor_after_a_step, 2,
                     tmp_path=tmp_path) == [True, True]
