"""GPU paging: CUDA params whose state lives in a device page cache of cache_bytes,
over pinned host memory (offload="host") or the NVMe page file behind pinned bounce buffers
(offload="nvme").

What is held here:

* Paging never changes results: params and every state tensor are bit-identical to
  offload=None, for every policy, for budgets of one page, a few pages and most of the state,
  for both tiers, for 8-bit and fp32 state, bf16 params with a residual, and gradient release.
* Memory you can predict: during a step torch.cuda.max_memory_allocated() grows by at most
  cache_bytes plus STEP_OVERHEAD_BYTES over what the params and grads hold, and
  memory_report()/paging_stats() say where the bytes are and how fast each link ran.
* Bad input fails at construction: a cache smaller than a page, or larger than the free
  device memory.
* Faults of the page file under a GPU cache raise PageIOError / PageCorruptionError, and no
  state is lost: after the fault the state still reads back, and training goes on.

The same orchestration runs in CI on the simulated device (tests/cpp/paging/
test_device_cache_store.cpp, and the kernel bodies in tests/cpp/kernels/
test_table_emulation.cpp). Without a CUDA device (or a pagedoptim built with its CUDA
kernels) this module runs there too (tests/python/gpu_target.py): params are CPU tensors,
the resident run is the CPU path and the paged one the simulated device's cache; the tests
of CUDA memory itself are skipped with the reason.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pagedoptim as po
from gpu_target import TARGET, needs_cuda
from pagedoptim import paging

# What a step may allocate on the device beyond the page cache: its work tables, scalars and
# uploads, rounded by the caching allocator (docs/gpu_paging.md).
STEP_OVERHEAD_BYTES = 8 << 20
PAGE = 64 << 10


DEVICE = TARGET.device


@pytest.fixture(autouse=True)
def _on_the_target():
    with TARGET.active():
        yield

# Shapes that fill many pages of PAGE bytes, with small params sharing pages.
SHAPES = [(512, 384), (1000,), (33,), (256, 257), (7, 13), (4096,), (300, 200)]


def make_params(dtype: torch.dtype) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for i, shape in enumerate(SHAPES):
        # fp32 norms next to 16-bit weights, as in a bf16 model
        t = torch.randn(shape, generator=gen) * 0.1
        params.append(nn.Parameter(t.to(DEVICE, dtype if len(shape) > 1 else torch.float32)))
    return params


def grads_for(params: list[nn.Parameter], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=gen) * 10.0 ** ((i % 4) - 3)).to(DEVICE, p.dtype)
            for i, p in enumerate(params)]


def train(kind: str, dtype: torch.dtype, steps: int = 4, **kw) -> tuple[list, po.AdamW]:
    params = make_params(dtype)
    cls = {"adamw": po.AdamW, "lion": po.Lion, "sgd": po.SGD}[kind]
    extra = {"momentum": 0.9} if kind == "sgd" else {}
    opt = cls(params, lr=1e-2, page_bytes=PAGE, **extra, **kw)
    for s in range(steps):
        for i, (p, g) in enumerate(zip(params, grads_for(params, s))):
            p.grad = None if s == 1 and i == 2 else g  # step 1: one param has no grad
        opt.step()
    TARGET.synchronize()
    return params, opt


def assert_identical(expected: tuple[list, po.AdamW], actual: tuple[list, po.AdamW]) -> None:
    for i, (a, b) in enumerate(zip(expected[0], actual[0])):
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), \
            f"param {i} differs"
    sa, sb = expected[1].state_dict()["state"], actual[1].state_dict()["state"]
    assert sa.keys() == sb.keys()
    for key in sa:
        for name, value in sa[key].items():
            other = sb[key][name]
            # reshape: a 0-dim tensor (the step counter) has no byte view of its own.
            assert torch.equal(value.cpu().reshape(-1).view(torch.uint8),
                               other.cpu().reshape(-1).view(torch.uint8)), \
                f"state {key}/{name} differs"


BUDGETS = {"one_page": PAGE, "four_pages": 4 * PAGE, "most": 64 * PAGE}


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("policy", ["lru", "plan", "auto"])
@pytest.mark.parametrize("offload", ["host", "nvme"])
@pytest.mark.parametrize("fmt", [(torch.bfloat16, 8, 24), (torch.float32, 32, None)],
                         ids=["bf16-8bit-residual", "fp32-exact"])
def test_paged_state_is_bit_identical_to_resident_state(fmt, offload, policy, budget, tmp_path):
    dtype, state_bits, master_bits = fmt
    kw = dict(state_bits=state_bits, master_bits=master_bits)
    resident = train("adamw", dtype, **kw)
    nvme = dict(nvme_dir=tmp_path) if offload == "nvme" else {}
    paged = train("adamw", dtype, offload=offload, cache_bytes=BUDGETS[budget], policy=policy,
                  prefetch=2, **nvme, **kw)
    assert_identical(resident, paged)
    stats = paged[1].paging_stats()
    assert stats["device"] == TARGET.engine_device and stats["offload"] == offload
    assert stats["peak_resident_pages"] <= BUDGETS[budget] // PAGE
    if budget != "most":
        assert stats["writes"] > 0 and stats["links"]["device_to_host"]["gb_per_s"] > 0
    assert stats["links"]["host_to_device"]["bytes"] == stats["reads"] * PAGE


@pytest.mark.parametrize("kind", ["sgd", "lion"])
def test_sgd_and_lion_page_bit_identically(kind):
    resident = train(kind, torch.bfloat16)
    paged = train(kind, torch.bfloat16, offload="host", cache_bytes=3 * PAGE)
    assert_identical(resident, paged)


def test_gradient_release_pages_in_the_learned_order_and_stays_identical():
    def run(**kw):
        params = make_params(torch.bfloat16)
        opt = po.AdamW(params, lr=1e-2, page_bytes=PAGE, release_grads=True, **kw)
        for s in range(4):
            # d/dp sum(p * g) is g exactly: each param's hook steps it with g in backward
            loss = sum((p * g).sum() for p, g in zip(params, grads_for(params, s)))
            loss.float().backward()
            opt.step()
        TARGET.synchronize()
        return params, opt

    resident = run()
    paged = run(offload="host", cache_bytes=6 * PAGE)
    assert_identical(resident, paged)
    stats = paged[1].paging_stats()
    assert stats["learned_order_pages"] > 0
    assert stats["prefetch_hits"] > 0


@needs_cuda("CUDA memory statistics")
def test_device_memory_of_a_step_is_params_grads_and_the_cache():
    params = make_params(torch.bfloat16)
    cache = 8 * PAGE
    opt = po.AdamW(params, lr=1e-2, page_bytes=PAGE, offload="host", cache_bytes=cache)
    for s in range(3):
        for p, g in zip(params, grads_for(params, s)):
            p.grad = g
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        grown = torch.cuda.max_memory_allocated() - baseline
        assert grown <= cache + STEP_OVERHEAD_BYTES, (s, grown)
    report = opt.memory_report()
    placement = report["state_placement"]
    assert placement["device"] <= cache
    assert placement["pinned_host"] == report["num_pages"] * PAGE
    assert "nvme" not in placement


def test_memory_report_names_the_page_file_under_a_gpu_cache(tmp_path):
    _, opt = train("adamw", torch.bfloat16, offload="nvme", nvme_dir=tmp_path,
                   cache_bytes=4 * PAGE)
    placement = opt.memory_report()["state_placement"]
    assert placement["nvme"] == opt.memory_report()["num_pages"] * PAGE
    assert 0 < placement["pinned_host"] < placement["nvme"]  # bounce buffers only
    stats = opt.paging_stats()
    assert stats["bytes_written"]["nvme"] > 0 and stats["page_file"] is not None


def test_a_cache_smaller_than_a_page_fails_at_construction():
    p = nn.Parameter(torch.randn(64, device=DEVICE))
    with pytest.raises(ValueError, match="at least one page"):
        po.AdamW([p], offload="host", cache_bytes=PAGE - 1, page_bytes=PAGE)


@needs_cuda("the free memory of a CUDA device")
def test_a_cache_larger_than_free_device_memory_fails_at_construction():
    p = nn.Parameter(torch.randn(64, device=DEVICE))
    free, _ = torch.cuda.mem_get_info(DEVICE)
    with pytest.raises(ValueError, match="bytes free on cuda:0"):
        po.AdamW([p], offload="host", cache_bytes=free + (1 << 30))


@needs_cuda("the free memory of a CUDA device")
def test_paging_checks_judge_the_device_the_params_are_on_at_the_first_step():
    """`opt = po.AdamW(model.parameters(), ...); model.cuda()`: the cache is checked against
    the GPU's free memory when the state is created there, before any of it is."""
    model = nn.Linear(64, 64)
    free, _ = torch.cuda.mem_get_info(DEVICE)
    opt = po.AdamW(model.parameters(), offload="host", cache_bytes=free + (1 << 30))
    model.to(DEVICE)
    model(torch.randn(2, 64, device=DEVICE)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="bytes free on cuda:0"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def paged_with_faults(tmp_path, steps: int) -> tuple[list, po.AdamW]:
    params = make_params(torch.bfloat16)
    # The engine, and so its page store, is built at the first step: inside the block.
    with paging.store_overrides(faults=[]):
        opt = po.AdamW(params, lr=1e-2, page_bytes=PAGE, offload="nvme", nvme_dir=tmp_path,
                       cache_bytes=4 * PAGE)
        for s in range(steps):
            for p, g in zip(params, grads_for(params, s)):
                p.grad = g
            opt.step()
    paging.drain(opt)
    return params, opt


def test_a_failed_write_back_under_a_gpu_cache_loses_no_state(tmp_path):
    """The step runs to its end; its error comes at the end of a later plan or at drain();
    the pages stay in the bounce buffers, and training goes on bit-identically."""
    params, opt = paged_with_faults(tmp_path, 2)
    paging.set_fault_rules(opt, [dict(kind="enospc", ops="write")])
    for p, g in zip(params, grads_for(params, 2)):
        p.grad = g
    with pytest.raises(paging.PageIOError):
        opt.step()
        paging.drain(opt)
    assert opt.paging_stats()["write_errors"] > 0
    paging.set_fault_rules(opt, [])
    for p, g in zip(params, grads_for(params, 3)):
        p.grad = g
    opt.step()
    TARGET.synchronize()
    resident = make_params(torch.bfloat16)
    ref = po.AdamW(resident, lr=1e-2, page_bytes=PAGE)
    for s in range(4):
        for p, g in zip(resident, grads_for(resident, s)):
            p.grad = g
        ref.step()
    assert_identical((resident, ref), (params, opt))


@pytest.mark.parametrize("fault,error", [
    (dict(kind="eio", ops="read"), paging.PageIOError),
    (dict(kind="flip", ops="read", flip_at=100), paging.PageCorruptionError),
], ids=["eio", "checksum"])
def test_a_failed_read_under_a_gpu_cache_raises_and_loses_no_state(fault, error, tmp_path):
    params, opt = paged_with_faults(tmp_path, 2)
    paging.set_fault_rules(opt, [fault])
    for p, g in zip(params, grads_for(params, 2)):
        p.grad = g
    with pytest.raises(error):
        opt.step()
    paging.set_fault_rules(opt, [])
    # Every page still reads back (the failed one from the file, intact), and training goes
    # on: the step() below, with the same gradients, finishes the interrupted step
    # (docs/reliability.md, "Steps that fail"); here: nothing lost, nothing corrupt.
    state = opt.state_dict()["state"]
    assert all(torch.isfinite(v.float()).all() for s in state.values() for v in s.values())
    opt.step()
    paging.drain(opt)
    assert all(torch.isfinite(p.float()).all() for p in params)
