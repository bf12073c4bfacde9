"""8-bit groups that follow the rows of the last dimension, fp32 moments for small and 1-D
params, and checkpoints saved in the flat layout of pagedoptim before 0.2.

The step itself against the reference (every kernel branch, rows ending in partial groups,
rows across pages) is in test_compressed_kernels.py; sharded params in
test_distributed_any_shard.py. Here: the layout the state shows, the bytes it costs, and
old checkpoints (state_dict, DCP, load_checkpoint version 1), which load exactly where the
groups did not change and are decoded and encoded again in rows where they did.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pagedoptim as po
from pagedoptim import reference
from pagedoptim._native import native
from pagedoptim.checkpoint import format as checkpoint_format
from pagedoptim.checkpoint import stream as checkpoint_stream
from pagedoptim.state import format as state_format


def widths_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 72), nn.Linear(72, 40), nn.Linear(40, 6))


def stepped(model: nn.Module, steps: int = 2, **kwargs) -> po.AdamW:
    optimizer = po.AdamW(model.parameters(), lr=1e-2, **kwargs)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(8, 20, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


# -- the layout ----------------------------------------------------------------------------

def test_scales_have_one_entry_per_group_of_each_row():
    model = widths_model()
    optimizer = stepped(model, min_8bit_size=0)
    state = optimizer.state_dict()["state"]
    # (72, 20): one partial group a row; (40, 72): two full and one of 8; (6, 40): 32 + 8.
    for index, scales_shape in ((0, (72, 1)), (2, (40, 3)), (4, (6, 2))):
        assert state[index]["exp_avg_scales"].shape == scales_shape
        assert state[index]["exp_avg_sq_scales"].shape == scales_shape
    # Biases are 1-D: fp32 moments even with min_8bit_size=0.
    for index in (1, 3, 5):
        assert set(state[index]) == {"step", "exp_avg", "exp_avg_sq"}
    report = optimizer.memory_report()
    assert report["fp32_state_elements"] == 72 + 40 + 6
    assert report["scale_bytes"] == 2 * 2 * (72 * 1 + 40 * 3 + 6 * 2)


def test_codes_decode_with_their_row_groups():
    """Each row's groups hold its own elements only: the codes and scales state_dict() gives
    decode (row by row, the native codec with the row length) to what optimizer.state shows."""
    model = widths_model()
    optimizer = stepped(model, min_8bit_size=0)
    weight = model[0].weight
    entry = optimizer.state_dict()["state"][0]
    decoded = native.decode_moment(entry["exp_avg_codes"].reshape(-1),
                                   entry["exp_avg_scales"].reshape(-1), 20).view(72, 20)
    assert torch.equal(decoded, optimizer.state[weight]["exp_avg"])
    for row in range(72):  # the same as encoding the row alone
        codes, scales = native.encode_moment(decoded[row].clone())
        assert torch.equal(codes, entry["exp_avg_codes"][row])
        assert torch.equal(scales, entry["exp_avg_scales"][row])


def test_the_default_keeps_small_and_1d_params_in_fp32_and_large_ones_in_8bit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 72), nn.LayerNorm(72), nn.Linear(72, 4096))
    optimizer = po.AdamW(model.parameters())
    model(torch.randn(2, 20)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()["state"]
    kinds = {index: "8bit" if "exp_avg_codes" in entry else "fp32"
             for index, entry in state.items()}
    # 1440 < 4096 elements, 1-D, 1-D, 1-D, (4096, 72) >= 4096, 1-D.
    assert kinds == {0: "fp32", 1: "fp32", 2: "fp32", 3: "fp32", 4: "8bit", 5: "fp32"}
    assert optimizer.memory_report()["fp32_state_elements"] == 1440 + 72 * 3 + 4096
    with pytest.raises(ValueError, match="min_8bit_size"):
        po.AdamW(model.parameters(), min_8bit_size=-1)


def test_rows_too_short_for_8_bits_to_save_bytes_keep_fp32_moments():
    """A row's last group takes a whole group's page slot: a conv kernel's rows of 3 would
    cost 11.3 B an element in 8 bits against fp32's 4, so such params keep fp32 moments
    (rows of 9 and more are cheaper in 8 bits)."""
    conv = nn.Parameter(torch.randn(64, 64, 3, 3))
    lora_b = nn.Parameter(torch.randn(4096, 8))
    rows_of_9 = nn.Parameter(torch.randn(512, 9))
    optimizer = po.AdamW([conv, lora_b, rows_of_9])
    for p in (conv, lora_b, rows_of_9):
        p.grad = torch.randn_like(p)
    optimizer.step()
    state = optimizer.state_dict()["state"]
    assert set(state[0]) == set(state[1]) == {"step", "exp_avg", "exp_avg_sq"}
    assert state[2]["exp_avg_scales"].shape == (512, 1)
    report = optimizer.memory_report()
    assert report["fp32_state_elements"] == conv.numel() + lora_b.numel()
    for row in range(1, 200):  # the rule, against the bytes it stands for
        eight_bit = -(-row // 32) * (32 + 2)  # a code slot of 32 and a scale per group
        assert state_format.rows_are_cheaper_in_8bit(row) == (eight_bit < 4 * row), row


def test_plan_counts_the_row_groups():
    """The plan's byte counts come from the same page table and group counts."""
    from pagedoptim.paging import state_plan
    model = widths_model()
    planned = po.AdamW(model.parameters(), min_8bit_size=0)
    plan = state_plan.plan_state(planned.state_store, "cpu")
    optimizer = stepped(model, min_8bit_size=0)
    report = optimizer.memory_report()
    for field in ("moment_bytes", "scale_bytes", "num_pages", "page_bytes"):
        assert getattr(plan, field) == report[field], field


# -- checkpoints of the flat layout ----------------------------------------------------------

def old_state(shape: tuple[int, ...], second: bool, generator: torch.Generator
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp32 values, codes, flat scales): a moment as pagedoptim before 0.2 saved it."""
    values = torch.randn(shape, generator=generator)
    values = values.square() if second else values
    encode = native.encode_second_moment if second else native.encode_moment
    codes, scales = encode(values.reshape(-1))
    return values, codes.view(shape), scales


def old_state_dict(model: nn.Module, generator: torch.Generator) -> dict:
    """An 8-bit AdamW state_dict of `model` in the flat layout, every param 8-bit."""
    optimizer = po.AdamW(model.parameters(), lr=1e-2)
    saved = optimizer.state_dict()
    state = {}
    for index, p in enumerate(model.parameters()):
        entry = {"step": torch.tensor(3.0)}
        for name, second in (("exp_avg", False), ("exp_avg_sq", True)):
            _, codes, scales = old_state(tuple(p.shape), second, generator)
            entry[f"{name}_codes"], entry[f"{name}_scales"] = codes, scales
        state[index] = entry
    return {"state": state, "param_groups": saved["param_groups"]}


def flat_decoded(entry: dict, name: str) -> torch.Tensor:
    decode = native.decode_second_moment if name == "exp_avg_sq" else native.decode_moment
    codes = entry[f"{name}_codes"]
    return decode(codes.reshape(-1), entry[f"{name}_scales"]).view(codes.shape)


def test_a_flat_layout_state_dict_is_regrouped_in_rows_where_the_groups_changed():
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 72), nn.Linear(64, 64))  # rows of 20 and of 64
    old = old_state_dict(model, generator)
    optimizer = po.AdamW(model.parameters(), lr=1e-2, min_8bit_size=0)
    optimizer.load_state_dict(old)
    state = optimizer.state_dict()["state"]
    for index, p in enumerate(model.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            values = flat_decoded(old["state"][index], name)
            if p.dim() == 1:  # biases keep fp32 moments: the exact decoded values
                assert torch.equal(state[index][name], values)
                continue
            codes, scales = state_format.encode(state_format.MOMENTS["adamw"][
                name == "exp_avg_sq"], values, p.shape)
            assert torch.equal(state[index][f"{name}_codes"], codes)
            assert torch.equal(state[index][f"{name}_scales"], scales)
            if p.shape[-1] % 32 == 0:  # the same groups: the saved bits, scales reshaped
                assert torch.equal(codes, old["state"][index][f"{name}_codes"])
                assert torch.equal(scales.reshape(-1), old["state"][index][f"{name}_scales"])


@pytest.mark.parametrize("second", [False, True])
def test_regrouping_rounds_once_more_within_half_a_code_step_of_the_new_scale(second):
    """What re-encoding the decoded flat groups in rows costs (docs/compression.md)."""
    generator = torch.Generator().manual_seed(5)
    shape = (512, 20)
    _, codes, scales = old_state(shape, second, generator)
    decode = native.decode_second_moment if second else native.decode_moment
    old = decode(codes.reshape(-1), scales).view(shape)
    moment = state_format.EXP_AVG_SQ if second else state_format.EXP_AVG
    new_codes, new_scales = state_format.encode(moment, old, torch.Size(shape))
    new = state_format.decode(moment, new_codes, new_scales, torch.Size(shape))
    scale = new_scales.double()  # [512, 1]: one group a row
    rounding = 2 * 2.0 ** -23  # of the fp32 decode, in units of the scale
    if second:  # sqrt(v) is coded linearly: half a code is scale / 510
        error = (new.double().sqrt() - old.double().sqrt()).abs() / scale
        assert error.max() <= 0.5 / 255 + rounding
    else:  # the companded step is widest at the top: half of 254 / 127^2
        error = (new.double() - old.double()).abs() / scale
        assert error.max() <= 127.0 / 127 ** 2 + rounding
    assert error.max() > 0  # it does round: the groups changed


def test_small_and_1d_params_of_an_old_8bit_state_dict_load_as_their_decoded_fp32():
    generator = torch.Generator().manual_seed(2)
    model = nn.Sequential(nn.Linear(20, 72), nn.LayerNorm(72))
    old = old_state_dict(model, generator)
    optimizer = po.AdamW(model.parameters(), lr=1e-2)  # default min_8bit_size: all fp32
    optimizer.load_state_dict(old)
    state = optimizer.state_dict()["state"]
    for index in range(4):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[index][name], flat_decoded(old["state"][index], name))


def write_version_1_checkpoint(path, model: nn.Module, old: dict,
                               codes_dtype: str = "int8") -> None:
    """The streaming checkpoint pagedoptim before 0.2 wrote for state `old` (flat groups,
    every param 8-bit, format version 1), written with this version's format module."""
    params = list(model.parameters())
    streams = []
    for name, second in (("exp_avg", False), ("exp_avg_sq", True)):
        dtype, size = ("uint8", 32) if second else (codes_dtype, 32 if codes_dtype == "int8"
                                                   else 64)
        streams += [checkpoint_format.StreamEntry(f"{name}_codes", dtype, size, False),
                    checkpoint_format.StreamEntry(f"{name}_scales", "float16", 2, True)]
    entries = tuple(checkpoint_format.ParamEntry(
        tuple(p.shape), "float32", None, {"step": torch.tensor(3.0)}, None,
        (checkpoint_format.SlotEntry("state", p.numel(), tuple(streams)),)) for p in params)
    groups = [{**{k: v for k, v in old["param_groups"][0].items() if k != "params"},
               "params": list(range(len(params)))}]
    header = checkpoint_format.Header("adamw", "AdamW", {"state_bits": 8, "master_bits": 24,
                                                         "group_size": 32},
                                      4096, groups, entries, [], {})
    version, checkpoint_format.VERSION = checkpoint_format.VERSION, 1
    try:
        with open(path, "wb") as handle:
            checkpoint_format.write_header(handle, header)
            writer = checkpoint_format.RecordWriter(handle)
            for spec in checkpoint_format.expected_records(header):
                entry = old["state"][spec.param]
                payload = bytearray()
                for name, first, _, size in checkpoint_format.record_parts(header, spec):
                    raw = entry[name].contiguous().view(-1).view(torch.uint8)
                    payload += bytes(raw[first:first + size].numpy())
                writer.write(spec, memoryview(payload))
            writer.finish()
    finally:
        checkpoint_format.VERSION = version


def test_a_version_1_streaming_checkpoint_loads_as_its_state_dict_does(tmp_path):
    generator = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(20, 72), nn.Linear(72, 64))
    old = old_state_dict(model, generator)
    write_version_1_checkpoint(tmp_path / "old.ckpt", model, old)
    assert checkpoint_stream.read_header(tmp_path / "old.ckpt").params[0].slots[0].row_length == 0
    by_stream = po.AdamW(model.parameters(), lr=1e-2, min_8bit_size=0)
    by_stream.load_checkpoint(tmp_path / "old.ckpt")
    by_dict = po.AdamW(model.parameters(), lr=1e-2, min_8bit_size=0)
    by_dict.load_state_dict(old)
    streamed, loaded = by_stream.state_dict()["state"], by_dict.state_dict()["state"]
    assert set(streamed) == set(loaded)
    for index, entry in loaded.items():
        assert set(streamed[index]) == set(entry)
        for key, value in entry.items():
            assert torch.equal(streamed[index][key], value), (index, key)
    # And it saves in version 2 with row groups, which load back bit for bit.
    by_stream.save_checkpoint(tmp_path / "new.ckpt")
    assert checkpoint_stream.read_header(tmp_path / "new.ckpt").params[0].slots[0].row_length == 20
    again = po.AdamW(model.parameters(), lr=1e-2, min_8bit_size=0)
    again.load_checkpoint(tmp_path / "new.ckpt")
    for index, entry in again.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(streamed[index][key], value), (index, key)


def test_a_saved_slot_with_a_stream_of_another_dtype_is_refused_not_reinterpreted(tmp_path):
    """A slot in another layout is converted from its streams' bytes: a stream whose dtype
    or size is not the one its name has in any state format is refused first."""
    generator = torch.Generator().manual_seed(4)
    model = nn.Sequential(nn.Linear(20, 72))
    old = old_state_dict(model, generator)
    for entry in old["state"].values():
        entry["exp_avg_codes"] = entry["exp_avg_codes"].to(torch.int16)
    write_version_1_checkpoint(tmp_path / "bad.ckpt", model, old, codes_dtype="int16")
    optimizer = po.AdamW(model.parameters(), lr=1e-2, min_8bit_size=0)
    with pytest.raises(ValueError, match="param 0 keeps state"):
        optimizer.load_checkpoint(tmp_path / "bad.ckpt")


@pytest.mark.parametrize("row_length", [0, 20, 40, 64, 3])
def test_checkpoint_records_cover_each_group_of_a_row(row_length):
    """A record's byte range of the scales runs from the group holding its first element to
    the last group holding one of its elements; the records together cover every group."""
    stream = checkpoint_format.StreamEntry("x_scales", "float16", 2, True)
    numel = 120 * (row_length or 1)
    groups = native.count_groups(numel, row_length)
    assert stream.total_bytes(numel, row_length) == 2 * groups
    slot = checkpoint_format.SlotEntry("state", numel, (stream,), row_length)
    step = checkpoint_format.elements_per_record(slot, 64)
    covered = set()
    for begin in range(0, numel, step):
        first, last = stream.byte_range(begin, min(numel, begin + step), row_length)
        covered |= set(range(first // 2, last // 2))
    assert covered == set(range(groups))
