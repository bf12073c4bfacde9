"""The one-flag route: PAGEDOPTIM_* settings from the environment, pagedoptim.patch() /
unpatch(), and the classes that stand in for torch.optim.AdamW, Adam and SGD (reference:
torch's own classes, from pagedoptim.integrations.patch.torch_class while patched)."""

import copy
import importlib.util
import inspect
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import pagedoptim as po
from support import (EXACT, FP32_TOL, SMALL_SHAPES, Grads, assert_8bit_moment_bytes,
                      make_params, run_lockstep, run_steps)
from pagedoptim.paging import env_settings
from pagedoptim.integrations import stand_ins
from pagedoptim.integrations.patch import torch_class
from pagedoptim.paging.env_settings import EnvironmentSettingError, settings_from_environment

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


def test_settings_that_do_not_fit_together_name_the_variables(monkeypatch):
    # prefetch means nothing without paging; PagingOptions says so, we name the variables.
    monkeypatch.setenv("PAGEDOPTIM_PREFETCH", "2")
    monkeypatch.setenv("PAGEDOPTIM_STATE_BITS", "32")
    with pytest.raises(EnvironmentSettingError, match="PAGEDOPTIM_PREFETCH.*prefetch=2"):
        po.patch()
    # ... and they are checked after the arguments of patch() are merged in.
    po.patch(offload="host")
    assert torch.optim.AdamW is stand_ins.AdamW
    monkeypatch.setenv("PAGEDOPTIM_PAGE_BYTES", "1000")
    with pytest.raises(EnvironmentSettingError, match="page_bytes"):
        po.patch(offload="host")


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


@pytest.mark.parametrize("name", TORCH_NAMES)
def test_stand_ins_take_torch_signature(name):
    torch_parameters = inspect.signature(torch_class(name)).parameters
    ours = inspect.signature(getattr(stand_ins, name)).parameters
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


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_keeps_its_weight_decay_semantics_in_copies(decoupled, patched):
    opt = torch.optim.Adam(make_params(SMALL_SHAPES[:2]), decoupled_weight_decay=decoupled)
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        group = {"params": make_params([(3,)]), "weight_decay": 0.1}
        if decoupled:
            copied.add_param_group(group)
            assert copied.param_groups[-1]["decoupled_weight_decay"] is True
        else:
            with pytest.raises(ValueError, match="L2"):
                copied.add_param_group(group)


def test_patch_settings_overrides_beat_the_environment(monkeypatch):
    monkeypatch.setenv("PAGEDOPTIM_STATE_BITS", "32")
    monkeypatch.setenv("PAGEDOPTIM_MASTER_BITS", "none")
    po.patch(state_bits=8)
    shapes = SMALL_SHAPES + [(64, 64)]  # 4096 elements: 8-bit moments by default
    params = make_params(shapes)
    opt = torch.optim.AdamW(params)
    run_steps(opt, params, Grads(shapes, 1), 0, 1)
    assert_8bit_moment_bytes(opt.memory_report())
    assert opt.memory_report()["fp32_state_elements"] == sum(p.numel() for p in params[:-1])
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
    """torch's foreach= and fused= reach our constructor, which takes them (our step is
    always fused: groups record None, see pagedoptim/optim/torch_flags.py) or raises naming
    them (capturable=True); an argument nobody knows raises."""
    opt = torch.optim.SGD(make_params([(3,)]), lr=0.1, foreach=False, fused=True)
    assert opt.param_groups[0]["foreach"] is None and opt.param_groups[0]["fused"] is None
    with pytest.raises(ValueError, match="capturable=True"):
        torch.optim.AdamW(make_params([(3,)]), capturable=True)
    with pytest.raises(TypeError, match="no_such_argument"):
        torch.optim.AdamW(make_params([(3,)]), no_such_argument=1)


# -- the startup hook: PAGEDOPTIM=1 python script.py ---------------------------------------
#
# The package may not be pip-installed from this tree, so the scripts run with python/ on
# PYTHONPATH and process python/pagedoptim.pth from a temporary site directory with
# site.addsitedir(), exactly as site does for site-packages at start-up.

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "python"
PTH = SOURCE / "pagedoptim.pth"


def run_script(code, tmp_path, **variables):
    site_dir = tmp_path / "site"
    site_dir.mkdir(exist_ok=True)
    shutil.copy(PTH, site_dir)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDOPTIM")}
    environ.update(variables, PYTHONPATH=os.pathsep.join(
        filter(None, [str(SOURCE), os.environ.get("PYTHONPATH")])))
    prologue = f"import site; site.addsitedir({str(site_dir)!r})\n"
    return subprocess.run([sys.executable, "-c", prologue + textwrap.dedent(code)],
                          env=environ, capture_output=True, text=True, timeout=120)


def test_flag_makes_torch_names_ours_with_settings_from_the_environment(tmp_path):
    result = run_script("""
        import sys
        assert "torch" not in sys.modules  # the hook waits for the script's import
        import torch
        from torch.optim import AdamW
        params = [torch.nn.Parameter(torch.randn(33))]
        opt = AdamW(params, lr=1e-2)
        for cls in (torch.optim.Adam, torch.optim.SGD):
            assert cls.__module__.startswith("pagedoptim"), cls
        assert type(opt).__module__.startswith("pagedoptim"), type(opt)
        assert isinstance(opt, torch.optim.Optimizer)
        # Settings reach the optimizer: 32-bit state, and paged to the page file.
        params[0].grad = torch.randn(33)
        opt.step()
        stats, report = opt.paging_stats(), opt.memory_report()
        assert stats["offload"] == "nvme", stats
        assert report["page_bytes"] == 8192 and report["moment_bytes"] == 2 * 4 * 33, report
        print("patched")
        """, tmp_path, PAGEDOPTIM="1", PAGEDOPTIM_STATE_BITS="32", PAGEDOPTIM_MASTER_BITS="none",
        PAGEDOPTIM_OFFLOAD="nvme", PAGEDOPTIM_NVME_DIR=str(tmp_path),
        PAGEDOPTIM_CACHE_BYTES="64KiB", PAGEDOPTIM_PAGE_BYTES="8KiB")
    assert result.returncode == 0 and "patched" in result.stdout, result.stderr


def test_the_flag_says_once_on_stderr_what_it_did_and_the_optimizer_shows_its_settings(tmp_path):
    """A user who set PAGEDOPTIM=1 sees that it took, and with which settings: one line on
    stderr per process, however many optimizers; repr() and .settings of each."""
    result = run_script("""
        import torch
        params = [torch.nn.Parameter(torch.randn(33))]
        first = torch.optim.AdamW(params, lr=1e-2)
        second = torch.optim.SGD(params, lr=1e-2)
        print(repr(first).splitlines()[0])
        print(first.settings)
        """, tmp_path, PAGEDOPTIM="1", PAGEDOPTIM_STATE_BITS="32", PAGEDOPTIM_MASTER_BITS="none")
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("pagedoptim:")]
    assert len(said) == 1, result.stderr
    assert "PAGEDOPTIM=1 is on" in said[0]
    assert "torch.optim.AdamW -> pagedoptim AdamW" in said[0]
    assert "torch.optim.SGD -> pagedoptim SGD" in said[0]
    assert "state_bits=32, master_bits=None" in said[0]
    shown, settings = result.stdout.splitlines()
    assert shown.startswith("AdamW (pagedoptim: state_bits=32, master_bits=None, "
                            "min_8bit_size=4096, offload=None")
    assert "'state_bits': 32" in settings and "'release_grads': False" in settings


def test_without_the_flag_nothing_is_said(tmp_path):
    result = run_script("import torch, pagedoptim", tmp_path)
    assert result.returncode == 0 and "pagedoptim:" not in result.stderr, result.stderr


def test_settings_is_a_copy_and_paging_stats_has_every_key_before_the_first_step(tmp_path):
    p = torch.nn.Parameter(torch.randn(1000))
    opt = po.AdamW([p], offload="nvme", nvme_dir=tmp_path, cache_bytes=64 << 10)
    opt.settings["state_bits"] = 32
    assert opt.settings["state_bits"] == 8 and opt.settings["cache_bytes"] == 64 << 10
    before = opt.paging_stats()
    assert before["offload"] == "nvme" and before["cache_bytes"] == 64 << 10
    assert before["hits"] == before["misses"] == before["num_pages"] == 0
    p.grad = torch.randn_like(p)
    opt.step()
    assert before.keys() == opt.paging_stats().keys()
    unpaged = po.AdamW([p])
    assert unpaged.paging_stats().keys() == before.keys()
    assert unpaged.paging_stats()["offload"] is None


def test_flag_patches_when_the_script_imports_pagedoptim_first(tmp_path):
    # pagedoptim imports torch half-way through its own import: the patch must wait for it.
    result = run_script("""
        import pagedoptim, torch
        assert torch.optim.AdamW is pagedoptim.integrations.stand_ins.AdamW
        """, tmp_path, PAGEDOPTIM="1")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("flag", [None, "0"])
def test_without_the_flag_torch_is_untouched(flag, tmp_path):
    variables = {} if flag is None else {"PAGEDOPTIM": flag}
    result = run_script(f"""
        import sys
        # Unset, the .pth imports nothing at all.
        assert ("_pagedoptim_startup" in sys.modules) == {flag is not None}
        import torch
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
        assert type(opt).__module__ == "torch.optim.adamw", type(opt)
        assert torch.optim.SGD.__module__ == "torch.optim.sgd"
        # Off, pagedoptim is never imported: a broken install cannot break `import torch`.
        assert "pagedoptim" not in sys.modules
        """, tmp_path, **variables)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("variables, expected", [
    ({"PAGEDOPTIM_STATE_BITS": "7"}, "PAGEDOPTIM_STATE_BITS='7': expected one of 8, 32"),
    ({"PAGEDOPTIM_CACHEBYTES": "4GiB"},
     "PAGEDOPTIM_CACHEBYTES (did you mean PAGEDOPTIM_CACHE_BYTES?)"),
    ({"PAGEDOPTIM": "please"}, "PAGEDOPTIM='please': expected one of 1, true"),
])
def test_bad_settings_stop_the_script_at_import_torch(variables, expected, tmp_path):
    result = run_script("""
        import torch
        print("trained with torch's optimizer")
        """, tmp_path, **{"PAGEDOPTIM": "1", **variables})
    assert result.returncode != 0 and "trained" not in result.stdout
    assert expected in result.stderr, result.stderr


def test_pth_runs_the_hook_only_when_the_flag_is_set():
    lines = PTH.read_text().splitlines()
    # site executes a .pth line only when it starts with "import"; one line, stdlib only.
    assert len(lines) == 1 and lines[0].startswith("import os;")
    assert '"PAGEDOPTIM" in os.environ and' in lines[0]
    assert "torch" not in lines[0]
    startup = (SOURCE / "_pagedoptim_startup.py").read_text()
    imports = {line.split()[1] for line in startup.splitlines()
               if line.startswith(("import ", "from "))}
    assert imports <= {"__future__", "sys", "os"}, imports  # both loaded by site already


def test_every_pagedoptim_variable_in_the_repository_is_a_setting_or_reserved():
    """A variable read by the build, a script or the library must be listed in RESERVED,
    or the flag would reject it as a typo."""
    not_variables = {"PAGEDOPTIM_INCLUDE_"}  # a CMake variable prefix
    known = set(env_settings.SETTING_VARIABLES) | env_settings.RESERVED | not_variables
    this_file = Path(__file__).resolve()
    found = {}
    for top in ("setup.py", "CMakeLists.txt", "README.md", "python", "csrc", "cmake", "scripts",
                "tests", "docs", "benchmarks", "include"):
        for path in [REPO / top] if (REPO / top).is_file() else (REPO / top).rglob("*"):
            if not path.is_file() or path == this_file or path.suffix in (".so", ".pyc"):
                continue
            for name in re.findall(r"PAGEDOPTIM_[A-Z0-9_]+", path.read_text(errors="ignore")):
                found.setdefault(name, path.relative_to(REPO))
    unknown = {name: str(path) for name, path in found.items() if name not in known}
    assert not unknown, f"add these to env_settings.RESERVED (or SETTINGS): {unknown}"


# -- installation: the .pth reaches site-packages from a wheel and an editable install -------

STUB_SETUP = """
# pagedoptim's setup.py, run with its CMake extension left out (it would rebuild the C++).
import runpy
import setuptools

arguments = {{}}
setup = setuptools.setup
setuptools.setup = arguments.update
runpy.run_path({setup_py!r})
setuptools.setup = setup
arguments.pop("ext_modules")
arguments["cmdclass"].pop("build_ext")
setup(**arguments)
"""


def can_build_wheels():
    """setuptools builds wheels itself from 70.1 on, with the wheel package before."""
    return any(importlib.util.find_spec(name) is not None
               for name in ("setuptools.command.bdist_wheel", "wheel"))


@pytest.mark.skipif(not can_build_wheels(), reason="neither setuptools>=70.1 nor wheel")
def test_wheel_and_editable_wheel_put_the_pth_at_site_packages_root(tmp_path):
    project = tmp_path / "project"
    (project / "python" / "pagedoptim").mkdir(parents=True)
    (project / "python" / "pagedoptim" / "__init__.py").write_text("")
    shutil.copy(SOURCE / "_pagedoptim_startup.py", project / "python")
    shutil.copy(REPO / "pyproject.toml", project)
    (project / "setup.py").write_text(STUB_SETUP.format(setup_py=str(REPO / "setup.py")))
    # The names of the wheels go to a file: the build logs to stdout.
    build = ("from setuptools import build_meta\n"
             "names = [build_meta.build_wheel('dist'), build_meta.build_editable('dist')]\n"
             "open('built.txt', 'w').write(' '.join(names))\n")
    result = subprocess.run([sys.executable, "-c", build], cwd=project, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    regular, editable = (project / "built.txt").read_text().split()
    with zipfile.ZipFile(project / "dist" / regular) as wheel:
        assert wheel.read("pagedoptim.pth") == PTH.read_bytes()
        assert "_pagedoptim_startup.py" in wheel.namelist()
    with zipfile.ZipFile(project / "dist" / editable) as wheel:
        # The startup module is found through the editable path to python/.
        assert wheel.read("pagedoptim.pth") == PTH.read_bytes()
