"""The one-flag route: PAGEDOPTIM_* settings from the environment, pagedoptim.patch() /
unpatch(), and the classes that stand in for torch.optim.AdamW, Adam and SGD (reference:
torch's own classes, from pagedoptim.patch.torch_class while patched)."""

import inspect
import os

import pytest
import torch

import pagedoptim as po
from conftest import (EXACT, FP32_TOL, SMALL_SHAPES, Grads, make_params, run_lockstep,
                      run_steps)
from pagedoptim import env_settings
from pagedoptim.patch import torch_class
from pagedoptim.env_settings import EnvironmentSettingError, settings_from_environment

TORCH_NAMES = ("AdamW", "Adam", "SGD")


@pytest.fixture
def patched():
    po.patch(**EXACT)
    yield
    po.unpatch()


@pytest.fixture(autouse=True)
def no_pagedoptim_environment(monkeypatch):
    """patch() reads the PAGEDOPTIM_* variables: the tests start from none set."""
    for name in list(os.environ):
        if name.startswith("PAGEDOPTIM"):
            monkeypatch.delenv(name)
    yield
    po.unpatch()


# -- the environment -----------------------------------------------------------------------

def test_every_setting_parses():
    environ = {"PAGEDOPTIM_OFFLOAD": "nvme", "PAGEDOPTIM_NVME_DIR": "/tmp/pages",
               "PAGEDOPTIM_CACHE_BYTES": "512MiB", "PAGEDOPTIM_STATE_BITS": "32",
               "PAGEDOPTIM_MASTER_BITS": "none", "PAGEDOPTIM_PAGE_BYTES": "64KiB",
               "PAGEDOPTIM_PREFETCH": "2", "PAGEDOPTIM_POLICY": "LRU",
               "PAGEDOPTIM_RELEASE_GRADS": "true", "HOME": "/root"}
    assert settings_from_environment(environ) == {
        "offload": "nvme", "nvme_dir": "/tmp/pages", "cache_bytes": 512 << 20,
        "state_bits": 32, "master_bits": None, "page_bytes": 64 << 10, "prefetch": 2,
        "policy": "lru", "release_grads": True}
    assert settings_from_environment({}) == {}


@pytest.mark.parametrize("value, expected", [
    ("1048576", 1 << 20), ("4GiB", 4 << 30), ("4 gib", 4 << 30), ("1.5GiB", 3 << 29),
    ("2GB", 2 * 10**9), ("100kB", 100_000), ("8B", 8), ("0", 0)])
def test_cache_bytes_takes_sizes(value, expected):
    environ = {"PAGEDOPTIM_CACHE_BYTES": value}
    assert settings_from_environment(environ) == {"cache_bytes": expected}


@pytest.mark.parametrize("variable, value, expected", [
    ("PAGEDOPTIM_STATE_BITS", "7", "one of 8, 32"),
    ("PAGEDOPTIM_STATE_BITS", "eight", "one of 8, 32"),
    ("PAGEDOPTIM_MASTER_BITS", "16", "one of 24, 32, none"),
    ("PAGEDOPTIM_OFFLOAD", "disk", "one of none, host, nvme"),
    ("PAGEDOPTIM_POLICY", "fifo", "one of auto, lru, plan"),
    ("PAGEDOPTIM_CACHE_BYTES", "lots", "a number of bytes or a size"),
    ("PAGEDOPTIM_CACHE_BYTES", "4GiBs", "a number of bytes or a size"),
    ("PAGEDOPTIM_CACHE_BYTES", "0.5B", "a whole number of bytes"),
    ("PAGEDOPTIM_PAGE_BYTES", "-4096", "a number of bytes or a size"),
    ("PAGEDOPTIM_PREFETCH", "many", "an integer"),
    ("PAGEDOPTIM_RELEASE_GRADS", "maybe", "one of 1, true, yes, on"),
    ("PAGEDOPTIM_NVME_DIR", " ", "a directory path"),
])
def test_bad_values_name_the_variable_and_what_it_expects(variable, value, expected):
    with pytest.raises(EnvironmentSettingError) as error:
        settings_from_environment({variable: value})
    message = str(error.value)
    assert f"{variable}={value!r}" in message and expected in message, message


def test_settings_that_do_not_fit_together_name_the_variables():
    # prefetch means nothing without paging; PagingOptions says so, we name the variables.
    environ = {"PAGEDOPTIM_PREFETCH": "2", "PAGEDOPTIM_STATE_BITS": "32"}
    with pytest.raises(EnvironmentSettingError, match="PAGEDOPTIM_PREFETCH.*prefetch=2"):
        settings_from_environment(environ)
    with pytest.raises(EnvironmentSettingError, match="page_bytes"):
        settings_from_environment({"PAGEDOPTIM_PAGE_BYTES": "1000"})


def test_an_unknown_variable_raises_with_the_closest_name():
    with pytest.raises(EnvironmentSettingError,
                       match="PAGEDOPTIM_STATEBITS.*did you mean PAGEDOPTIM_STATE_BITS"):
        settings_from_environment({"PAGEDOPTIM_STATEBITS": "32"})
    with pytest.raises(EnvironmentSettingError, match="Unknown environment variable"):
        settings_from_environment({"PAGEDOPTIM_ZZZ": "1"})


def test_variables_of_the_build_and_the_library_are_reserved():
    environ = {name: "x" for name in env_settings.RESERVED}
    assert settings_from_environment(environ) == {}


@pytest.mark.parametrize("value, enabled", [
    (None, False), ("", False), ("0", False), ("off", False), ("1", True), ("TRUE", True),
    ("yes", True)])
def test_the_flag(value, enabled):
    environ = {} if value is None else {"PAGEDOPTIM": value}
    assert env_settings.flag_enabled(environ) is enabled


def test_a_bad_flag_value_raises():
    with pytest.raises(EnvironmentSettingError, match="PAGEDOPTIM='please'"):
        env_settings.flag_enabled({"PAGEDOPTIM": "please"})


# -- patch() / unpatch() -------------------------------------------------------------------

def test_patch_replaces_torch_names_and_unpatch_restores_the_very_classes():
    originals = {name: getattr(torch.optim, name) for name in TORCH_NAMES}
    po.patch()
    po.patch()  # idempotent: the originals are not lost to a second patch
    for name in TORCH_NAMES:
        replacement = getattr(torch.optim, name)
        assert replacement is not originals[name]
        assert replacement.__module__.startswith("pagedoptim")
        assert torch_class(name) is originals[name]
    po.unpatch()
    po.unpatch()
    for name in TORCH_NAMES:
        assert getattr(torch.optim, name) is originals[name]


def test_patched_classes_answer_isinstance_like_torch(patched):
    params = make_params(SMALL_SHAPES)
    adamw, adam, sgd = torch.optim.AdamW(params), torch.optim.Adam(params), \
        torch.optim.SGD(params)
    for opt in (adamw, adam, sgd):
        assert isinstance(opt, torch.optim.Optimizer)
        assert isinstance(opt, po.PagedOptimizer)
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(adamw, po.AdamW)
    # torch's AdamW is a subclass of its Adam; so are the stand-ins.
    assert issubclass(torch_class("AdamW"), torch_class("Adam"))
    assert isinstance(adamw, torch.optim.Adam) and not isinstance(adam, torch.optim.AdamW)
    assert isinstance(sgd, torch.optim.SGD) and isinstance(sgd, po.SGD)


@pytest.mark.parametrize("name", TORCH_NAMES)
def test_stand_ins_have_torch_defaults(name, patched):
    """Built with nothing but params, ours has the hyperparameters torch's has (torch's
    foreach/fused/capturable/differentiable flags aside: they say how torch runs a step)."""
    ours = getattr(torch.optim, name)(make_params([(3,)]))
    theirs = torch_class(name)(make_params([(3,)]))
    execution_flags = {"params", "foreach", "fused", "capturable", "differentiable"}
    for key, value in theirs.param_groups[0].items():
        if key not in execution_flags:
            assert ours.param_groups[0][key] == value, f"{name} default {key}"


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_stand_ins_take_torch_signature(name):
    torch_parameters = inspect.signature(torch_class(name)).parameters
    ours = inspect.signature(getattr(po.stand_ins, name)).parameters
    for parameter in torch_parameters.values():
        if parameter.name in ("foreach", "fused", "capturable", "differentiable"):
            continue  # passed on through **kwargs
        assert parameter.name in ours, f"{name} lacks {parameter.name}"
        assert ours[parameter.name].default == parameter.default, parameter.name
        assert ours[parameter.name].kind == parameter.kind, parameter.name


CONFIGS = {
    "AdamW": dict(lr=1e-2, weight_decay=0.1),
    "AdamW-amsgrad": dict(lr=1e-2, amsgrad=True),
    "Adam": dict(lr=1e-2),
    "Adam-decoupled": dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "SGD": dict(lr=1e-2, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_patched_classes_match_torch(case, patched):
    name = case.split("-")[0]
    params, ref_params = make_params(SMALL_SHAPES), make_params(SMALL_SHAPES)
    ours = getattr(torch.optim, name)(params, **CONFIGS[case])
    ref = torch_class(name)(ref_params, **CONFIGS[case])
    run_lockstep(ours, params, ref, ref_params, Grads(SMALL_SHAPES, 8), tol=FP32_TOL,
                 label=f"patched {case}")


def test_adam_with_coupled_weight_decay_raises_everywhere_it_could_appear(patched):
    params = make_params(SMALL_SHAPES)
    with pytest.raises(ValueError, match="L2.*weight_decay|weight_decay.*L2"):
        torch.optim.Adam(params, weight_decay=0.1)
    opt = torch.optim.Adam(params[:2])
    with pytest.raises(ValueError, match="param group 1"):
        opt.add_param_group({"params": params[2:], "weight_decay": 1e-3})
    opt.param_groups[0]["weight_decay"] = 1e-3  # edited after construction
    params[0].grad = torch.ones_like(params[0])
    with pytest.raises(ValueError, match="weight_decay"):
        opt.step()


def test_patch_settings_overrides_beat_the_environment(monkeypatch):
    monkeypatch.setenv("PAGEDOPTIM_STATE_BITS", "32")
    monkeypatch.setenv("PAGEDOPTIM_MASTER_BITS", "none")
    po.patch(state_bits=8)
    params = make_params(SMALL_SHAPES)
    opt = torch.optim.AdamW(params)
    run_steps(opt, params, Grads(SMALL_SHAPES, 1), 0, 1)
    assert opt.memory_report()["moment_bytes"] == 2 * sum(p.numel() for p in params)
    # Arguments the script gives win over both.
    explicit = torch.optim.AdamW(params, state_bits=32)
    run_steps(explicit, params, Grads(SMALL_SHAPES, 1), 0, 1)
    assert explicit.memory_report()["moment_bytes"] == 8 * sum(p.numel() for p in params)


def test_patch_rejects_bad_settings_before_replacing_anything(monkeypatch):
    with pytest.raises(TypeError, match="stat_bits"):
        po.patch(stat_bits=32)
    with pytest.raises(ValueError, match="state_bits"):
        po.patch(state_bits=4)
    monkeypatch.setenv("PAGEDOPTIM_POLICY", "fifo")
    with pytest.raises(EnvironmentSettingError, match="PAGEDOPTIM_POLICY"):
        po.patch()
    assert torch.optim.AdamW is torch_class("AdamW")


def test_unknown_keyword_arguments_are_passed_on_never_dropped(patched):
    """torch's foreach= reaches our constructor: it either takes it into the group, as
    torch does, or raises naming it."""
    try:
        opt = torch.optim.SGD(make_params([(3,)]), lr=0.1, foreach=False)
    except TypeError as error:
        assert "foreach" in str(error)
    else:
        assert opt.param_groups[0]["foreach"] is False
    with pytest.raises(TypeError, match="no_such_argument"):
        torch.optim.AdamW(make_params([(3,)]), no_such_argument=1)
