"""close(), `with`, a shared nvme_dir, and the checks at construction (docs/reliability.md)."""

from __future__ import annotations

import errno
import gc
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import pagedoptim as po
from pagedoptim import paging
from pagedoptim.cli.process_memory import rss_bytes
from pagedoptim.paging import state_plan

PAGE = 4096
STEPS = 4


def _fds_under(directory) -> list[int]:
    """Descriptors of this process open on files under `directory` (page files are unlinked,
    so their links read '<dir>/pagedoptim-XXXXXX/pages (deleted)')."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:  # listdir's own descriptor, closed by now
            continue
        if target.startswith(str(directory)):
            found.append(int(name))
    return found


def _open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _paged(params, nvme_dir, **kw):
    return po.AdamW(params, lr=1e-2, nvme_dir=nvme_dir, page_bytes=PAGE, cache_bytes=2 * PAGE,
                    **kw)


def _train(seed: int, nvme_dir=None) -> torch.Tensor:
    """STEPS AdamW steps on one param of 40,000 elements: ~20 pages through a 2-page cache."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(40_000, generator=gen))
    opt = _paged([p], nvme_dir) if nvme_dir is not None else po.AdamW([p], lr=1e-2)
    with opt:
        for _ in range(STEPS):
            p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
    return p.detach().clone()


# -- close() and `with` ----------------------------------------------------------------------

def test_close_releases_the_page_file_at_once(tmp_path):
    p = torch.nn.Parameter(torch.randn(40_000))
    opt = _paged([p], tmp_path)
    p.grad = torch.randn_like(p)
    opt.step()
    [fd] = _fds_under(tmp_path)
    # The plan's page file is what the tier reserved (posix_fallocate) at the first step.
    assert os.fstat(fd).st_size == opt.memory_report()["state_placement"]["nvme"]
    gc.disable()  # the release must not wait for the collector
    try:
        opt.close()
        assert _fds_under(tmp_path) == []
    finally:
        gc.enable()
    assert opt.closed
    opt.close()  # idempotent
    assert opt.closed


def test_with_closes_on_exit_and_on_error(tmp_path):
    p = torch.nn.Parameter(torch.randn(40_000))
    with _paged([p], tmp_path) as opt:
        p.grad = torch.randn_like(p)
        opt.step()
        assert len(_fds_under(tmp_path)) == 1
    assert opt.closed and _fds_under(tmp_path) == []
    with pytest.raises(KeyError):
        with _paged([p], tmp_path) as other:
            other.step()
            raise KeyError("boom")
    assert other.closed and _fds_under(tmp_path) == []
    with pytest.raises(RuntimeError, match="was closed"):
        with opt:
            pass


USES = {
    "step": lambda opt, p: opt.step(),
    "state_dict": lambda opt, p: opt.state_dict(),
    "torch_state_dict": lambda opt, p: opt.torch_state_dict(),
    "load_state_dict": lambda opt, p: opt.load_state_dict({"state": {}, "param_groups": []}),
    "memory_report": lambda opt, p: opt.memory_report(),
    "paging_stats": lambda opt, p: opt.paging_stats(),
    "add_param_group": lambda opt, p: opt.add_param_group({"params": [torch.zeros(3)]}),
    "state[p]": lambda opt, p: opt.state[p],
    "len(state)": lambda opt, p: len(opt.state),
    "iter(state)": lambda opt, p: list(opt.state),
    "deepcopy": lambda opt, p: __import__("copy").deepcopy(opt),
}


@pytest.mark.parametrize("use", list(USES))
@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion", "SkewAdam"])
def test_a_closed_optimizer_raises_on_every_use(name, use, tmp_path):
    p = torch.nn.Parameter(torch.randn(64, 64))
    if name == "SkewAdam":
        opt = po.SkewAdam([("w", p)], nvme_dir=tmp_path)
    else:
        opt = getattr(po, name)([p], lr=1e-2, nvme_dir=tmp_path,
                                **({"momentum": 0.9} if name == "SGD" else {}))
    p.grad = torch.randn_like(p)
    opt.step()
    opt.close()
    with pytest.raises(RuntimeError, match=rf"this {name} was closed"):
        USES[use](opt, p)


def test_a_closed_optimizer_with_release_grads_no_longer_steps_in_backward(tmp_path):
    p = torch.nn.Parameter(torch.randn(128))
    opt = po.AdamW([p], lr=1e-2, release_grads=True, nvme_dir=tmp_path)
    (p * p).sum().backward()
    stepped = p.detach().clone()
    opt.close()
    (p * p).sum().backward()  # the hook is gone: the grad stays, the param is not stepped
    assert torch.equal(p.detach(), stepped) and p.grad is not None


# -- one nvme_dir, several optimizers ----------------------------------------------------------

def test_two_optimizers_in_one_process_share_an_nvme_dir(tmp_path):
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    params = [torch.nn.Parameter(torch.randn(40_000, generator=g)) for g in gens]
    opts = [_paged([p], tmp_path) for p in params]
    for _ in range(STEPS):  # interleaved, so both page files are in use at once
        for p, opt, gen in zip(params, opts, gens):
            p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
    assert len(_fds_under(tmp_path)) == 2
    for p, opt, seed in zip(params, opts, (1, 2)):
        assert opt.paging_stats()["bytes_read"]["nvme"] > 0  # it really paged
        assert torch.equal(p.detach(), _train(seed))
        opt.close()
    assert os.listdir(tmp_path) == []


_CHILD = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_lifecycle import _train
torch.save(_train(int(sys.argv[1]), sys.argv[2]), sys.argv[3])
"""


def test_two_processes_share_an_nvme_dir(tmp_path):
    pages = tmp_path / "pages"
    pages.mkdir()
    script = _CHILD.format(tests=os.path.dirname(__file__))
    children = [subprocess.Popen([sys.executable, "-c", script, str(seed), str(pages),
                                  str(tmp_path / f"{seed}.pt")]) for seed in (1, 2)]
    for child in children:
        assert child.wait(timeout=120) == 0
    for seed in (1, 2):
        assert torch.equal(torch.load(tmp_path / f"{seed}.pt"), _train(seed))
    assert os.listdir(pages) == []


# -- leaks -------------------------------------------------------------------------------------

# 1000 create/step/close cycles of a paged optimizer: ~2.5 s on 2 cores.
LEAK_CYCLES = 1000


def test_creating_and_closing_paged_optimizers_leaves_fds_and_rss_flat(tmp_path):
    p = torch.nn.Parameter(torch.randn(8192))
    p.grad = torch.randn_like(p)

    def cycle() -> None:
        with _paged([p], tmp_path) as opt:
            opt.step()

    for _ in range(20):  # warm up allocator pools and lazily loaded code
        cycle()
    fds, rss = _open_fd_count(), rss_bytes()
    start = time.perf_counter()
    for _ in range(LEAK_CYCLES):
        cycle()
    elapsed = time.perf_counter() - start
    assert _open_fd_count() == fds
    # Each cycle holds ~10 pages (40 KiB) of native memory and a 4 MiB-aligned ring; a leak of
    # either would pass 1000 * 40 KiB = 40 MiB. Allocator noise stays well under 4 MiB.
    assert rss_bytes() - rss < 4 << 20
    assert os.listdir(tmp_path) == []
    print(f"{LEAK_CYCLES} cycles in {elapsed:.2f} s")


DEVICE_LEAK_CYCLES = 200


@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_device_cached_optimizers_give_back_every_device_resource(offload, tmp_path):
    """On the simulated device (the GPU paging orchestration without a GPU): create, step,
    fail a load_state_dict (a second engine built, then dropped) and close device-cached
    optimizers DEVICE_LEAK_CYCLES times; the device's memory (device and pinned host bytes and
    allocations), streams and events are exactly what they were before, which is nothing but
    the device's own compute stream. Each cycle holds them (checked), so a leak of any one
    object per cycle would show 200 times over. scripts/gpu_check.sh checks the same on a
    real GPU with torch.cuda.memory_allocated and the pinned bytes."""
    from pagedoptim._native import native
    usage = native.simulated_device_usage
    p = torch.nn.Parameter(torch.randn(1, 2048))  # 8-bit state: 2 pages, 1 in the cache
    p.grad = torch.randn_like(p)
    kw = dict(offload=offload, nvme_dir=tmp_path if offload == "nvme" else None,
              cache_bytes=PAGE)

    def cycle() -> dict:
        with po.AdamW([p], lr=1e-2, page_bytes=PAGE, prefetch=2, min_8bit_size=0,
                      **kw) as opt:
            opt.step()
            held = usage()
            # One code short: found only while the new engine's pages are written.
            saved = opt.state_dict()
            saved["state"][0]["exp_avg_codes"] = saved["state"][0]["exp_avg_codes"][:, :-1]
            with pytest.raises(ValueError, match="'exp_avg_codes' has 2047 elements"):
                opt.load_state_dict(saved)
            opt.step()
        return held

    # What earlier tests in this process still hold stays out of the count: the GPU test
    # modules run on this same simulated device.
    gc.collect()
    before = usage()
    with paging.simulated_device():
        held = cycle()
        baseline = usage()
        for _ in range(DEVICE_LEAK_CYCLES):
            cycle()
        assert usage() == baseline
    assert held["device_bytes"] > before["device_bytes"]
    assert held["device_allocations"] > before["device_allocations"]
    assert held["streams"] > baseline["streams"] and held["events"] > before["events"]
    assert held["pinned_host_bytes"] > before["pinned_host_bytes"]
    # Nothing but the device's own compute stream, which the first cycle creates.
    assert baseline == {**before, "streams": max(before["streams"], 1)}


# -- checks at construction --------------------------------------------------------------------

def test_a_load_into_an_optimizer_with_state_gives_the_old_state_back():
    """load_state_dict builds the new state beside the old (so a bad state dict changes
    nothing) and then lets the old go: afterwards the device holds one state, not two. (While
    it loads it holds both: docs/reliability.md.)"""
    from pagedoptim._native import native
    usage = native.simulated_device_usage
    p = torch.nn.Parameter(torch.randn(1 << 15))
    p.grad = torch.randn_like(p)
    memory = ("device_bytes", "device_allocations", "pinned_host_bytes",
              "pinned_host_allocations")

    def held() -> dict:
        now = usage()
        return {key: now[key] for key in memory}

    gc.collect()
    before = held()
    with paging.simulated_device():
        opt = po.AdamW([p], lr=1e-2, page_bytes=PAGE, offload="host", cache_bytes=1 << 30)
        opt.step()
        one_state = held()
        assert one_state["device_bytes"] > before["device_bytes"]
        for _ in range(3):
            opt.load_state_dict(opt.state_dict())
            gc.collect()
            opt.step()
            assert held() == one_state
        opt.close()


def test_a_page_file_larger_than_the_free_space_is_reported_at_construction(tmp_path,
                                                                            monkeypatch):
    p = torch.nn.Parameter(torch.randn(40_000))
    sizing = _paged([p], tmp_path)
    planned = state_plan.plan_state(sizing.state_store, "cpu")
    sizing.close()
    needed = planned.num_pages * planned.page_bytes
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=needed - 100)
                        if os.fspath(path) == str(tmp_path) else real(path))
    with pytest.raises(OSError, match=rf"nvme_dir .* needs {needed} bytes: 100 bytes are "
                                      "missing") as info:
        _paged([p], tmp_path)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=needed))
    _paged([p], tmp_path).close()  # exactly enough is enough
