"""Gradient release under DDP: two gloo ranks train a tiny Llama (bf16 autocast, clipping,
accumulation of 1 and 4 micro-batches with no_sync(), exact and 8-bit state), once without
release and once with release_grads=True and `optimizer.register_ddp(model)`. The released
gradients are taken from DDP's communication hook after the all-reduce, so on each rank the
parameters, the state and each step's clip norm equal the run without release bit for bit,
and the ranks equal each other. Without register_ddp a release under several ranks raises
before anything is released.
"""

import contextlib

import pytest
import torch

import pagedoptim as po
from ranks import run_ranks
from test_release_exact import EIGHT_BIT, EXACT, MAX_NORM, byte_batches, tiny_llama

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="this torch has no torch.distributed")

STEPS = 30
LR = 3e-3
CASES = [(accumulation, fmt) for accumulation in (1, 4) for fmt in ("exact", "8bit")]
FORMATS = {"exact": EXACT, "8bit": EIGHT_BIT}


def _train(rank, release, accumulation, settings):
    model = tiny_llama()  # the same weights on every rank (seeded)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = po.AdamW(ddp.parameters(), lr=LR, release_grads=release, **settings)
    if release:
        opt.register_ddp(ddp)
    # Each rank its own bytes: DDP averages different gradients.
    batches = byte_batches(2 * STEPS * accumulation)[rank::2]
    norms = []
    for step in range(STEPS):
        for micro in range(accumulation):
            last = micro == accumulation - 1
            tokens = batches[step * accumulation + micro]
            with contextlib.nullcontext() if last else ddp.no_sync():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = ddp(input_ids=tokens, labels=tokens).loss / accumulation
                loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM))
        opt.step()
        opt.zero_grad()
        if release:
            assert all(p.grad is None for p in model.parameters())
    state = {(index, key): value for index, entry in opt.state_dict()["state"].items()
             for key, value in entry.items()}
    return [p.detach().clone() for p in model.parameters()], state, norms


def _unregistered_release_raises(rank):
    model = tiny_llama()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = po.AdamW(ddp.parameters(), lr=LR, release_grads=True)
    tokens = byte_batches(2)[rank]
    before = [p.detach().clone() for p in model.parameters()]
    try:
        ddp(input_ids=tokens, labels=tokens).loss.backward()
    except RuntimeError as error:
        unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        assert not opt._release.gradients.filled()  # nothing was released
        return str(error), unchanged
    return None, None


def _ranks(rank, world_size):
    torch.set_num_threads(1)
    results = {}
    for accumulation, fmt in CASES:
        for release in (False, True):
            results[(accumulation, fmt, release)] = _train(rank, release, accumulation,
                                                            FORMATS[fmt])
    results["unregistered"] = _unregistered_release_raises(rank)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_ranks, 2, tmp_path=tmp_path_factory.mktemp("release_ddp"), timeout=600)


@pytest.mark.parametrize("accumulation,fmt", CASES)
def test_release_under_ddp_equals_ddp_without_release(ranks, accumulation, fmt):
    for rank, results in enumerate(ranks):
        params, state, norms = results[(accumulation, fmt, True)]
        ref_params, ref_state, ref_norms = results[(accumulation, fmt, False)]
        for index, (p, q) in enumerate(zip(params, ref_params)):
            assert torch.equal(p, q), f"rank {rank}: param {index}"
        assert state.keys() == ref_state.keys()
        for key in state:
            assert torch.equal(state[key], ref_state[key]), f"rank {rank}: state {key}"
        for step, (norm, ref_norm) in enumerate(zip(norms, ref_norms)):
            assert torch.equal(norm, ref_norm), f"rank {rank}: norm of step {step}"
        assert sum(float(n) > MAX_NORM for n in ref_norms) >= STEPS // 2
    other_params = ranks[1][(accumulation, fmt, True)][0]
    for index, (p, q) in enumerate(zip(ranks[0][(accumulation, fmt, True)][0], other_params)):
        assert torch.equal(p, q), f"the ranks differ in param {index}"


def test_release_under_ddp_without_register_ddp_raises_before_releasing(ranks):
    for results in ranks:
        message, unchanged = results["unregistered"]
        assert message is not None and "register_ddp" in message, message
        assert unchanged


class _Net(torch.nn.Module):
    """A small model; `unused`: with a layer no forward uses (DDP's find_unused_parameters
    and static_graph find it)."""

    def __init__(self, unused):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.unused = torch.nn.Linear(4, 4) if unused else None

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _train_small(rank, release, ddp_kwargs):
    model = _Net(unused=bool(ddp_kwargs))
    ddp = torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    # Two optimizers on one DDP module, as with an optimizer per param group.
    params = list(ddp.parameters())
    optimizers = [po.AdamW(part, lr=1e-2, weight_decay=0.1, release_grads=release)
                  for part in (params[:2], params[2:])]
    if release:
        for opt in optimizers:
            opt.register_ddp(ddp)
    gen = torch.Generator().manual_seed(100 + rank)
    micro_batches = 1 if ddp_kwargs.get("static_graph") else 2  # DDP: no no_sync with it
    norms = []
    for _ in range(4):
        for micro in range(micro_batches):
            with contextlib.nullcontext() if micro == micro_batches - 1 else ddp.no_sync():
                (ddp(torch.randn(4, 8, generator=gen)).pow(3).sum() / 7).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, 0.3))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms


def _small_ranks(rank, world_size):
    torch.set_num_threads(1)
    return {(name, release): _train_small(rank, release, kwargs)
            for name, kwargs in [("plain", {}), ("unused", dict(find_unused_parameters=True)),
                                 ("static", dict(static_graph=True))]
            for release in (False, True)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_variants_release_as_without_release(world_size, tmp_path):
    """Three ranks (DDP divides by multiplying with 1/3, not exactly a division), a param
    DDP finds unused (it keeps no gradient and is not stepped), static_graph, two
    optimizers registered on one module, no_sync accumulation (but with static_graph, which
    DDP refuses it with)."""
    for rank, results in enumerate(run_ranks(_small_ranks, world_size, tmp_path=tmp_path)):
        for name in ("plain", "unused", "static"):
            params, norms = results[(name, True)]
            ref_params, ref_norms = results[(name, False)]
            assert all(torch.equal(a, b) for a, b in zip(norms, ref_norms)), (rank, name)
            for index, (p, q) in enumerate(zip(params, ref_params)):
                assert torch.equal(p, q), (rank, name, index)
