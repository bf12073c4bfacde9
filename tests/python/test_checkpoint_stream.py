"""save_checkpoint / load_checkpoint (pagedoptim/checkpoint/stream.py, docs/checkpoint_format.md).

A run that checkpoints, and continues from the file in a fresh optimizer, must match a run
that never checkpointed bit for bit (params and state_dict()), for every optimizer, with
and without paging, and across paging settings. A bad file raises and changes nothing; the
memory a checkpoint takes does not grow with the state.
"""

import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

import pagedoptim as po
from pagedoptim.checkpoint import (atomic_file, format as checkpoint_format,
                                   stream as checkpoint_stream)

PAGE = 8192
STEPS, SAVE_AT = 5, 2


def plain_params(dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [(3000,), (31, 70), (5,), (), (2, 33)]
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def moe_params(dtype):
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (40, 16), "model.layers.0.mlp.gate.weight": (4, 16),
              "model.layers.0.mlp.experts.gate_up_proj": (4, 24, 16),
              "model.layers.0.input_layernorm.weight": (16,)}
    return [(name, torch.randn(s, generator=g).to(dtype).requires_grad_())
            for name, s in shapes.items()]


# name -> (params maker, optimizer class, hyperparameters)
OPTIMIZERS = {
    "adamw-8bit-bf16": (plain_params, torch.bfloat16, po.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adamw-fp32-amsgrad": (plain_params, torch.float32, po.AdamW,
                           dict(lr=1e-2, amsgrad=True, state_bits=32, master_bits=None)),
    "sgd-nesterov-bf16": (plain_params, torch.bfloat16, po.SGD,
                          dict(lr=1e-2, momentum=0.9, nesterov=True, master_bits=32)),
    "sgd-plain": (plain_params, torch.float32, po.SGD, dict(lr=1e-2)),
    "lion-8bit": (plain_params, torch.float32, po.Lion, dict(lr=1e-3, weight_decay=0.1)),
    "skewadam-bf16": (moe_params, torch.bfloat16, po.SkewAdam, dict(lr=1e-2, weight_decay=0.1)),
}
MODES = {
    "unpaged": {},
    "host": dict(offload="host", cache_bytes=2 * PAGE, page_bytes=PAGE),
    "nvme": dict(offload="nvme", cache_bytes=3 * PAGE, page_bytes=PAGE),
}


def tensors_of(params):
    return [p[1] if isinstance(p, tuple) else p for p in params]


def make(name, mode, tmp_path, params=None):
    maker, dtype, cls, hyper = OPTIMIZERS[name]
    params = maker(dtype) if params is None else params
    paging = dict(MODES[mode])
    if paging.get("offload") == "nvme":
        paging["nvme_dir"] = tmp_path
    return params, cls(params, **hyper, **paging)


def clone(params):
    return [(p[0], p[1].detach().clone().requires_grad_()) if isinstance(p, tuple)
            else p.detach().clone().requires_grad_() for p in params]


def step(opt, params, index):
    g = torch.Generator().manual_seed(100 + index)
    for p in tensors_of(params):
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    opt.step()


def assert_same_state(opt_a, opt_b):
    a, b = opt_a.state_dict(), opt_b.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index in a["state"]:
        assert a["state"][index].keys() == b["state"][index].keys(), index
        for key, value in a["state"][index].items():
            other = b["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype and value.shape == other.shape, (index, key)
                assert torch.equal(value.view(torch.uint8) if value.dim() else value,
                                   other.view(torch.uint8) if other.dim() else other), (index, key)
            else:
                assert value == other, (index, key)


def assert_same_params(params_a, params_b):
    for p, q in zip(tensors_of(params_a), tensors_of(params_b)):
        assert torch.equal(p.view(torch.uint8) if p.dim() else p,
                           q.view(torch.uint8) if q.dim() else q)


def reference_run(name, mode, tmp_path):
    params, opt = make(name, mode, tmp_path)
    for index in range(STEPS):
        step(opt, params, index)
    return params, opt


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_run_continued_from_a_checkpoint_matches_an_uninterrupted_run(name, mode, tmp_path):
    ref_params, ref_opt = reference_run(name, mode, tmp_path)
    params, opt = make(name, mode, tmp_path)
    for index in range(SAVE_AT):
        step(opt, params, index)
    path = tmp_path / "opt.ckpt"
    opt.save_checkpoint(path)
    resumed_params = clone(params)
    _, resumed = make(name, mode, tmp_path, resumed_params)
    resumed.load_checkpoint(path)
    assert_same_state(opt, resumed)
    for index in range(SAVE_AT, STEPS):
        step(resumed, resumed_params, index)
    assert_same_params(resumed_params, ref_params)
    assert_same_state(resumed, ref_opt)
    # The file is the checkpoint, no temporary file beside it, and the page files are gone.
    assert sorted(f.name for f in tmp_path.iterdir()) == ["opt.ckpt"]


@pytest.mark.parametrize("saved_in,loaded_in", [("nvme", "unpaged"), ("unpaged", "nvme"),
                                                ("host", "nvme")])
@pytest.mark.parametrize("name", ["adamw-8bit-bf16", "skewadam-bf16", "sgd-nesterov-bf16"])
def test_a_checkpoint_loads_under_other_paging_settings(name, saved_in, loaded_in, tmp_path):
    ref_params, ref_opt = reference_run(name, "unpaged", tmp_path)
    params, opt = make(name, saved_in, tmp_path)
    for index in range(SAVE_AT):
        step(opt, params, index)
    opt.save_checkpoint(tmp_path / "opt.ckpt")
    resumed_params = clone(params)
    maker, dtype, cls, hyper = OPTIMIZERS[name]
    paging = dict(MODES[loaded_in])
    if loaded_in == "nvme":  # another page size and cache than the saver's too
        paging.update(page_bytes=2 * PAGE, cache_bytes=2 * 2 * PAGE, nvme_dir=tmp_path)
    resumed = cls(resumed_params, **hyper, **paging)
    resumed.load_checkpoint(tmp_path / "opt.ckpt")
    for index in range(SAVE_AT, STEPS):
        step(resumed, resumed_params, index)
    assert_same_params(resumed_params, ref_params)
    assert_same_state(resumed, ref_opt)


def test_records_span_pages_and_params_share_pages(tmp_path):
    """A large param spans many records and pages; small ones share pages: each record's
    element range reads back exactly (compared with state_dict's gathered streams)."""
    params = [torch.randn(50_000).requires_grad_(), torch.randn(7).requires_grad_(),
              torch.randn(33).requires_grad_()]
    opt = po.AdamW(params, lr=1e-2, offload="nvme", nvme_dir=tmp_path, page_bytes=4096,
                   cache_bytes=4096 * 2)
    for index in range(2):
        step(opt, params, index)
    opt.save_checkpoint(tmp_path / "opt.ckpt")
    header = checkpoint_stream.verify(tmp_path / "opt.ckpt")
    assert sum(1 for _ in checkpoint_format.expected_records(header)) > 10
    twin = po.AdamW(clone(params), lr=1e-2)
    twin.load_checkpoint(tmp_path / "opt.ckpt")
    assert_same_state(opt, twin)


def test_state_beside_the_streams_round_trips(tmp_path):
    params = plain_params(torch.float32)
    opt = po.AdamW(params, lr=torch.tensor(0.01), betas=(0.8, 0.99), state_bits=32)
    step(opt, params, 0)
    opt.param_groups[0]["my_schedule"] = {"warmup": 3, 7: (1.5, float("nan")), "$x": [None]}
    opt.state["counter"] = 3
    opt.state[params[1]]["note"] = "kept"
    opt.save_checkpoint(tmp_path / "opt.ckpt")
    twin = po.AdamW(clone(params), lr=1.0, state_bits=32)
    twin.load_checkpoint(tmp_path / "opt.ckpt")
    group = twin.param_groups[0]
    assert isinstance(group["lr"], torch.Tensor) and float(group["lr"]) == pytest.approx(0.01)
    assert group["betas"] == (0.8, 0.99)
    schedule = group["my_schedule"]
    assert schedule["warmup"] == 3 and schedule["$x"] == [None]
    assert schedule[7][0] == 1.5 and schedule[7][1] != schedule[7][1]
    assert twin.state["counter"] == 3
    assert twin.state[twin.param_groups[0]["params"][1]]["note"] == "kept"
    assert float(twin.state[twin.param_groups[0]["params"][0]]["step"]) == 1.0


def test_an_optimizer_without_state_saves_and_loads(tmp_path):
    params = plain_params(torch.float32)
    opt = po.AdamW(params, lr=1e-2)
    opt.save_checkpoint(tmp_path / "opt.ckpt")
    ref_params, ref = clone(params), po.AdamW(clone(params), lr=1e-2)
    ref_params = ref.param_groups[0]["params"]
    twin_params = clone(params)
    twin = po.AdamW(twin_params, lr=1e-2)
    twin.load_checkpoint(tmp_path / "opt.ckpt")
    step(twin, twin_params, 0)
    step(ref, ref_params, 0)
    assert_same_params(twin_params, ref_params)
    assert_same_state(twin, ref)


def test_state_that_a_checkpoint_cannot_hold_is_refused_before_writing(tmp_path):
    params = plain_params(torch.float32)
    opt = po.AdamW(params, lr=1e-2)
    opt.state["big"] = torch.zeros(1 << 16)
    with pytest.raises(TypeError, match=r"optimizer.state\['big'\] is a tensor of 262144 bytes"):
        opt.save_checkpoint(tmp_path / "opt.ckpt")
    opt.state["big"] = object()
    with pytest.raises(TypeError, match="is a object.*state_dict"):
        opt.save_checkpoint(tmp_path / "opt.ckpt")
    assert list(tmp_path.iterdir()) == []


# -- bad files -------------------------------------------------------------------------------

def saved(tmp_path, name="adamw-8bit-bf16", mode="nvme"):
    params, opt = make(name, mode, tmp_path)
    for index in range(SAVE_AT):
        step(opt, params, index)
    path = tmp_path / "opt.ckpt"
    opt.save_checkpoint(path)
    return params, opt, path


def snapshot(opt):
    return (opt.state_store, opt.state_store.engine, opt.param_groups, opt.state_dict())


def assert_unchanged(opt, before, params):
    store, engine, groups, state_dict = before
    assert opt.state_store is store and store.engine is engine and opt.param_groups is groups
    twin = type(opt)(clone(params), lr=1.0)
    twin.load_state_dict(state_dict)
    assert_same_state(opt, twin)


def layout(path):
    """Offsets of the parts of a checkpoint file."""
    data = path.read_bytes()
    length = struct.unpack_from("<I", data, 12)[0]
    header_end = 16 + length + 4
    return data, length, header_end


def rewrite_header(data, length, change):
    header = json.loads(data[16:16 + length])
    change(header)
    text = json.dumps(header).encode()
    preamble = struct.pack("<8sII", checkpoint_format.MAGIC, checkpoint_format.VERSION, len(text))
    from pagedoptim._native import native
    crc = native.crc32c(text, native.crc32c(preamble))
    return preamble + text + struct.pack("<I", crc) + data[16 + length + 4:]


def bad_files(path):
    data, length, header_end = layout(path)
    record_payload = header_end + 40 + 5
    footer = len(data) - 32
    cases = {
        "empty": b"",
        "foreign bytes": b"PK\x03\x04 not a checkpoint at all" * 10,
        "preamble only": data[:16],
        "header cut": data[:16 + length // 2],
        "no records": data[:header_end],
        "cut in a record": data[:record_payload],
        "cut before the footer": data[:footer],
        "cut in the footer": data[:-1],
        "a byte more": data + b"\0",
        "header byte flipped": flip(data, 16 + length // 3),
        "header crc flipped": flip(data, header_end - 1),
        "record header flipped": flip(data, header_end + 4),
        "payload flipped": flip(data, record_payload),
        "last payload flipped": flip(data, footer - 1),
        "footer flipped": flip(data, footer + 9),
        "version 3": data[:8] + struct.pack("<I", 3) + data[12:],
        "records swapped": swap_first_records(data, header_end),
        "header says another version": rewrite_header(data, length,
                                                      lambda h: h.update(version=3)),
        "header lies about a size": rewrite_header(
            data, length, lambda h: h["params"][0]["slots"][0].update(numel=10 ** 9)),
        # Refused from the slots' sizes, before 2^42 records would be counted one by one.
        "header claims a huge slot": rewrite_header(
            data, length, lambda h: h["params"][0]["slots"][0].update(numel=33 << 42)),
        "header is not JSON": data[:16] + b"{" * length + data[16 + length:],
    }
    return cases


def flip(data, offset):
    return data[:offset] + bytes([data[offset] ^ 0x40]) + data[offset + 1:]


def swap_first_records(data, header_end):
    size = struct.unpack_from("<I", data, header_end + 12)[0]
    first = data[header_end:header_end + 40 + size]
    size2 = struct.unpack_from("<I", data, header_end + 40 + size + 12)[0]
    second = data[header_end + 40 + size:header_end + 80 + size + size2]
    return data[:header_end] + second + first + data[header_end + len(first) + len(second):]


def test_every_bad_file_raises_a_checkpoint_error_and_changes_nothing(tmp_path):
    params, opt, path = saved(tmp_path)
    before = snapshot(opt)
    for case, content in bad_files(path).items():
        bad = tmp_path / f"bad-{case.replace(' ', '_')}.ckpt"
        bad.write_bytes(content)
        with pytest.raises(po.CheckpointError, match=str(bad)) as error:
            opt.load_checkpoint(bad)
        assert isinstance(error.value, ValueError), case
        with pytest.raises(po.CheckpointError):
            checkpoint_stream.verify(bad)
        assert_unchanged(opt, before, params)
    # A torch.save file is refused with the way to load it.
    torch.save(opt.state_dict(), tmp_path / "torch.pt")
    with pytest.raises(po.CheckpointError, match="load_state_dict"):
        opt.load_checkpoint(tmp_path / "torch.pt")
    assert_unchanged(opt, before, params)


def test_a_record_failing_late_leaves_the_loading_optimizer_as_it_was(tmp_path):
    """The last record is corrupt: every record before it was already written into the
    staging engine, which is dropped; the old state stays."""
    params, opt, path = saved(tmp_path)
    step(opt, params, SAVE_AT)  # different state from the file's
    before = snapshot(opt)
    data, _, _ = layout(path)
    path.write_bytes(flip(data, len(data) - 33))
    with pytest.raises(po.CheckpointError, match="payload fails its crc32c"):
        opt.load_checkpoint(path)
    assert_unchanged(opt, before, params)
    step(opt, params, SAVE_AT + 1)  # and it still steps


@pytest.mark.parametrize("change,message", [
    (dict(cls=po.Lion, hyper=dict(lr=1e-3)), "holds the state of a AdamW .* not of a Lion"),
    (dict(hyper=dict(lr=1e-2, state_bits=32)),
     r"another state format \(state_bits 8 in the checkpoint, 32 here\).*state_dict\(\)"),
    (dict(hyper=dict(lr=1e-2, master_bits=32)), "master_bits 24 in the checkpoint, 32 here"),
    (dict(params=lambda ps: ps[:-1]), "parameter group 0 has 5 params in the checkpoint, 4 here"),
    (dict(params=lambda ps: [ps[1], ps[0], *ps[2:]]),
     r"param 0 is \[3000\] bfloat16 in the checkpoint, \[31, 70\] bfloat16 here"),
    (dict(params=lambda ps: [{"params": ps[:2]}, {"params": ps[2:]}]),
     "has 1 parameter groups, this AdamW has 2"),
])
def test_a_checkpoint_of_another_optimizer_is_refused(change, message, tmp_path):
    _, _, path = saved(tmp_path)
    params = clone(plain_params(torch.bfloat16))
    given = change.get("params", lambda ps: ps)(params)
    opt = change.get("cls", po.AdamW)(given, **change.get("hyper", dict(lr=1e-2)))
    step(opt, [p for g in opt.param_groups for p in g["params"]], 0)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=message):
        opt.load_checkpoint(path)
    store, engine, groups, state_dict = before
    assert opt.state_store is store and store.engine is engine and opt.param_groups is groups


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path):
    params, opt, path = saved(tmp_path)
    original = path.read_bytes()
    step(opt, params, SAVE_AT)

    class FailingEngine:
        def __init__(self, engine):
            self.engine, self.calls = engine, 0

        def read_stream_range(self, *args):
            self.calls += 1
            if self.calls == 3:
                raise OSError(28, "No space left on device")
            return self.engine.read_stream_range(*args)

        def __getattr__(self, name):
            return getattr(self.engine, name)

    engine = opt.state_store.engine
    opt.state_store.engine = FailingEngine(engine)
    with pytest.raises(OSError, match="No space left"):
        opt.save_checkpoint(path)
    opt.state_store.engine = engine
    assert path.read_bytes() == original
    assert sorted(f.name for f in tmp_path.iterdir()) == ["opt.ckpt"]


def test_stale_temporaries_of_dead_writers_are_removed_by_the_next_save(tmp_path):
    params, opt, path = saved(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".opt.ckpt.{dead.pid}.0123abcd{atomic_file.TEMP_SUFFIX}"
    live = tmp_path / f".opt.ckpt.{os.getppid()}.0123abcd{atomic_file.TEMP_SUFFIX}"
    other = tmp_path / f".other.ckpt.{dead.pid}.0123abcd{atomic_file.TEMP_SUFFIX}"
    for f in (stale, live, other):
        f.write_bytes(b"half a checkpoint")
    opt.load_checkpoint(path)  # loading reads the final name only
    opt.save_checkpoint(path)
    assert not stale.exists() and live.exists() and other.exists()
    checkpoint_stream.verify(path)


def test_the_header_reader_is_a_function_over_bytes(tmp_path):
    import io
    _, opt, path = saved(tmp_path, name="skewadam-bf16")
    data = path.read_bytes()
    header = checkpoint_format.read_header(io.BytesIO(data))
    assert header.algorithm == "skewadam" and header.optimizer == "SkewAdam"
    assert header.stream_format == {"state_bits": 8, "master_bits": 24, "group_size": 32}
    roles = [slot.role for entry in header.params for slot in entry.slots]
    assert roles.count("factors") == 2  # the two factored 2-D / 3-D params
    handle = io.BytesIO(data)
    checkpoint_format.read_header(handle)
    checkpoint_format.check_length(handle, header)
    buffer = memoryview(bytearray(checkpoint_format.max_payload_bytes(header)))
    specs = [spec for spec, _ in checkpoint_format.iter_records(handle, header, buffer)]
    assert specs == list(checkpoint_format.expected_records(header))


# -- memory ----------------------------------------------------------------------------------

MEMORY_CHILD = textwrap.dedent("""
    import gc, json, sys, threading, ctypes
    import torch
    import pagedoptim as po

    PAGE = 64 << 10
    directory = sys.argv[1]
    torch.set_num_threads(1)

    from pagedoptim.cli.process_memory import rss_bytes as rss

    class Peak:
        # The sampling thread runs before the baseline is taken: its stack is not counted.
        def __enter__(self):
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            self.peak, self.done = 0, False
            self.started = threading.Event()
            self.thread = threading.Thread(target=self.sample)
            self.thread.start()
            self.started.wait()
            self.base = rss()
            return self
        def sample(self):
            self.started.set()
            while not self.done:
                self.peak = max(self.peak, rss())
        def __exit__(self, *exc):
            self.done = True
            self.thread.join()
            self.peak = max(self.peak, rss())

    # 4M fp32 params: 32 MiB of fp32 AdamW state on NVMe, through a 16-page (1 MiB) cache.
    params = [torch.zeros(1 << 20).requires_grad_() for _ in range(4)]
    opt = po.AdamW(params, lr=1e-3, state_bits=32, master_bits=None, offload="nvme",
                   nvme_dir=directory, page_bytes=PAGE, cache_bytes=16 * PAGE)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    for p in params:
        p.grad = None
    opt.save_checkpoint(directory + "/warm-up.ckpt")  # first-use allocations, not the state's
    with Peak() as save:
        opt.save_checkpoint(directory + "/opt.ckpt")
    twin = po.AdamW([p.detach().clone() for p in params], lr=1e-3, state_bits=32,
                    master_bits=None, offload="nvme", nvme_dir=directory, page_bytes=PAGE,
                    cache_bytes=16 * PAGE)
    with Peak() as load:
        twin.load_checkpoint(directory + "/opt.ckpt")
    with Peak() as gather:
        state = opt.state_dict()
    print(json.dumps({"state_bytes": opt.memory_report()["state_bytes"],
                      "save": save.peak - save.base, "load": load.peak - load.base,
                      "state_dict": gather.peak - gather.base}))
""")


def test_a_checkpoint_takes_a_few_pages_of_memory_however_large_the_state(tmp_path):
    """In a child process (RSS is per process): saving 32 MiB of NVMe-paged state through a
    1 MiB cache raises RSS by a few 64 KiB pages, loading it by the new engine's cache and
    a few pages, where state_dict() (the gathering path, for contrast) raises it by the
    state's size."""
    result = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(tmp_path)],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    state = measured["state_bytes"]
    assert state >= 32 << 20
    # The contrast shows the measurement sees a gathered state.
    assert measured["state_dict"] > state // 2
    page = 64 << 10
    # Save: a record buffer (one page) and the header, under 8 pages with allocator slack
    # (about 2 pages measured).
    assert measured["save"] < 8 * page, measured
    # Load into a fresh optimizer: its engine's 16-page cache, the record buffer, and the
    # engine's own start (io ring, tables): under 32 pages (about 22 measured).
    assert measured["load"] < 32 * page, measured


def test_a_well_formed_file_with_a_step_that_is_no_count_is_refused(tmp_path):
    params, opt, path = saved(tmp_path)
    before = snapshot(opt)
    data, length, _ = layout(path)
    path.write_bytes(rewrite_header(data, length,
                                    lambda h: h["params"][0]["state"].update(step=[1, 2])))
    checkpoint_stream.verify(path)  # well-formed: the reader does not interpret state
    with pytest.raises(po.CheckpointError, match=r"the step of param 0 is \[1, 2\]"):
        opt.load_checkpoint(path)
    assert_unchanged(opt, before, params)
