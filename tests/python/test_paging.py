"""Paged optimizer state (offload="host" | "nvme"): results bit-identical to offload=None
for every policy and budget, the hit rate of the plan policy, the pager's statistics, the
page file's life cycle, and the paging keyword arguments.
"""

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedoptim as po
from pagedoptim import paging
from pagedoptim.paging import env_settings

REPO = Path(__file__).resolve().parents[2]

PAGE = 4096
OPTIMIZERS = {
    "AdamW": lambda params, **kw: po.AdamW(params, lr=1e-2, weight_decay=0.1, **kw),
    "SGD": lambda params, **kw: po.SGD(params, lr=1e-2, momentum=0.9, nesterov=True, **kw),
    "Lion": lambda params, **kw: po.Lion(params, lr=1e-3, weight_decay=0.1, **kw),
}


def make_params(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in shapes]


def run(name, shapes, seed, steps, skip, **kw):
    """Steps an optimizer over params of `shapes`; param i gets no grad on the steps where
    skip(step, i). Returns (params, optimizer)."""
    params = [p.requires_grad_() for p in make_params(shapes, seed)]
    opt = OPTIMIZERS[name](params, page_bytes=PAGE, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        for i, p in enumerate(params):
            grad = torch.randn(p.shape, generator=g)
            p.grad = None if skip(step, i) else grad
        opt.step()
    return params, opt


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for index, state in sa["state"].items():
        assert state.keys() == sb["state"][index].keys()
        for key, value in state.items():
            other = sb["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), (index, key)
            else:
                assert value == other, (index, key)


def assert_traffic(opt, cache_bytes):
    """Bit-identical results prove little if no page ever left the cache: where the state
    has more pages than the cache holds, pages must have been evicted, written to the tier
    and read back (a lost write-back then shows in the results)."""
    stats = opt.paging_stats()
    pages = opt.memory_report()["num_pages"]
    if pages <= cache_bytes // PAGE:
        # (a device cache still copies each page in once from its home on the host)
        assert stats["evictions"] == 0, stats
        return
    assert stats["evictions"] > 0, stats
    assert sum(stats["bytes_written"].values()) > 0, stats
    assert sum(stats["bytes_read"].values()) > 0, stats


shapes_strategy = st.lists(
    st.one_of(st.tuples(st.integers(1, 3000)),
              st.tuples(st.integers(1, 40), st.integers(1, 90))),
    min_size=1, max_size=6)


# derandomize: the same examples every run, so a bug it can catch fails every run (drawn
# anew each time, it caught a planted lost update in 4 runs of 9).
@settings(max_examples=25, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(shapes=shapes_strategy, seed=st.integers(0, 2**16), name=st.sampled_from(list(OPTIMIZERS)),
       state_bits=st.sampled_from([32, 8]))
def test_paging_is_bit_identical_for_every_policy_and_budget(shapes, seed, name, state_bits,
                                                             tmp_path_factory):
    # Param i sits out the steps where (step + i) % 3 == 2: its pages leave the plan.
    skip = lambda step, i: (step + i) % 3 == 2  # noqa: E731
    bits = dict(state_bits=state_bits, master_bits=None)
    ref_params, ref = run(name, shapes, seed, 5, skip, **bits)
    nvme_dir = tmp_path_factory.mktemp("pages")
    for offload in ("host", "nvme"):
        for policy in ("lru", "plan", "auto"):
            for cache_bytes in (PAGE, 3 * PAGE, 1 << 30):
                params, opt = run(name, shapes, seed, 5, skip, offload=offload,
                                  cache_bytes=cache_bytes, policy=policy,
                                  nvme_dir=nvme_dir if offload == "nvme" else None, **bits)
                for p, q in zip(params, ref_params):
                    assert torch.equal(p, q), (offload, policy, cache_bytes)
                assert_same_state(opt, ref)
                stats = opt.paging_stats()
                assert stats["offload"] == offload
                assert stats["over_budget_pages"] == 0
                assert stats["peak_resident_pages"] <= max(1, cache_bytes // PAGE)
                assert_traffic(opt, cache_bytes)


@settings(max_examples=6, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(shapes=shapes_strategy, seed=st.integers(0, 2**16), name=st.sampled_from(list(OPTIMIZERS)),
       state_bits=st.sampled_from([32, 8]))
def test_the_gpu_paging_orchestration_is_bit_identical_on_the_simulated_device(
        shapes, seed, name, state_bits, tmp_path_factory):
    """The property above through the GPU's device cache (docs/gpu_paging.md) on the
    simulated device: copy streams that complete in random order, the table kernels' host
    emulation on a simulated compute stream. Its bits must be the CPU path's."""
    skip = lambda step, i: (step + i) % 3 == 2  # noqa: E731
    bits = dict(state_bits=state_bits, master_bits=None)
    ref_params, ref = run(name, shapes, seed, 4, skip, **bits)
    nvme_dir = tmp_path_factory.mktemp("pages")
    with paging.simulated_device():
        for offload in ("host", "nvme"):
            for policy in ("lru", "plan", "auto"):
                for cache_bytes in (PAGE, 3 * PAGE, 1 << 30):
                    params, opt = run(name, shapes, seed, 4, skip, offload=offload,
                                      cache_bytes=cache_bytes, policy=policy, prefetch=2,
                                      nvme_dir=nvme_dir if offload == "nvme" else None, **bits)
                    for p, q in zip(params, ref_params):
                        assert torch.equal(p, q), (offload, policy, cache_bytes)
                    assert_same_state(opt, ref)
                    stats = opt.paging_stats()
                    assert stats["device"] == "simulated" and stats["offload"] == offload
                    assert stats["peak_resident_pages"] <= max(1, cache_bytes // PAGE)
                    assert_traffic(opt, cache_bytes)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_released_grads_page_in_the_learned_order_on_the_simulated_device(name):
    """Gradient release: one native step per parameter inside backward; from the second
    backward on, the device cache prefetches in the order it learned."""
    # Each param spans a few 4 KiB pages of 8-bit state; neighbours share one.
    shapes = [(5000,), (60, 90), (3000,), (1,), (4096,), (2500,)]

    def train(**kw):
        params = [p.requires_grad_() for p in make_params(shapes, 5)]
        opt = OPTIMIZERS[name](params, page_bytes=PAGE, release_grads=True,
                               state_bits=8, master_bits=None, **kw)
        g = torch.Generator().manual_seed(6)
        for _ in range(4):
            grads = [torch.randn(p.shape, generator=g) for p in params]
            sum((p * grad).sum() for p, grad in zip(params, grads)).backward()
            opt.step()
        return params, opt

    ref_params, ref = train()
    with paging.simulated_device():
        params, opt = train(offload="host", cache_bytes=4 * PAGE)
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)
    assert_same_state(opt, ref)
    stats = opt.paging_stats()
    assert stats["learned_order_pages"] > 0 and stats["prefetch_hits"] > 0


@pytest.mark.parametrize("fault,error", [
    (dict(kind="eio", ops="read"), paging.PageIOError),
    (dict(kind="flip", ops="read", flip_at=7), paging.PageCorruptionError),
    (dict(kind="enospc", ops="write"), paging.PageIOError),
], ids=["eio", "checksum", "enospc"])
def test_page_file_faults_under_the_device_cache_lose_no_state(fault, error, tmp_path):
    """The fault tests through the simulated device: a fault raises its error; afterwards
    every page reads back and training goes on. A failed write-back happens behind a
    completed step and a failed read is finished by a retry, so the run must stay
    bit-identical to one that never failed."""
    # About 110 pages of fp32 state: well past the 16 bounce buffers above the page file.
    shapes = [(30000,), (100, 200), (5000,)]
    ref_params, ref = run("AdamW", shapes, 9, 4, lambda step, i: False, state_bits=32,
                          master_bits=None)
    params = [p.requires_grad_() for p in make_params(shapes, 9)]
    opt = OPTIMIZERS["AdamW"](params, page_bytes=PAGE, offload="nvme", nvme_dir=tmp_path,
                              cache_bytes=3 * PAGE, state_bits=32, master_bits=None)
    g = torch.Generator().manual_seed(10)
    failed = False
    # The engine (and its store) is made at the first step: inside both blocks.
    with paging.simulated_device(), paging.store_overrides(faults=[]):
        for step in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            if step == 2:
                paging.set_fault_rules(opt, [fault])
            try:
                opt.step()
                paging.drain(opt)
            except error:
                failed = True
            if step == 2:
                paging.set_fault_rules(opt, [])
                if opt.interrupted_step is not None:
                    opt.step()  # a failed read: the retry finishes the step exactly
    assert failed
    assert opt.paging_stats()["device"] == "simulated"
    opt.state_dict()  # every page reads back
    # A failed write-back happened behind a completed step, a failed read was retried: the
    # run is bit-identical to one that never failed.
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)
    assert_same_state(opt, ref)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("prefetch", [0, 1, 4, 16])
def test_prefetch_depth_never_changes_results(name, prefetch, tmp_path):
    shapes = [(5000,), (17, 33), (1,), (2048,)]
    skip = lambda step, i: step == 1 and i == 0  # noqa: E731
    ref_params, ref = run(name, shapes, 3, 4, skip, state_bits=32, master_bits=None)
    params, opt = run(name, shapes, 3, 4, skip, state_bits=32, master_bits=None,
                      offload="nvme", nvme_dir=tmp_path, cache_bytes=5 * PAGE,
                      prefetch=prefetch)
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)
    assert_same_state(opt, ref)


@pytest.mark.parametrize("policy", ["plan", "lru"])
def test_cyclic_step_hit_rate_reaches_budget_over_state(policy, tmp_path):
    # fp32 AdamW: 8 bytes of state per element, so one 8 KiB page holds 1024 elements and
    # this parameter spans 64 pages; the cache holds 32.
    page = 8192
    p = torch.randn(64 * 1024, requires_grad=True)
    opt = po.AdamW([p], state_bits=32, master_bits=None, page_bytes=page, offload="nvme",
                   nvme_dir=tmp_path, cache_bytes=32 * page, policy=policy)
    state_pages = None
    rates = []
    for step in range(6):
        p.grad = torch.randn_like(p)
        before = opt.paging_stats()
        opt.step()
        after = opt.paging_stats()
        state_pages = after["num_pages"]
        hits = after["hits"] - before["hits"]
        pins = hits + after["misses"] - before["misses"]
        rates.append(hits / pins)
    optimum = 32 / state_pages
    # The driver reverses its scan every step, so the pages used last are needed first:
    # the plan policy keeps exactly those, and LRU happens to as well.
    assert all(abs(rate - optimum) < 0.05 for rate in rates[2:]), (rates, optimum)


def test_paging_stats_report_traffic_backend_and_stalls(tmp_path):
    p = torch.randn(20000, requires_grad=True)
    opt = po.AdamW([p], state_bits=32, master_bits=None, page_bytes=PAGE, offload="nvme",
                   nvme_dir=tmp_path, cache_bytes=4 * PAGE)
    assert opt.paging_stats()["hits"] == 0  # before the first step
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    stats = opt.paging_stats()
    assert stats["offload"] == "nvme"
    assert stats["io_backend"] in ("io_uring", "posix")
    assert stats["bytes_read"]["nvme"] == stats["reads"] * PAGE > 0
    assert stats["bytes_written"]["nvme"] == stats["writes"] * PAGE > 0
    assert stats["stall_seconds"] >= 0.0
    assert stats["misses"] > 0 and stats["zero_fills"] == stats["num_pages"]
    assert stats["page_file"].startswith(str(tmp_path))
    assert stats["pending_error"] is None
    assert stats["resident_bytes"] <= 4 * PAGE
    none = po.AdamW([torch.randn(3, requires_grad=True)], state_bits=32, master_bits=None)
    assert none.paging_stats()["offload"] is None


def open_files_under(directory):
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            found.append(target)
    return found


def test_page_file_is_private_and_goes_with_the_optimizer(tmp_path):
    p = torch.randn(5000, requires_grad=True)
    opt = po.AdamW([p], page_bytes=PAGE, offload="nvme", nvme_dir=tmp_path, cache_bytes=PAGE)
    p.grad = torch.randn_like(p)
    opt.step()
    # Unlinked as soon as it is open: nothing to clean up even if the process is killed.
    assert list(tmp_path.iterdir()) == []
    files = open_files_under(tmp_path)
    assert len(files) == 1 and files[0].endswith("(deleted)")
    fd_path = next(f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")
                   if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)))
    assert os.stat(fd_path).st_mode & 0o777 == 0o600
    del opt
    gc.collect()
    assert open_files_under(tmp_path) == []


def test_load_state_dict_replaces_the_page_file(tmp_path):
    p = torch.randn(3000, requires_grad=True)
    opt = po.AdamW([p], page_bytes=PAGE, offload="nvme", nvme_dir=tmp_path, cache_bytes=PAGE)
    p.grad = torch.randn_like(p)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    gc.collect()
    assert len(open_files_under(tmp_path)) == 1


# --- the keyword arguments ----------------------------------------------------------------

def test_a_cache_size_without_a_tier_is_an_error_naming_offload(monkeypatch):
    """cache_bytes alone once paged CPU state to a file under $TMPDIR without a word."""
    with pytest.raises(ValueError, match=r"cache_bytes=1048576 .* set offload='host' .* or "
                                         r"offload='nvme'"):
        po.AdamW([torch.randn(3, requires_grad=True)], cache_bytes="1MiB")
    monkeypatch.setenv("PAGEDOPTIM_CACHE_BYTES", "1MiB")
    with pytest.raises(env_settings.EnvironmentSettingError,
                       match=r"PAGEDOPTIM_CACHE_BYTES.*set offload="):
        po.patch()


def test_implied_offload(tmp_path):
    options = po.AdamW([torch.randn(3, requires_grad=True)], nvme_dir=tmp_path)._options
    assert paging.resolve_offload(options) == "nvme"
    store = paging.store_options(options)
    assert store["cache_bytes"] == paging.DEFAULT_CACHE_BYTES
    assert store["nvme_dir"] == str(tmp_path)
    options = po.AdamW([torch.randn(3, requires_grad=True)])._options
    assert paging.store_options(options) is None


@pytest.mark.parametrize("written,expected", [("1GiB", 1 << 30), ("1GB", 10**9),
                                              ("64 KiB", 64 << 10), ("65536", 65536)])
def test_sizes_are_written_as_the_environment_and_optim_args_write_them(written, expected,
                                                                       monkeypatch, tmp_path):
    """cache_bytes="1GB" in code means what PAGEDOPTIM_CACHE_BYTES=1GB means."""
    opt = po.AdamW([torch.randn(3, requires_grad=True)], offload="nvme", nvme_dir=tmp_path,
                   cache_bytes=written, page_bytes="8KiB")
    monkeypatch.setenv("PAGEDOPTIM_CACHE_BYTES", written)
    from_environment = env_settings.settings_from_environment()["cache_bytes"]
    assert opt.settings["cache_bytes"] == from_environment == expected
    assert opt.settings["page_bytes"] == 8192


def test_names_and_paths_are_written_as_the_environment_writes_them(monkeypatch, tmp_path):
    """offload="NVME" as PAGEDOPTIM_OFFLOAD=NVME; nvme_dir="~/pages" is the home's folder."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "pages").mkdir()
    p = torch.nn.Parameter(torch.randn(1000))
    opt = po.AdamW([p], offload="NVME", policy="LRU", nvme_dir="~/pages", cache_bytes="64KiB")
    assert (opt.settings["offload"], opt.settings["policy"]) == ("nvme", "lru")
    assert opt.settings["nvme_dir"] == str(tmp_path / "pages")
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.paging_stats()["page_file"].startswith(str(tmp_path / "pages"))
    with pytest.raises(ValueError, match=r"nvme_dir '.*missing' does not exist"):
        po.AdamW([p], nvme_dir="~/missing")


def test_examples_take_sizes_with_units():
    from pagedoptim.paging.setting_text import byte_size_argument
    assert byte_size_argument("64KiB") == 65536
    result = subprocess.run([sys.executable, str(REPO / "examples" / "peft_lora.py"),
                             "--cache-bytes", "64XiB"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "--cache-bytes: '64XiB': expected a number of bytes or a size" in result.stderr


@pytest.mark.parametrize("kw,error,word", [
    (dict(offload="host", cache_bytes="1XB"), ValueError, "cache_bytes"),
    (dict(offload="disk"), ValueError, "offload"),
    (dict(offload="host", nvme_dir="/tmp"), ValueError, "nvme_dir"),
    (dict(nvme_dir=3), TypeError, "nvme_dir"),
    (dict(offload="nvme", cache_bytes=-1), ValueError, "cache_bytes"),
    (dict(offload="nvme", cache_bytes=1.5), TypeError, "cache_bytes"),
    (dict(offload="nvme", prefetch=-1), ValueError, "prefetch"),
    (dict(offload="nvme", policy="mru"), ValueError, "policy"),
    (dict(prefetch=8), ValueError, "prefetch"),
    (dict(policy="lru"), ValueError, "policy"),
])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bad_paging_arguments_name_themselves(name, kw, error, word):
    with pytest.raises(error) as info:
        OPTIMIZERS[name]([torch.randn(3, requires_grad=True)], **kw)
    assert word in str(info.value)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_missing_nvme_dir_is_reported_at_construction(name, tmp_path):
    """Not at the first step, after the model was loaded and the first batch ran."""
    missing = tmp_path / "not-there"
    with pytest.raises(ValueError, match=r"nvme_dir .*not-there.* does not exist"):
        OPTIMIZERS[name]([torch.randn(3, requires_grad=True)], nvme_dir=missing)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        OPTIMIZERS[name]([torch.randn(3, requires_grad=True)], offload="nvme", nvme_dir=a_file)


def test_the_default_nvme_dir_is_checked_at_construction(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "gone"))
    with pytest.raises(ValueError, match=r"default nvme_dir \(\$TMPDIR\)"):
        po.AdamW([torch.randn(3, requires_grad=True)], offload="nvme")
    # offload='host' on the CPU has no page file: nothing to check.
    po.AdamW([torch.randn(3, requires_grad=True)], offload="host")


def test_an_unwritable_nvme_dir_is_reported_at_construction(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    # Root may write anywhere, and CI runs as root: ask the kernel as an unprivileged user
    # would see it, through the same os.access the check uses.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False
                        if os.fspath(path) == str(locked) else real_access(path, mode, **kw))
    with pytest.raises(PermissionError, match="not writable"):
        po.AdamW([torch.randn(3, requires_grad=True)], nvme_dir=locked)


@pytest.mark.parametrize("kw", [
    dict(offload="host"), dict(offload="nvme"), dict(nvme_dir="/tmp"), dict(offload="host",
    cache_bytes=4096, prefetch=0, policy="lru"), dict(offload="nvme", policy="plan", prefetch=9)])
def test_paging_arguments_are_accepted(kw):
    p = torch.randn(100, requires_grad=True)
    opt = po.AdamW([p], page_bytes=PAGE, **kw)
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.paging_stats()["offload"] == kw.get("offload", "nvme")


@pytest.mark.parametrize("dtype,master_bits", [(torch.float32, None), (torch.bfloat16, 24)])
@pytest.mark.parametrize("release_grads", [False, True])
def test_8bit_bf16_and_released_grads_are_bit_identical_when_paged(dtype, master_bits,
                                                                   release_grads, tmp_path):
    """The compressed state (8-bit moments, the bf16 master residual) and per-parameter steps
    inside backward page like everything else."""
    def train(**paging_kw):
        gen = torch.Generator().manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.Tanh(),
                                    torch.nn.Linear(96, 30)).to(dtype)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        opt = po.AdamW(model.parameters(), lr=1e-2, state_bits=8, master_bits=master_bits,
                       release_grads=release_grads, page_bytes=PAGE, **paging_kw)
        for step in range(4):
            g = torch.Generator().manual_seed(100 + step)
            x = torch.randn(16, 48, generator=g).to(dtype)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return list(model.parameters()), opt

    ref_params, ref = train()
    params, opt = train(offload="nvme", nvme_dir=tmp_path, cache_bytes=PAGE, prefetch=2)
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)
    assert_same_state(opt, ref)
    assert opt.paging_stats()["reads"] > 0


def _paged_run(steps=6, **paging_kwargs):
    """12 params of one 4 KiB page each through a 4-page cache; param i sits out the steps
    where (step + i) % 3 == 2, so the plan of each step leaves pages out."""
    params = [torch.nn.Parameter(t) for t in make_params([(480,)] * 12, seed=3)]
    opt = po.AdamW(params, state_bits=32, master_bits=None, page_bytes=PAGE,
                   cache_bytes=4 * PAGE, **paging_kwargs)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = None if (step + i) % 3 == 2 else torch.ones_like(p)
        opt.step()
    return params, opt.paging_stats()


@pytest.mark.filterwarnings("ignore:pagedoptim. offload='host' with params on the CPU")
def test_the_eviction_policy_reaches_the_pager():
    """`policy` changes which pages stay, so it changes the hits (never the results): the
    plan-aware policy keeps the pages the next steps need, LRU the ones last used. Measured
    on this workload: 15 hits for plan (and auto, which picks it for a step with a plan), 12
    for lru."""
    results = {policy: _paged_run(offload="host", policy=policy, prefetch=0)
               for policy in ("lru", "plan", "auto")}
    assert {policy: stats["policy"] for policy, (_, stats) in results.items()} == {
        "lru": "lru", "plan": "plan", "auto": "auto"}
    hits = {policy: stats["hits"] for policy, (_, stats) in results.items()}
    assert hits["plan"] > hits["lru"], hits
    assert hits["auto"] == hits["plan"], hits
    for params, _ in results.values():
        assert all(torch.equal(p, q) for p, q in zip(params, results["lru"][0]))


@pytest.mark.parametrize("offload", ["host", "nvme"])
@pytest.mark.filterwarnings("ignore:pagedoptim. offload='host' with params on the CPU")
def test_prefetch_reaches_the_cpu_pager(offload, tmp_path):
    nvme_dir = str(tmp_path) if offload == "nvme" else None
    params_off, without = _paged_run(offload=offload, nvme_dir=nvme_dir, prefetch=0)
    params_on, with_prefetch = _paged_run(offload=offload, nvme_dir=nvme_dir, prefetch=4)
    assert (without["prefetch"], with_prefetch["prefetch"]) == (0, 4)
    assert without["prefetch_hits"] == 0
    assert with_prefetch["prefetch_hits"] > 0, with_prefetch
    assert all(torch.equal(p, q) for p, q in zip(params_off, params_on))
