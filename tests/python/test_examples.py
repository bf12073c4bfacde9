"""The single-process examples in examples/ run as a user would run them (python
examples/NAME.py), on tiny configs for a few steps, so that none rots. Each prints one JSON
line last: the losses and the optimizer's memory_report(). (examples/fsdp2.py has its own
test, test_examples_fsdp2.py.)"""

from __future__ import annotations

import json
import math
import os
import pathlib
import site
import subprocess
import sys

import pytest
import torch

import pagedoptim as po
from pagedoptim.integrations import stand_ins
from pagedoptim.paging import env_settings
from support import assert_8bit_moment_bytes, cuda_skip_reason

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
# The pagedoptim this test imported, so the examples run the same one.
SOURCE = pathlib.Path(po.__file__).resolve().parents[1]


def run_example(name: str, *flags: str, cwd: pathlib.Path, **variables: str) -> dict:
    # The test's own PAGEDOPTIM settings must not reach the example (the build's may).
    environ = {key: value for key, value in os.environ.items()
               if not key.startswith(env_settings.FLAG) or key in env_settings.RESERVED}
    # Models this small are all overhead: more threads only contend on a small machine.
    environ.update(variables, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        filter(None, [str(SOURCE), os.environ.get("PYTHONPATH")])))
    if torch.cuda.is_available() and cuda_skip_reason() is not None:
        # A GPU that this pagedoptim cannot step on: the examples run on the CPU instead.
        environ["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *flags], cwd=cwd,
                          env=environ, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["example"] == name
    return result


def assert_trained(losses: list[float], steps: int) -> None:
    assert len(losses) == steps
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0]


def startup_hook_installed() -> bool:
    """Whether this interpreter's site directories hold pagedoptim.pth, which PAGEDOPTIM=1
    needs (pip install -e . puts it there)."""
    directories = site.getsitepackages() + [site.getusersitepackages()]
    return any(pathlib.Path(directory, "pagedoptim.pth").is_file() for directory in directories)


@pytest.mark.parametrize("flag", [None, "1"])
def test_plain_loop_gets_pagedoptim_from_the_flag_alone(tmp_path, flag):
    # A missing hook is the failure this test is for, not a reason to skip it.
    assert not flag or startup_hook_installed(), (
        "pagedoptim.pth is not in site-packages: `pip install -e .` (the README's commands) "
        "installs it, and PAGEDOPTIM=1 does nothing without it")
    variables = {} if flag is None else {"PAGEDOPTIM": flag}
    result = run_example("plain_loop", "--steps", "10", "--hidden", "64", cwd=tmp_path,
                         **variables)
    assert_trained(result["losses"], 10)
    bytes_per_param = result["memory_report"]["state_bytes_per_param"]
    if flag is None:
        assert result["optimizer"] == "torch.optim.adamw.AdamW"
        # fp32 exp_avg and exp_avg_sq, and a 4-byte step tensor per param tensor.
        assert 8.0 < bytes_per_param < 8.01
    else:
        assert issubclass(stand_ins.AdamW, po.AdamW)
        assert result["optimizer"] == f"{stand_ins.AdamW.__module__}.AdamW"
        assert_8bit_moment_bytes(result["memory_report"])
        assert result["memory_report"]["fp32_state_elements"] < result["memory_report"][
            "num_elements"] // 4  # the 64 x 64 weights are 8-bit, the biases fp32


def test_hf_trainer_pages_8bit_state_chosen_by_name(tmp_path):
    result = run_example("hf_trainer", "--steps", "6", "--hidden-size", "32", "--seq-len", "32",
                         "--batch-size", "4", "--optim-args",
                         "offload=host,page_bytes=4KiB,cache_bytes=32KiB", cwd=tmp_path)
    assert_trained(result["losses"], 6)
    assert result["optimizer"] == f"{po.AdamW.__module__}.AdamW"
    report, paging = result["memory_report"], result["paging_stats"]
    assert_8bit_moment_bytes(report)
    # The whole model is trained, and its state does not fit the cache: pages move.
    assert report["num_elements"] == result["model_params"]
    assert report["page_bytes"] == 4096 and report["state_bytes"] > 32 << 10
    assert paging["offload"] == "host" and paging["misses"] > 0


def test_peft_lora_keeps_adapter_state_alone_in_an_nvme_page_file(tmp_path):
    pages = tmp_path / "pages"
    pages.mkdir()
    result = run_example("peft_lora", "--steps", "6", "--hidden-size", "32", "--seq-len", "32",
                         "--batch-size", "4", "--offload", "nvme", "--nvme-dir", str(pages),
                         "--cache-bytes", "16384", cwd=tmp_path)
    assert_trained(result["losses"], 6)
    report, paging = result["memory_report"], result["paging_stats"]
    assert report["num_elements"] == result["trainable_params"] < result["total_params"] // 4
    assert_8bit_moment_bytes(report)
    assert paging["offload"] == "nvme" and report["state_placement"]["nvme"] > 0
    assert paging["misses"] > 0 and paging["bytes_written"]["nvme"] > 0


def test_moe_skewadam_keeps_least_state_for_the_experts(tmp_path):
    result = run_example("moe_skewadam", "--steps", "6", "--hidden-size", "32", "--seq-len", "32",
                         "--batch-size", "4", cwd=tmp_path)
    assert_trained(result["losses"], 6)
    report = result["memory_report"]
    params = report["params"]
    tiers = {tier: sorted(name for name, entry in params.items() if entry["tier"] == tier)
             for tier in ("experts", "router")}
    # The tiers come from Mixtral's names: its fused expert tensors and its gates.
    assert tiers["router"] == [f"model.layers.{i}.mlp.gate.weight" for i in (0, 1)]
    assert tiers["experts"] == [f"model.layers.{i}.mlp.experts.{name}" for i in (0, 1)
                                for name in ("down_proj", "gate_up_proj")]
    for name in tiers["experts"]:
        # No momentum: fp32 row and column means of each expert's matrix, and the step.
        experts, rows, cols = params[name]["shape"]
        assert not params[name]["momentum"]
        assert params[name]["state_bytes"] == 4 * experts * (rows + cols) + 4
    # The experts hold most of the params; AdamW's 8-bit state would be 2.125 B per param.
    assert report["tiers"]["experts"]["num_elements"] > report["num_elements"] // 2
    assert report["state_bytes_per_param"] < 1.0


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_help_says_what_the_example_does_in_whole_sentences(example):
    """`python examples/X.py --help` opens with the docstring's first paragraph, whole."""
    result = subprocess.run([sys.executable, str(EXAMPLES / example), "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    description = result.stdout.split("\n\n")[1]
    assert description.rstrip().endswith("."), description
