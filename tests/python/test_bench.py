"""`python -m pagedoptim bench`, run as a subprocess the way users run it: the record it
writes is one plan can read, the table and the progress are there, and bad input is refused
with a message naming the flag or the directory, before anything is written. Timings and
the figures themselves depend on the machine and are never checked, only that they exist.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from pagedoptim.cli import machine_profile, step_modes
from pagedoptim.__main__ import main

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
LINKS_ALWAYS_MEASURED = ("memory", "disk_read", "disk_write", "disk_mixed")
GPU_LINKS = ("host_to_device", "device_to_host", "device_memory")
# Phases: memory, disk, pcie (or the line saying why not), steps.
PHASES = 4


def bench(*args: str, tmp_path: pathlib.Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # plan's default file is pointed into tmp_path, so a test can never touch the user's.
    env = {**os.environ, machine_profile.BENCH_FILE_ENV: str(tmp_path / "default-bench.json")}
    return subprocess.run([sys.executable, "-m", "pagedoptim", "bench", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env=env)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bench")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    output = tmp_path / "bench.json"
    result = bench("--quick", "--dir", str(scratch), "--output", str(output), tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    return result, output, scratch


def test_record_is_a_profile_plan_reads_with_every_link_it_measured(quick_run):
    _, output, _ = quick_run
    profile = machine_profile.load_profile(output)
    for name in LINKS_ALWAYS_MEASURED:
        assert profile.link(name).measured, (name, profile.link(name))
        assert profile.link(name).bytes_per_s > 0
    for name in GPU_LINKS:
        assert profile.link(name).measured == torch.cuda.is_available(), (name, profile.link(name))


def test_every_step_mode_has_a_positive_throughput_and_a_ratio_to_torch(quick_run):
    _, output, _ = quick_run
    profile = machine_profile.load_profile(output)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert set(profile.step_params_per_s) == {(mode, device) for mode in step_modes.MODES}
    assert all(rate > 0 for rate in profile.step_params_per_s.values())
    record = json.loads(output.read_text())
    ratios = {entry["mode"]: entry["ratio_to_torch"] for entry in record["steps"]}
    assert ratios["torch_adamw"] == 1.0
    assert all(ratio > 0 for ratio in ratios.values())


def test_mixed_disk_bandwidth_is_measured_through_our_engine(quick_run):
    _, output, scratch = quick_run
    disk = json.loads(output.read_text())["disk"]
    assert disk["mixed_bytes_per_s"] > 0
    assert disk["dir"] == str(scratch)
    assert disk["backend"] in ("io_uring", "posix")
    assert list(scratch.iterdir()) == [], "the test file and the page file must be gone"


def test_table_has_a_row_per_link_and_per_mode(quick_run):
    result, _, _ = quick_run
    rows = {line.split("  ")[0].strip() for line in result.stdout.splitlines()}
    for label in ("host memory", "disk write", "disk read", "disk mixed (read + write)"):
        assert label in rows, result.stdout
    mode_rows = [line.split()[0] for line in result.stdout.splitlines()
                 if line.split() and line.split()[0] in step_modes.MODES]
    assert mode_rows == list(step_modes.MODES), result.stdout


def test_progress_off_a_terminal_is_one_line_per_phase(quick_run):
    result, output, _ = quick_run
    lines = result.stderr.splitlines()
    progress = [line for line in lines if re.match(r"\[\d+/\d+\] ", line)]
    assert len(progress) == PHASES, result.stderr
    # Besides: one line per warning the paged mode gave (POSIX or buffered I/O), and the
    # line saying where the results went.
    notes = json.loads(output.read_text())["bench"]["warnings"]
    assert len(lines) <= PHASES + len(notes) + 1, result.stderr
    assert "\r" not in result.stderr, "a bar was drawn into a pipe"
    assert any("step throughput" in line for line in lines), result.stderr


def test_json_flag_prints_the_record_and_png_draws_it(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    output, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = bench("--quick", "--json", "--png", str(png), "--dir", str(scratch),
                   "--output", str(output), tmp_path=tmp_path)
    if importlib.util.find_spec("matplotlib") is None:
        assert result.returncode == 1 and "matplotlib" in result.stderr, result.stderr
        assert not output.exists(), "nothing is measured or written when the PNG cannot be drawn"
        return
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed == json.loads(output.read_text())
    assert machine_profile.parse_profile(printed).step_params_per_s
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# Bad input is refused before anything runs, so these call the command line in-process
# (the same main() as `python -m pagedoptim`) rather than paying a subprocess each.
def bench_in_process(*args: str, tmp_path: pathlib.Path, monkeypatch) -> int:
    monkeypatch.setenv(machine_profile.BENCH_FILE_ENV, str(tmp_path / "default-bench.json"))
    try:
        return main(["bench", *args])
    except SystemExit as exit_:  # argparse refuses a flag by exiting, as it does for users
        return exit_.code


@pytest.mark.parametrize("flag, value", [
    ("--params", "0"), ("--params", "-3"), ("--params", "many"),
    ("--disk-bytes", "0"), ("--disk-bytes", "-1"), ("--disk-bytes", "1MiB"),
    ("--disk-bytes", "lots"), ("--repeats", "0"),
])
def test_nonsense_sizes_are_refused_naming_the_flag(tmp_path, monkeypatch, capsys, flag, value):
    code = bench_in_process("--quick", "--dir", str(tmp_path), f"{flag}={value}",
                            tmp_path=tmp_path, monkeypatch=monkeypatch)
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert flag in stderr and value in stderr, stderr
    assert list(tmp_path.iterdir()) == []


def refused_before_writing(code: int, capsys, tmp_path: pathlib.Path, *expected: str) -> None:
    captured = capsys.readouterr()
    assert code == 1, (code, captured.out, captured.err)
    for text in expected:
        assert text in captured.err, captured.err
    assert captured.out == "", "no table when nothing was measured"
    assert not (tmp_path / "out.json").exists()
    assert not (tmp_path / "default-bench.json").exists()


def test_missing_dir_is_refused(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "no-such-dir"
    code = bench_in_process("--quick", "--dir", str(missing), "--output", str(tmp_path / "out.json"),
                            tmp_path=tmp_path, monkeypatch=monkeypatch)
    refused_before_writing(code, capsys, tmp_path, str(missing), "does not exist")


def test_dir_below_a_regular_file_is_refused(tmp_path, monkeypatch, capsys):
    regular = tmp_path / "a-file"
    regular.write_text("")
    for directory in (regular / "sub", regular):
        code = bench_in_process("--quick", "--dir", str(directory), "--output",
                                str(tmp_path / "out.json"), tmp_path=tmp_path,
                                monkeypatch=monkeypatch)
        refused_before_writing(code, capsys, tmp_path, str(directory), "not a directory")


def test_read_only_dir_is_refused(tmp_path, monkeypatch, capsys):
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        probe = read_only / "probe"
        try:
            probe.write_text("")
        except PermissionError:
            pass
        else:
            # Root writes into a mode-0500 directory, and os.access says so: the kernel's
            # answer for an unprivileged user is stood in for, for this directory only.
            probe.unlink()
            real_access = os.access

            def access_as_an_unprivileged_user(path, mode, *args, **kwargs):
                if os.fspath(path) == str(read_only) and mode & os.W_OK:
                    return False
                return real_access(path, mode, *args, **kwargs)
            monkeypatch.setattr(os, "access", access_as_an_unprivileged_user)
        code = bench_in_process("--quick", "--dir", str(read_only), "--output",
                                str(tmp_path / "out.json"), tmp_path=tmp_path,
                                monkeypatch=monkeypatch)
        refused_before_writing(code, capsys, tmp_path, str(read_only), "not writable")
    finally:
        read_only.chmod(0o700)


def test_too_little_free_space_is_refused_with_the_bytes_missing(tmp_path, monkeypatch, capsys):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    wanted = 1 << 60
    file_system = os.statvfs(scratch)
    assert file_system.f_bavail * file_system.f_frsize < wanted
    code = bench_in_process("--quick", "--dir", str(scratch), "--disk-bytes", str(wanted),
                            "--output", str(tmp_path / "out.json"), tmp_path=tmp_path,
                            monkeypatch=monkeypatch)
    refused_before_writing(code, capsys, tmp_path, str(scratch), "missing", "--disk-bytes",
                           f"{wanted:,} bytes")
    assert list(scratch.iterdir()) == []


def test_unwritable_output_is_refused_before_measuring(tmp_path, monkeypatch, capsys):
    regular = tmp_path / "a-file"
    regular.write_text("")
    code = bench_in_process("--quick", "--dir", str(tmp_path), "--output",
                            str(regular / "out.json"), tmp_path=tmp_path, monkeypatch=monkeypatch)
    captured = capsys.readouterr()
    assert code == 1 and "--output" in captured.err and str(regular) in captured.err, captured.err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
def test_png_into_a_directory_is_refused_before_measuring(tmp_path, monkeypatch, capsys):
    code = bench_in_process("--quick", "--dir", str(tmp_path), "--png", str(tmp_path),
                            "--output", str(tmp_path / "out.json"), tmp_path=tmp_path,
                            monkeypatch=monkeypatch)
    refused_before_writing(code, capsys, tmp_path, "--png", "is a directory")
