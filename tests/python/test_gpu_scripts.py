"""The scripts a lent GPU machine runs (scripts/gpu_check.sh and what it calls), run here first.

A GPU is lent for one call of about 8 minutes: a script that fails on a typo there wastes the
lease. Each script has a mode that needs no GPU (the simulated device, the CPU harness, or
stand-ins for nvidia-smi, nvcc and compute-sanitizer), and these tests run it.
(benchmarks/gpu_step.py's and gpu_paging.py's CPU harness runs are in test_demo_and_bench.py;
the GPU test modules themselves run on the simulated device as part of the suite.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_script(args: list[str], timeout: int = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT, **kw)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_sanitizer_cases_pass_on_the_simulated_device():
    """Every case compares the device's params with a CPU run bit for bit: run on the simulated
    device, the cases themselves (SkewAdam's and the offload path's included) are checked."""
    result = run_script(["scripts/gpu_sanitize_cases.py", "--quick", "--simulated"])
    assert result.returncode == 0, result.stdout + result.stderr
    records = json_lines(result.stdout)
    summary = records[-1]
    assert summary["failed"] == [] and summary["cases"] == len(records) - 1
    names = {r["case"] for r in records[:-1]}
    assert all(r["ok"] for r in records[:-1])
    assert {"offload-host", "offload-nvme", "state-dict", "amp-adamw", "release-lion"} <= names
    assert any(name.startswith("skewadam-") for name in names)
    listed = run_script(["scripts/gpu_sanitize_cases.py", "--quick", "--list"])
    assert listed.stdout.split() == [r["case"] for r in records[:-1]]


def test_leak_check_runs_on_the_simulated_device():
    result = run_script(["scripts/gpu_leak_check.py", "--simulated", "--cycles", "3"])
    assert result.returncode == 0, result.stdout + result.stderr
    records = json_lines(result.stdout)
    assert [r["config"] for r in records] == ["device", "offload_host", "offload_nvme"]
    for record in records:
        assert record["ok"] and record["device"] == "simulated", record
        assert set(record["device_delta"]) >= {"device_bytes", "pinned_host_bytes", "streams",
                                               "events"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_leak_check_without_a_gpu_says_so():
    result = run_script(["scripts/gpu_leak_check.py"])
    assert result.returncode == 3
    assert json_lines(result.stdout) == [{"check": "gpu_leaks", "skipped": "no CUDA device"}]


# -- scripts/gpu_check.sh's dry run ------------------------------------------------------------

GPU_CHECK = REPO_ROOT / "scripts" / "gpu_check.sh"
STANDINS = REPO_ROOT / "scripts" / "gpu_standins"
DEFAULT_PARTS = ["versions", "build", "sanitize", "tests", "bench", "paging", "fsdp2", "leaks",
                 "synccheck"]


def prebuilt_module(folder: Path) -> Path:
    """A folder holding this checkout's built module, as a results folder's prebuilt/ holds the
    GPU build's."""
    import pagedoptim._C as C
    folder.mkdir()
    shutil.copy(C.__file__, folder)
    return folder


def dry_run_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDACXX", "OUT")}
    env["PATH"] = f"{STANDINS}{os.pathsep}{env['PATH']}"
    env.update(extra)
    return env


def start_gpu_check(args: list[str], env: dict) -> subprocess.Popen:
    # A session of its own: gpu_check.sh signals only its own parts, and the test its own run.
    return subprocess.Popen(["bash", str(GPU_CHECK), *args], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def statuses(summary: dict) -> dict[str, str]:
    return {part["part"]: part["status"] for part in summary["parts"]}


def test_gpu_check_dry_run_walks_every_part_within_its_budget(tmp_path):
    """The lent machine's run, walked here: stand-ins for nvidia-smi, nvcc and
    compute-sanitizer, the module prebuilt, the tests on the simulated device. The tests part
    is given 20 s, so its limit stops it with SIGINT: its junit must still hold the tests that
    ran, and the run goes on to every later part."""
    results = tmp_path / "results"
    args = [str(results), "--dry-run", "--prebuilt", str(prebuilt_module(tmp_path / "pb")),
            "--budget", "480"]
    run = start_gpu_check(args, dry_run_env(PAGEDOPTIM_GPU_CHECK_LIMITS="tests=20"))
    output, _ = run.communicate(timeout=600)
    summary = json.loads((results / "summary.json").read_text())
    assert summary["dry_run"] and summary["elapsed_s"] <= 480, output
    status = statuses(summary)
    assert list(status) == DEFAULT_PARTS, output
    assert status.pop("tests") == "TIMEOUT", output
    assert all(s == "PASS" for s in status.values()), (status, output)
    assert run.returncode == 1 and summary["exit_status"] == 1  # the tests timed out
    # Stopped with SIGINT, pytest still wrote the tests that ran, run on the simulated device.
    assert summary["tests"]["target"] == "simulated"
    assert 0 < summary["tests"]["tests"] == summary["tests"]["gpu_tests"]
    junit = (results / "tests-junit.xml").read_text()
    assert junit.count('classname="tests.python.test_cuda_step"') == summary["tests"]["tests"]
    assert summary["versions"]["dry_run"] and summary["bench_targets"]["device"] == "cpu"
    assert [r["backend"] for r in summary["fsdp2"]] == ["gloo", "gloo"]
    assert [p.name for p in (results / "prebuilt").iterdir()] == \
        [p.name for p in (tmp_path / "pb").iterdir()]
    log = (results / "gpu_check.log").read_text()
    assert "DRY RUN" in log and "ERROR SUMMARY: 0 errors (stand-in" in log


def test_gpu_check_interrupted_writes_its_summary(tmp_path):
    """A lease that ends (SIGTERM) while a part runs: the part is stopped as at its limit, and
    summary.json says where the run was."""
    results = tmp_path / "results"
    args = [str(results), "--dry-run", "--prebuilt", str(prebuilt_module(tmp_path / "pb")),
            "--only", "versions,build,tests"]
    run = start_gpu_check(args, dry_run_env())
    log = results / "gpu_check.log"
    deadline = time.monotonic() + 300
    while "PASSED" not in (log.read_text() if log.exists() else ""):
        assert run.poll() is None and time.monotonic() < deadline, run.stdout.read()
        time.sleep(0.5)
    run.send_signal(signal.SIGTERM)
    output, _ = run.communicate(timeout=120)
    assert run.returncode == 130, output
    summary = json.loads((results / "summary.json").read_text())
    assert statuses(summary) == {"versions": "PASS", "build": "PASS", "tests": "INTERRUPTED"}
    assert summary["exit_status"] == 130
    assert "<testcase " in (results / "tests-junit.xml").read_text()


def test_gpu_check_keeps_each_part_its_least_time_and_skips_sanitizers_on_gvisor(tmp_path):
    """A budget of 40 s for versions, leaks (least 15 s) and synccheck: the versions part gets
    what leaks leaves it, leaks runs, synccheck (only if time is left) is skipped for lack of
    it; on a gVisor machine a sanitizer part is reported at once and not held against the run."""
    results = tmp_path / "results"
    run = start_gpu_check([str(results), "--dry-run", "--budget", "40",
                           "--only", "versions,leaks,synccheck"],
                          dry_run_env(PAGEDOPTIM_GPU_CHECK_GVISOR="1"))
    output, _ = run.communicate(timeout=300)
    summary = json.loads((results / "summary.json").read_text())
    status = statuses(summary)
    assert status["versions"] == "PASS" and status["leaks"] == "PASS", output
    assert status["synccheck"] in ("NO_TIME", "UNAVAILABLE"), output
    assert summary["elapsed_s"] <= 40 and run.returncode == 0, output
    gvisor = start_gpu_check([str(tmp_path / "gvisor"), "--dry-run", "--only", "sanitize"],
                             dry_run_env(PAGEDOPTIM_GPU_CHECK_GVISOR="1"))
    output, _ = gvisor.communicate(timeout=120)
    summary = json.loads((tmp_path / "gvisor" / "summary.json").read_text())
    assert statuses(summary) == {"sanitize": "UNAVAILABLE"}, output
    assert "refuses gVisor" in output and gvisor.returncode == 0
