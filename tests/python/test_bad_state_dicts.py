"""load_state_dict on truncated, corrupted or hostile state_dicts (docs/reliability.md, "Bad
files"): a clear ValueError / TypeError naming the param and the key, never a crash, and
nothing changed: the optimizer is bit-identical to before and steps exactly as before.

Every case loads into an optimizer that was stepped (so it has state to lose), and compares
it with a twin built and stepped alike that never saw the bad state_dict.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import warnings

import pytest
import torch

import pagedoptim as po
from pagedoptim.engine.state_store import StateStore

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "fuzz"))
import state_dict_cases as cases  # noqa: E402


def _saved(mode: str) -> dict:
    opt = cases.make(mode, seed=1)
    state_dict = opt.state_dict()
    opt.close()
    return state_dict


def _refused(mode: str, state_dict, error: type, *words: str) -> None:
    """Loading `state_dict` into a stepped `mode` optimizer raises `error` whose message has
    every one of `words`; the optimizer is then exactly its twin's, and steps like it."""
    opt, twin = cases.make(mode, seed=2, steps=1), cases.make(mode, seed=2, steps=1)
    before = cases.snapshot(opt)
    assert before == cases.snapshot(twin)
    with pytest.raises(error) as raised:
        opt.load_state_dict(state_dict)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))
    assert cases.snapshot(opt) == before, "a refused load changed the optimizer"
    cases.step(opt, seed=3, steps=2)
    cases.step(twin, seed=3, steps=2)
    assert cases.snapshot(opt) == cases.snapshot(twin), "it no longer steps like before"


def _with(mode: str, param: int, key: str, value) -> dict:
    state_dict = _saved(mode)
    state_dict["state"][param][key] = value
    return state_dict


def _without(mode: str, param: int, key: str) -> dict:
    state_dict = _saved(mode)
    del state_dict["state"][param][key]
    return state_dict


# -- the containers --------------------------------------------------------------------------

@pytest.mark.parametrize("bad, error, words", [
    ([1, 2], TypeError, ["state_dict must be a dict", "list"]),
    ({"state": {}}, ValueError, ["no 'param_groups'"]),
    ({"param_groups": []}, ValueError, ["no 'state'"]),
    ({"state": [], "param_groups": []}, TypeError, ["state_dict['state'] must be a dict"]),
    ({"state": {}, "param_groups": {}}, TypeError, ["state_dict['param_groups'] must be a list"]),
    ({"state": {}, "param_groups": [3]}, TypeError, ["param_groups'][0] must be a dict"]),
    ({"state": {}, "param_groups": [{}]}, ValueError, ["param_groups'][0] has no 'params'"]),
    ({"state": {}, "param_groups": [{"params": 0}]}, TypeError, ["list of param indices"]),
    ({"state": {}, "param_groups": [{"params": [[0]]}]}, TypeError, ["['params'][0]",
                                                                      "param index"]),
])
def test_a_malformed_state_dict_is_refused(bad, error, words):
    _refused("adamw_8bit", bad, error, *words)


def test_a_wrong_number_of_groups_or_params_is_refused():
    state_dict = _saved("adamw_8bit")
    state_dict["param_groups"].pop()
    _refused("adamw_8bit", state_dict, ValueError, "number of parameter groups")
    state_dict = _saved("adamw_8bit")
    state_dict["param_groups"][0]["params"].append(1)
    _refused("adamw_8bit", state_dict, ValueError, "size of optimizer's group")


@pytest.mark.parametrize("value", [None, 3, "x", [1], torch.zeros(3)])
def test_a_param_state_that_is_not_a_dict_is_refused(value):
    state_dict = _saved("adamw_exact")
    state_dict["state"][1] = value
    _refused("adamw_exact", state_dict, TypeError, "state for param 1 must be a dict")


# -- steps -----------------------------------------------------------------------------------

@pytest.mark.parametrize("step, error", [
    (-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
    (torch.tensor(-3.0), ValueError), (torch.tensor([1.0, 2.0]), ValueError),
    (torch.tensor(1e300, dtype=torch.float64), ValueError), (1e39, ValueError),
    ("12", TypeError), (None, TypeError), (True, TypeError), ([3], TypeError),
])
def test_a_step_that_is_not_a_count_is_refused(step, error):
    # torch keeps any step and fails (or computes NaN bias corrections) at the next step.
    _refused("adamw_8bit", _with("adamw_8bit", 0, "step", step), error,
             "state for param 0['step']")


def test_integer_and_float_steps_load_as_torch_saves_them():
    for step in (5, 5.0, torch.tensor(5), torch.tensor(5.0, dtype=torch.float64)):
        opt = cases.make("adamw_exact", seed=2)
        opt.load_state_dict(_with("adamw_exact", 0, "step", step))
        assert float(opt.state[cases.params_of(opt)[0]]["step"]) == 5.0


# -- stream tensors: sizes, dtypes, layouts, devices -----------------------------------------

@pytest.mark.parametrize("mode, key", [("adamw_exact", "exp_avg"),
                                       ("adamw_8bit", "exp_avg_codes"),
                                       ("adamw_8bit", "exp_avg_sq_scales"),
                                       ("adamw_bf16_residual", "master_residual"),
                                       ("skewadam", "exp_avg_sq_row")])
def test_a_truncated_or_padded_stream_is_refused(mode, key):
    param = 1 if key == "exp_avg_sq_row" else 0
    value = _saved(mode)["state"][param][key]
    # Scales keep their [rows, groups] shape: a 1-D tensor of one scale per 32 elements in
    # flat order is the layout of pagedoptim before 0.2, which loads (test_row_groups.py).
    value = value if key.endswith("_scales") else value.reshape(-1)
    _refused(mode, _with(mode, param, key, value[:-1]), ValueError, f"param {param}", key)
    _refused(mode, _with(mode, param, key, torch.cat([value, value[:1]])), ValueError,
             f"param {param}", key)


def test_a_huge_expanded_stream_is_refused_before_it_is_read():
    # 2^40 elements and no memory: reading it would try to allocate 4 TiB.
    huge = torch.zeros(1).expand(1 << 40)
    _refused("adamw_exact", _with("adamw_exact", 0, "exp_avg", huge), ValueError,
             "state for param 0['exp_avg']", f"{1 << 40} elements")
    # Cast to the param's dtype as torch casts it, it would need its 8 TiB.
    huge = torch.zeros(1, dtype=torch.float64).expand(1 << 40)
    _refused("adamw_exact", _with("adamw_exact", 0, "my_entry", huge), ValueError,
             "state for param 0['my_entry']", "could not be cast")


@pytest.mark.parametrize("key, value, error, words", [
    ("exp_avg_codes", lambda v: v.float(), TypeError, ["must be torch.int8"]),
    ("exp_avg_sq_codes", lambda v: v.to(torch.int8), TypeError, ["must be torch.uint8"]),
    ("exp_avg_scales", lambda v: v.to(torch.int16), TypeError, ["must be float16"]),
    ("exp_avg_codes", lambda v: torch.empty(v.shape, dtype=v.dtype, device="meta"), ValueError,
     ["meta tensor"]),
    ("exp_avg_codes", lambda v: v.to_sparse_csr() if v.dim() == 2 else v.reshape(7, 10)
     .to_sparse_csr(), TypeError, ["layout torch.sparse_csr"]),
    ("exp_avg_codes", lambda v: torch.quantize_per_tensor(v.float(), 1.0, 0, torch.qint8),
     TypeError, ["dtype torch.qint8"]),
    ("exp_avg_codes", lambda v: "codes", TypeError, ["must be a Tensor, got str"]),
])
def test_a_stream_of_the_wrong_kind_is_refused(key, value, error, words):
    given = _saved("adamw_8bit")["state"][0][key]
    _refused("adamw_8bit", _with("adamw_8bit", 0, key, value(given)), error,
             f"state for param 0[{key!r}]", *words)


def test_a_sparse_tensor_with_indices_outside_its_size_is_refused():
    # torch.sparse_coo_tensor does not check indices unless asked; densifying this one wrote
    # past the end of a 70-element buffer (a segfault, or a silently corrupted heap).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hostile = torch.sparse_coo_tensor(torch.tensor([[1_000_000]]), torch.tensor([1.0]),
                                          (70,), check_invariants=False)
    for key in ("exp_avg", "my_entry"):
        _refused("adamw_exact", _with("adamw_exact", 0, key, hostile), ValueError,
                 f"state for param 0[{key!r}]", "indices outside its size")


def test_a_hostile_sparse_tensor_written_through_optimizer_state_is_refused():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hostile = torch.sparse_coo_tensor(torch.tensor([[1_000_000]]), torch.tensor([1.0]),
                                          (70,), check_invariants=False)
    opt, twin = cases.make("adamw_exact", seed=2), cases.make("adamw_exact", seed=2)
    with pytest.raises(ValueError, match="indices outside its size"):
        opt.state[cases.params_of(opt)[0]]["exp_avg"] = hostile
    assert cases.snapshot(opt) == cases.snapshot(twin)


def test_non_contiguous_and_flat_streams_load_like_contiguous_ones():
    saved = _saved("adamw_8bit")
    changed = copy.deepcopy(saved)
    codes = saved["state"][1]["exp_avg_codes"]  # [3, 64]
    changed["state"][1]["exp_avg_codes"] = codes.t().contiguous().t()  # same values, strided
    changed["state"][1]["exp_avg_sq_codes"] = saved["state"][1]["exp_avg_sq_codes"].reshape(-1)
    a, b = cases.make("adamw_8bit", seed=2), cases.make("adamw_8bit", seed=2)
    a.load_state_dict(saved)
    b.load_state_dict(changed)
    assert cases.snapshot(a) == cases.snapshot(b)


# -- 8-bit values their encoder never writes -------------------------------------------------

def test_codes_without_their_scales_are_refused():
    _refused("adamw_8bit", _without("adamw_8bit", 0, "exp_avg_scales"), ValueError,
             "state for param 0", "'exp_avg_scales'")
    _refused("adamw_8bit", _without("adamw_8bit", 1, "exp_avg_sq_codes"), ValueError,
             "state for param 1", "'exp_avg_sq_codes'")


@pytest.mark.parametrize("scale", [-1.0, float("inf"), float("-inf")])
def test_negative_or_infinite_scales_are_refused(scale):
    scales = _saved("adamw_8bit")["state"][0]["exp_avg_scales"].clone()
    scales[1] = scale
    _refused("adamw_8bit", _with("adamw_8bit", 0, "exp_avg_scales", scales), ValueError,
             "state for param 0['exp_avg_scales']", "negative or infinite scale")


def test_a_nan_scale_loads_as_the_nan_moment_it_stands_for():
    # A NaN scale is what a group holding a non-finite moment is stored as; torch loads a NaN
    # moment too, and a diverged run's own state_dict must load back bit-identically.
    saved = _saved("adamw_8bit")
    saved["state"][0]["exp_avg_scales"][0, 1] = float("nan")  # row 0's partial group
    opt = cases.make("adamw_8bit", seed=2)
    opt.load_state_dict(saved)
    loaded = opt.state_dict()["state"][0]
    assert cases._exact(loaded["exp_avg_scales"]) == cases._exact(saved["state"][0]
                                                                  ["exp_avg_scales"])
    exp_avg = opt.state[cases.params_of(opt)[0]]["exp_avg"]
    assert exp_avg[0, 32:].isnan().all() and not exp_avg[0, :32].isnan().any()
    assert not exp_avg[1].isnan().any()


def test_int8_codes_of_minus_128_are_refused():
    codes = _saved("adamw_8bit")["state"][0]["exp_avg_codes"].clone()
    codes[0, 5] = -128
    _refused("adamw_8bit", _with("adamw_8bit", 0, "exp_avg_codes", codes), ValueError,
             "state for param 0['exp_avg_codes']", "-128")


@pytest.mark.parametrize("mode, outside", [("adamw_bf16_residual", -128),
                                           ("adamw_amsgrad_16bit_residual", -32768)])
def test_a_master_residual_out_of_range_or_of_a_wrong_dtype_is_refused(mode, outside):
    residual = _saved(mode)["state"][0]["master_residual"].clone()
    residual[0, 3] = outside  # the residual's codes lie in [-K, K]: K = 127 or 32767
    _refused(mode, _with(mode, 0, "master_residual", residual), ValueError,
             "state for param 0['master_residual']", "lie in")
    _refused(mode, _with(mode, 0, "master_residual", residual.float()), TypeError,
             "state for param 0['master_residual']", "int8", "int16")


def test_a_residual_saved_with_the_other_master_bits_is_rescaled():
    """A 24-bit (int8) master residual loads into master_bits=32 (int16) as the same
    fraction of a half-ulp, and back: the master weight it rebuilds is the same."""
    saved = _saved("adamw_bf16_residual")
    residual = saved["state"][0]["master_residual"]
    opt = po.AdamW(cases._groups(cases._params(torch.bfloat16, 1)), lr=1e-2, master_bits=32)
    opt.load_state_dict(saved)
    loaded = opt.state_dict()["state"][0]["master_residual"]
    assert loaded.dtype == torch.int16
    expected = torch.round(residual.double() * (32767 / 127)).to(torch.int16)
    assert torch.equal(loaded, expected)
    back = cases.make("adamw_bf16_residual", seed=2)
    back.load_state_dict(opt.state_dict())
    assert torch.equal(back.state_dict()["state"][0]["master_residual"], residual)


# -- groups and hyperparameters --------------------------------------------------------------

@pytest.mark.parametrize("key, value, error", [
    ("lr", -1.0, ValueError), ("lr", "0.1", TypeError), ("lr", float("nan"), ValueError),
    ("betas", (0.9,), ValueError), ("betas", (1.5, 0.9), ValueError),
    ("amsgrad", torch.tensor([True, False]), TypeError), ("amsgrad", "False", TypeError),
    ("maximize", [1], TypeError), ("differentiable", torch.ones(2), TypeError),
    ("weight_decay", None, TypeError),
])
def test_a_bad_hyperparameter_is_refused(key, value, error):
    state_dict = _saved("adamw_8bit")
    state_dict["param_groups"][1][key] = value
    _refused("adamw_8bit", state_dict, error, key)


def test_param_names_of_a_wrong_length_are_refused():
    state_dict = _saved("adamw_8bit")
    state_dict["param_groups"][0]["param_names"] = ["a", "b"]
    _refused("adamw_8bit", state_dict, ValueError, "param_groups[0]['param_names']")


def test_skewadam_tiers_must_fit_the_params():
    state_dict = _saved("skewadam")
    state_dict["param_groups"][1]["param_tiers"] = []
    _refused("skewadam", state_dict, ValueError, "param_groups[1]['param_tiers']")
    state_dict["param_groups"][1]["param_tiers"] = ["sideways"]
    _refused("skewadam", state_dict, ValueError, "sideways")


def test_skewadam_groups_saved_without_tiers_keep_the_optimizers_own():
    saved = _saved("skewadam")
    del saved["param_groups"][1]["param_tiers"]  # group 0's still say it is SkewAdam's
    opt, reference = cases.make("skewadam", seed=2), cases.make("skewadam", seed=2)
    opt.load_state_dict(saved)
    reference.load_state_dict(_saved("skewadam"))
    assert cases.snapshot(opt) == cases.snapshot(reference)


# -- another algorithm's checkpoint ----------------------------------------------------------

@pytest.mark.parametrize("saved_by, loaded_into", [
    ("sgd_momentum", "adamw_8bit"), ("skewadam", "adamw_8bit"), ("adamw_exact", "sgd_momentum"),
    ("lion_8bit", "skewadam"), ("adamw_8bit", "lion_8bit"),
])
def test_a_checkpoint_of_another_algorithm_is_refused(saved_by, loaded_into):
    _refused(loaded_into, _saved(saved_by), ValueError, "cannot load it")


def test_another_algorithms_state_under_this_algorithms_groups_is_refused():
    state_dict = _saved("adamw_8bit")
    state_dict["state"] = _saved("sgd_momentum")["state"]  # momentum_buffer*, no step
    _refused("adamw_8bit", state_dict, ValueError, "state for param 0",
             "'momentum_buffer_codes'", "another algorithm")


# -- all or nothing --------------------------------------------------------------------------

@pytest.mark.parametrize("mode", list(cases.MODES))
def test_a_load_failing_at_its_last_param_changes_nothing(mode):
    """Param 0's state is valid and written first; param 1's fails. Nothing of param 0's
    new state may remain, in any format, paged to NVMe included."""
    state_dict = _saved(mode)
    key = next(k for k in sorted(state_dict["state"][1]) if k != "step")
    state_dict["state"][1][key] = state_dict["state"][1][key].reshape(-1)[:-1]
    _refused(mode, state_dict, ValueError, "param 1", key)


def test_a_failure_while_the_new_pages_are_written_changes_nothing(monkeypatch):
    """Past every check: the engine's write of param 1's stream fails (a disk error, say).
    The rollback puts back the old engine and state, and the error is the one raised."""
    state_dict = _saved("adamw_nvme")
    opt, twin = cases.make("adamw_nvme", seed=2, steps=1), cases.make("adamw_nvme", seed=2,
                                                                       steps=1)
    before = cases.snapshot(opt)
    original = StateStore.write_streams
    def failing(self, p, given, complete, where):
        if where.endswith("param 1"):
            raise OSError(5, "simulated write failure")
        return original(self, p, given, complete, where)
    monkeypatch.setattr(StateStore, "write_streams", failing)
    with pytest.raises(OSError, match="simulated write failure"):
        opt.load_state_dict(state_dict)
    monkeypatch.undo()
    assert cases.snapshot(opt) == before
    cases.step(opt, seed=3, steps=2)
    cases.step(twin, seed=3, steps=2)
    assert cases.snapshot(opt) == cases.snapshot(twin)


def test_copies_read_before_a_refused_load_still_write_back():
    """A tensor read from optimizer.state before a refused load is still the live state's
    copy: changing it in place reaches the pages, as it would have without the load."""
    opt = cases.make("adamw_exact", seed=2)
    p = cases.params_of(opt)[0]
    exp_avg = opt.state[p]["exp_avg"]
    bad = _with("adamw_exact", 1, "step", -1.0)
    with pytest.raises(ValueError):
        opt.load_state_dict(bad)
    exp_avg.fill_(0.25)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], torch.full((2, 35), 0.25))


def test_a_valid_state_dict_still_loads_after_a_refused_one():
    opt = cases.make("adamw_8bit", seed=2)
    with pytest.raises(ValueError):
        opt.load_state_dict(_with("adamw_8bit", 0, "step", math.nan))
    saved = _saved("adamw_8bit")
    opt.load_state_dict(saved)
    assert cases._exact(opt.state_dict()) == cases._exact(saved)
