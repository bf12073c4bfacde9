"""The pager's failure modes, end to end: a full disk, EIO, short reads and writes, a
flipped byte, io_uring refused. Each ends in a clear exception (or a working fallback with
a warning), and afterwards the optimizer still saves a checkpoint that loads into a fresh
optimizer and continues exactly.
"""

import copy
import errno
import gc
import io
import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch

import pagedoptim as po
from pagedoptim import paging

PAGE = 8192
SHAPES = [(9000,), (31, 70), (5,), (4000,)]
KW = dict(lr=1e-2, weight_decay=0.1, state_bits=32, master_bits=None, page_bytes=PAGE)


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]


def grads_for(step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def step(opt, params, index):
    for p, grad in zip(params, grads_for(index)):
        p.grad = grad.clone()
    opt.step()


def paged(params, tmp_path, **kw):
    """An nvme-paged AdamW whose page file takes injected faults (none until set)."""
    with paging.store_overrides(faults=[], io_backend=kw.pop("io_backend", "auto")):
        opt = po.AdamW(params, offload="nvme", nvme_dir=tmp_path, cache_bytes=3 * PAGE,
                       prefetch=2, **KW, **kw)
        opt.state_store.ensure_engine()
    return opt


def assert_same(params_a, opt_a, params_b, opt_b):
    for p, q in zip(params_a, params_b):
        assert torch.equal(p, q)
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for key, value in sa[i].items():
            assert torch.equal(value, sb[i][key]), (i, key)


def clone_params(params):
    return [p.detach().clone().requires_grad_() for p in params]


def continues_from_checkpoint(opt, params, first_step, tmp_path, disk_failing=False):
    """Saves a checkpoint of (opt, params), loads it into a fresh paged optimizer and an
    unpaged one, and checks that all three continue identically. With disk_failing, every
    step of `opt` reports the failing write-backs, and still computes the same."""
    # Through bytes, as a checkpoint goes to disk, and loaded from its own copy by each
    # optimizer: state_dict() hands out the live 'step' tensors and load_state_dict() adopts
    # them (as torch.optim does), so two optimizers would otherwise share step counters.
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)

    def checkpoint():
        buffer.seek(0)
        return torch.load(buffer)

    fresh_params, plain_params = clone_params(params), clone_params(params)
    fresh = po.AdamW(fresh_params, offload="nvme", nvme_dir=tmp_path, cache_bytes=2 * PAGE, **KW)
    plain = po.AdamW(plain_params, **KW)
    fresh.load_state_dict(checkpoint())
    plain.load_state_dict(checkpoint())
    for index in range(first_step, first_step + 3):
        for o, ps in ((fresh, fresh_params), (plain, plain_params)):
            step(o, ps, index)
        if disk_failing:
            with pytest.raises(po.PageIOError):
                step(opt, params, index)
        else:
            step(opt, params, index)
    assert_same(params, opt, fresh_params, fresh)
    assert_same(params, opt, plain_params, plain)


BACKENDS = ["posix", "io_uring"]


def skip_without(backend, tmp_path):
    if backend == "io_uring":
        opt = po.AdamW(make_params(), offload="nvme", nvme_dir=tmp_path, **KW)
        with paging.store_overrides(io_backend="auto"):
            stats = opt.state_store.ensure_engine().paging_stats()
        if stats["io_backend"] != "io_uring":
            pytest.skip(f"io_uring is refused here: {stats['io_fallback_reason']}")


WRITE_FAULTS = [
    ({"kind": "enospc", "ops": "write"}, errno.ENOSPC),
    ({"kind": "eio", "ops": "write", "from_op": 1}, errno.EIO),
    ({"kind": "short", "ops": "write"}, errno.EIO),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule,code", WRITE_FAULTS, ids=["enospc", "eio", "short"])
def test_failed_write_back_loses_nothing(rule, code, backend, tmp_path):
    skip_without(backend, tmp_path)
    params, ref_params = make_params(), make_params()
    opt = paged(params, tmp_path, io_backend=backend)
    ref = po.AdamW(ref_params, **KW)
    for index in range(2):
        step(opt, params, index)
        step(ref, ref_params, index)
    paging.set_fault_rules(opt, [rule])
    with pytest.raises(po.PageIOError) as info:
        step(opt, params, 2)
    step(ref, ref_params, 2)
    error = info.value
    assert isinstance(error, OSError) and error.errno == code
    assert error.filename.startswith(str(tmp_path))
    assert "no optimizer state was lost" in str(error)
    # The whole step ran before the error surfaced: same params, same state as never failing.
    assert_same(params, opt, ref_params, ref)
    # So the step is complete: nothing is left to finish, and calling step() again with the
    # same gradients (a retry, docs/reliability.md "Steps that fail") applies nothing twice.
    assert opt.interrupted_step is None
    opt.step()
    assert_same(params, opt, ref_params, ref)
    stats = opt.paging_stats()
    assert stats["write_errors"] >= 1 and stats["over_budget_pages"] > 0
    # While the disk still fails: a checkpoint loads elsewhere and continues exactly.
    continues_from_checkpoint(opt, params, 3, tmp_path, disk_failing=True)
    # And once the disk works again, this optimizer goes on too: the next step retries the
    # write-backs and the cache returns to its budget.
    paging.set_fault_rules(opt, [])
    for index in range(3, 8):
        if index >= 6:
            step(opt, params, index)
        step(ref, ref_params, index)
    assert_same(params, opt, ref_params, ref)
    paging.drain(opt)
    assert opt.paging_stats()["over_budget_pages"] == 0


READ_FAULTS = [
    ({"kind": "eio", "ops": "read"}, po.PageIOError),
    ({"kind": "short", "ops": "read"}, po.PageIOError),
    ({"kind": "flip", "ops": "read", "flip_at": 77}, po.PageCorruptionError),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule,error", READ_FAULTS, ids=["eio", "short", "flip"])
def test_failed_read_raises_and_checkpoint_still_works(rule, error, backend, tmp_path):
    skip_without(backend, tmp_path)
    params = make_params()
    opt = paged(params, tmp_path, io_backend=backend)
    for index in range(2):
        step(opt, params, index)
    paging.set_fault_rules(opt, [rule])
    with pytest.raises(error) as info:
        step(opt, params, 2)
    message = str(info.value)
    assert str(tmp_path) in message and "page" in message
    if error is po.PageIOError:
        assert info.value.errno == errno.EIO
    else:
        assert isinstance(info.value, RuntimeError) and "checksum" in message
        assert opt.paging_stats()["checksum_errors"] >= 1
    # The fault was in the transfer, not the file: once it stops, every page reads back,
    # the checkpoint is consistent, and everything continues from it. The step stays
    # interrupted until retried or discarded (tests/python/test_step_atomicity.py retries
    # it); here it is kept half applied, as the checkpoint holds it.
    paging.set_fault_rules(opt, [])
    assert opt.interrupted_step is not None
    opt.discard_interrupted_step()
    continues_from_checkpoint(opt, params, 3, tmp_path)


def test_transient_read_error_is_retried_invisibly(tmp_path):
    params, ref_params = make_params(), make_params()
    opt = paged(params, tmp_path)
    ref = po.AdamW(ref_params, **KW)
    step(opt, params, 0)
    step(ref, ref_params, 0)
    paging.set_fault_rules(opt, [{"kind": "eio", "ops": "read", "max_fires": 1},
                                 {"kind": "flip", "ops": "read", "from_op": 3, "max_fires": 1}])
    for index in range(1, 4):
        step(opt, params, index)
        step(ref, ref_params, index)
    assert paging.fault_counts(opt) == [1, 1]
    assert opt.paging_stats()["read_retries"] == 2
    assert_same(params, opt, ref_params, ref)


def test_page_corrupted_on_disk_is_never_used(tmp_path):
    params = make_params()
    opt = paged(params, tmp_path)
    step(opt, params, 0)
    # The next write-back reaches the file with a flipped byte; the copy in memory is gone
    # once the page is evicted, so that page is lost for real, and must say so.
    paging.set_fault_rules(opt, [{"kind": "flip", "ops": "write", "max_fires": 1}])
    raised = 0
    for index in range(1, 4):
        try:
            step(opt, params, index)
        except po.PageCorruptionError:
            raised += 1
            # A retry would meet the same lost page: go on without it.
            opt.discard_interrupted_step()
    assert raised >= 1
    with pytest.raises(po.PageCorruptionError):
        opt.state_dict()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs: a disk far too small for the state. Needs the right to mount."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a size-limited tmpfs here (needs CAP_SYS_ADMIN)")
    yield small
    gc.collect()  # the page file's descriptor goes with its optimizer
    if subprocess.run(["umount", str(small)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


def step_on_full_disk(small):
    """Returns (the error of the first step, the params, the checkpoint after it)."""
    params = make_params()
    # The constructor already refuses a page file larger than the free space (see
    # test_lifecycle); here the space goes after construction, so the first step's
    # reservation is what meets the full disk.
    with pytest.raises(OSError, match="nvme_dir .* bytes are missing"):
        po.AdamW(params, offload="nvme", nvme_dir=small, cache_bytes=PAGE, **KW)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paging, "check_page_file_fits", lambda options, page_file_bytes: None)
        opt = po.AdamW(params, offload="nvme", nvme_dir=small, cache_bytes=PAGE, **KW)
    try:
        step(opt, params, 0)
    except po.PageIOError as error:
        return error.errno, str(error), params, copy.deepcopy(opt.state_dict())
    raise AssertionError("the step should have raised ENOSPC")


def test_real_full_disk_fails_before_the_step(small_tmpfs, tmp_path):
    code, message, params, checkpoint = step_on_full_disk(small_tmpfs)
    assert code == errno.ENOSPC
    assert str(small_tmpfs) in message
    # The space is reserved before anything is stepped: nothing changed.
    for p, q in zip(params, make_params()):
        assert torch.equal(p, q)
    # A roomier directory takes over from the checkpoint and matches a run that never failed.
    ref_params, fresh_params = make_params(), make_params()
    ref = po.AdamW(ref_params, **KW)
    fresh = po.AdamW(fresh_params, offload="nvme", nvme_dir=tmp_path, cache_bytes=PAGE, **KW)
    fresh.load_state_dict(checkpoint)
    for index in range(2):
        step(ref, ref_params, index)
        step(fresh, fresh_params, index)
    assert_same(fresh_params, fresh, ref_params, ref)


# io_uring refused, as a container's seccomp profile refuses it: a child process installs
# a filter that fails io_uring_setup/enter/register with ENOSYS before importing pagedoptim.
REFUSING_CHILD = textwrap.dedent("""
    import ctypes, json, struct, sys, warnings
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
    ALLOW, ENOSYS = 0x7FFF0000, 0x00050000 | 38
    def insn(code, jt, jf, k):
        return struct.pack("HBBI", code, jt, jf, k)
    prog = b"".join([
        insn(0x20, 0, 0, 0),          # A = syscall number
        insn(0x15, 2, 0, 425),        # io_uring_setup
        insn(0x15, 1, 0, 426),        # io_uring_enter
        insn(0x15, 0, 1, 427),        # io_uring_register
        insn(0x06, 0, 0, ENOSYS),
        insn(0x06, 0, 0, ALLOW),
    ])
    buf = ctypes.create_string_buffer(prog)
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fprog = Fprog(len(prog) // 8, ctypes.addressof(buf))
    assert libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
    assert libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) == 0
    import torch, pagedoptim as po
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = torch.Generator().manual_seed(0)
        p = torch.randn(20000, generator=g).requires_grad_()
        q = p.detach().clone().requires_grad_()
        opt = po.AdamW([p], page_bytes=8192, offload="nvme", nvme_dir=sys.argv[1],
                       cache_bytes=2 * 8192)
        ref = po.AdamW([q])
        for _ in range(4):
            grad = torch.randn(20000, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
            opt.step(); ref.step()
    stats = opt.paging_stats()
    print(json.dumps({"backend": stats["io_backend"], "reason": stats["io_fallback_reason"],
                      "warnings": [str(w.message) for w in caught],
                      "equal": bool(torch.equal(p, q)), "reads": stats["reads"]}))
""")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the seccomp filter uses x86_64 "
                    "syscall numbers")
def test_io_uring_refused_falls_back_to_posix_with_a_warning(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PAGEDOPTIM_IO_BACKEND"}
    result = subprocess.run([sys.executable, "-c", REFUSING_CHILD, str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["backend"] == "posix"
    assert "io_uring" in report["reason"]
    assert any("POSIX" in w and "io_uring" in w for w in report["warnings"]), report
    assert report["equal"] and report["reads"] > 0
