"""Smoke tests of the command-line demo and the step-throughput benchmark.

Both run as subprocesses, the way users run them. They check that the programs finish and that
their output has the promised shape; they never check timings, which depend on the machine.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import pathlib
import re
import subprocess
import sys

import pytest

from pagedoptim.cli import demo, progress

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

TINY_DEMO_ARGS = [
    "--steps", "5", "--batch", "2", "--seq-len", "16", "--d-model", "32", "--layers", "1",
    "--heads", "2", "--corpus-bytes", "4096", "--seed", "3",
]  # fmt: skip

# The demo's runs, in the order of its tables' columns and rows (the library default state_bits=8).
DEMO_RUNS = ["torch.optim.AdamW", "pagedoptim.AdamW 8-bit", "pagedoptim.AdamW 8-bit nvme"]

THROUGHPUT_KEYS = {
    "size",
    "optimizer",
    "params_per_s",
    "ratio_vs_torch_fused",
    "ratio_vs_foreach",
    "achieved_gbps",
    "roofline_gbps",
    "roofline_fraction",
}
BANDWIDTH_KEYS = {"copy_gbps", "inplace_add_gbps", "buffer_bytes"}


def run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT
    )


def test_cli_without_command_prints_usage():
    result = run(["-m", "pagedoptim"], timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout and "demo" in result.stdout


def table(stdout: str, title: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the demo's table under the line `title`: cells split on '|'."""
    lines = stdout.splitlines()
    assert title in lines, f"no table '{title}' in:\n{stdout}"
    header, rule, *rest = lines[lines.index(title) + 1:]
    assert set(rule) <= {"-", "+"}, rule
    rows = []
    for line in rest:
        if " | " not in line:
            break
        rows.append([cell.strip() for cell in line.split("|")])
    return [cell.strip() for cell in header.split("|")], rows


def number(cell: str) -> float:
    value = float(cell.replace(",", ""))
    assert math.isfinite(value), cell
    return value


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], pathlib.Path]:
    """One tiny demo run, its output piped (so not a terminal), shared by the tests below."""
    png = tmp_path_factory.mktemp("demo") / "demo.png"
    result = run(["-m", "pagedoptim", "demo", *TINY_DEMO_ARGS, "--png", str(png)], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result, png


def test_demo_loss_table_has_every_run_and_paging_changes_no_loss(tiny_demo):
    result, _ = tiny_demo
    header, rows = table(result.stdout, "training loss at step (each step's own batch)")
    assert header == ["step", *DEMO_RUNS], header
    assert [int(row[0]) for row in rows][0] == 1 and int(rows[-1][0]) == 5, rows
    for row in rows:
        torch_loss, unpaged_loss, paged_loss = (number(cell) for cell in row[1:])
        assert 0 < torch_loss < 10 and 0 < unpaged_loss < 10
        assert paged_loss == unpaged_loss, row  # paging never changes results
    # The demo compares the losses bit for bit (and exits 1 when they differ); it says so.
    assert "losses are identical at all 5 steps and held out" in result.stdout, result.stdout
    # Its cache is too small for the state: pages left and came back.
    traffic = re.search(r"^paging: .* ([\d.]+) MiB read from and ([\d.]+) MiB written to the page file",
                        result.stdout, re.MULTILINE)
    assert traffic and float(traffic[1]) > 0 and float(traffic[2]) > 0, result.stdout


def test_demo_summary_has_a_row_of_finite_numbers_per_optimizer(tiny_demo):
    result, _ = tiny_demo
    header, rows = table(result.stdout, "summary")
    assert header == ["optimizer", "train loss (last 10%)", "held-out loss", "state bytes",
                      "bytes/param", "wall time (s)", "step time (ms)"], header
    assert [row[0] for row in rows] == DEMO_RUNS, rows
    summary = {row[0]: [number(cell) for cell in row[1:]] for row in rows}
    for name, values in summary.items():
        assert all(value > 0 for value in values), (name, values)
    torch_row, unpaged_row, paged_row = (summary[name] for name in DEMO_RUNS)
    assert torch_row[3] == 8.0, torch_row  # fp32 exp_avg and exp_avg_sq: 8 bytes per param
    assert unpaged_row[2] < torch_row[2] / 2, (unpaged_row, torch_row)
    assert paged_row[:2] == unpaged_row[:2], (paged_row, unpaged_row)  # train and held-out loss

    # The bytes by kind add up to the state bytes of the summary.
    kind_header, kind_rows = table(result.stdout, "optimizer-state bytes by kind")
    assert kind_header == ["kind", *DEMO_RUNS]
    *kinds, total = kind_rows
    assert total[0] == "total" and {row[0] for row in kinds} >= {"moments", "group scales", "page slack"}
    for column, name in enumerate(DEMO_RUNS, start=1):
        assert sum(number(row[column]) for row in kinds) == number(total[column]) == summary[name][2]


def test_demo_writes_its_png_and_prints_the_path(tiny_demo):
    result, png = tiny_demo
    assert f"figure: {png}" in result.stdout.splitlines(), result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_progress_does_not_flood_a_log(tiny_demo):
    result, _ = tiny_demo
    # Not a terminal: a line at each quarter of each run, no carriage-return redraws.
    assert "\r" not in result.stderr
    lines = result.stderr.splitlines()
    assert 0 < len(lines) < 20, result.stderr
    for name in DEMO_RUNS:
        assert sum(line.startswith(f"{name}: ") for line in lines) <= len(progress.LOG_MILESTONES)


def test_progress_writes_one_line_per_milestone_to_a_log_and_a_bar_to_a_terminal():
    log = io.StringIO()
    bar = progress.progress_bar(300, "run", stream=log)
    for _ in range(300):
        bar.update(1)
    bar.close()
    assert [line.split(" after ")[0] for line in log.getvalue().splitlines()] == [
        "run: 75/300 (25%)", "run: 150/300 (50%)", "run: 225/300 (75%)", "run: 300/300 (100%)"]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    bar = progress.progress_bar(300, "run", stream=terminal)
    for _ in range(300):
        bar.update(1)
    bar.close()
    assert "\r" in terminal.getvalue() and "300/300" in terminal.getvalue()


def test_demo_without_matplotlib_says_so_and_draws_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--png", str(tmp_path / "demo.png")])
    run_result = demo.RunResult(losses=[2.0], held_out_loss=2.0, num_params=1,
                                state_by_kind={"moments": 8}, wall_seconds=1.0, step_seconds=0.1)
    demo.save_figure(args, {"a": run_result}, {})
    assert "not drawn, matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "demo.png").exists()


def test_step_throughput_quick_prints_one_json_object_per_line():
    result = run([str(REPO_ROOT / "benchmarks" / "step_throughput.py"), "--quick"], timeout=600)
    assert result.returncode == 0, result.stderr

    records = [json.loads(line) for line in result.stdout.splitlines()]
    bandwidth = [r for r in records if r.get("benchmark") == "memory_bandwidth"]
    throughput = [r for r in records if r.get("benchmark") == "adamw_step_throughput"]
    assert len(bandwidth) == 1 and BANDWIDTH_KEYS <= bandwidth[0].keys(), bandwidth
    assert len(bandwidth) + len(throughput) == len(records), "lines of an unknown benchmark"

    assert throughput, result.stdout
    for record in throughput:
        assert THROUGHPUT_KEYS <= record.keys(), record
        assert record["params_per_s"] > 0 and record["roofline_fraction"] > 0, record
    assert {r["optimizer"] for r in throughput} == {"pagedoptim", "torch_fused", "torch_foreach"}
    assert {r["size"] for r in throughput} >= {"1M"}


def test_gpu_paging_harness_runs_on_the_cpu():
    """benchmarks/gpu_paging.py first runs for real on a lent GPU; its harness (model from a
    config, activation checkpointing, gradient release, paged against resident state, the
    memory plan) is checked here so that the GPU run does not fail on a typo."""
    result = run([str(REPO_ROOT / "benchmarks" / "gpu_paging.py"), "--quick", "--device", "cpu",
                  "--parts", "train,headline"], timeout=600)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    train = [r for r in records if r.get("part") == "train"]
    assert [r["paged"] for r in train] == [False, True], records
    # Paging never changes results: the same seeds give the same loss, paged or not.
    assert train[0]["loss"] == train[1]["loss"], train
    assert all(r["tokens_per_s"] > 0 for r in train)
    headline = next(r for r in records if r.get("part") == "headline")
    plan = headline["memory_plan"]
    assert plan["torch_adamw_gib"] > plan["pagedoptim_8bit_resident_gib"] > \
        plan["pagedoptim_8bit_resident_release_gib"] > 0
    assert records[-1]["bench"] == "gpu_paging_targets"


def test_gpu_step_harness_runs_on_the_cpu():
    """benchmarks/gpu_step.py's workloads, timing loop and targets, run on the CPU (host clock):
    what its first GPU run executes, but for CUDA events and the memory workload."""
    result = run([str(REPO_ROOT / "benchmarks" / "gpu_step.py"), "--quick", "--device", "cpu",
                  "--params", "1M", "--lora-groups", "1", "--copy-mib", "16", "--repeats", "2",
                  "--block", "2"], timeout=600)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert all(r.get("device", "cpu") == "cpu" for r in records[1:]), records
    steps = [r for r in records if r.get("benchmark") == "gpu_step_throughput"]
    assert {(r["workload"], r["optimizer"]) for r in steps} == {
        ("1M", "torch_fused_fp32"), ("1M", "torch_fused_bf16"), ("1M", "pagedoptim_8bit_bf16"),
        ("1M", "pagedoptim_8bit_bf16_scalar"), ("1M", "pagedoptim_fp32"),
        ("lora4", "torch_fused_fp32"), ("lora4", "pagedoptim_8bit")}
    assert all(r["params_per_s"] > 0 and r["copy_gbps"] > 0 for r in steps)
    assert next(r for r in records if r.get("benchmark") == "gpu_memory")["not_measured"]
    targets = records[-1]
    assert targets["benchmark"] == "gpu_targets" and len(targets["targets"]) == 3


def test_compressed_throughput_reports_both_param_dtypes_and_the_targets():
    result = run([str(REPO_ROOT / "benchmarks" / "compressed_throughput.py"), "--quick",
                  "--no-lora"], timeout=600)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    steps = [r for r in records if r["benchmark"] == "compressed_adamw_step"]
    assert {(r["workload"], r["optimizer"]) for r in steps} == {
        (w, o) for w in ("1M", "bf16_1M") for o in ("ours_8bit", "ours_fp32", "torch_fused")}
    assert {r["param_dtype"] for r in steps if r["workload"] == "bf16_1M" and
            r["optimizer"] != "torch_fused"} == {"bfloat16"}
    assert all(r["params_per_s"] > 0 for r in steps)
    targets = records[-1]
    assert targets["benchmark"] == "compressed_targets"
    assert targets["isa"] in ("avx512", "avx2", "baseline")
    assert targets["targets"] == {}  # the targets are judged on the 64M workloads only


def test_paging_overlap_mode_compares_the_step_with_kernel_and_disk(tmp_path):
    result = run([str(REPO_ROOT / "benchmarks" / "paging.py"), "--overlap", "--dir",
                  str(tmp_path), "--overlap-params", "4e6", "--page-bytes", "65536",
                  "--probe-mib", "8", "--repeats", "1", "--overlap-prefetch", "4,16",
                  "--overlap-rounds", "2"], timeout=600)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    # A probe before the rounds and after each; per depth a step record and its targets;
    # then each depth against the first, round by round.
    assert [r["bench"] for r in records] == ["disk_bandwidth"] * 3 + [
        "paging_overlap", "paging_overlap_targets"] * 2 + ["paging_overlap_prefetch"]
    steps = [r for r in records if r["bench"] == "paging_overlap"]
    assert [s["prefetch"] for s in steps] == [4, 16]
    probes = [r["mixed_gb_per_s"] for r in records if r["bench"] == "disk_bandwidth"]
    for step in steps:
        assert step["rounds"] == 2
        assert step["cache_bytes"] <= step["state_bytes"] // 8
        # With a cache of an eighth of the state, a step reads and writes most of it.
        assert step["bytes_moved_per_step"] > step["state_bytes"]
        assert step["kernel_only_step_s"] > 0 and step["paged_step_s"] > 0
        low, high = step["paged_step_s_range"]
        assert low <= step["paged_step_s"] <= high
        assert step["mixed_gb_per_s_best"] == pytest.approx(max(probes), rel=1e-3)
        assert min(probes) <= step["mixed_gb_per_s_median"] <= max(probes)
    targets = [r for r in records if r["bench"] == "paging_overlap_targets"]
    assert [t["prefetch"] for t in targets] == [4, 16]
    for t in targets:
        assert set(t["targets"]) == {"disk_rate_over_mixed_bandwidth", "step_over_max_kernel_io"}
    paired = records[-1]
    assert (paired["prefetch"], paired["baseline_prefetch"], paired["rounds"]) == (16, 4, 2)
    assert 0 <= paired["rounds_faster"] <= 2 and paired["step_time_ratio_median"] > 0
    assert list(tmp_path.iterdir()) == []  # the page file and the probe's file are gone


def test_skewadam_state_benchmark_times_every_optimizer_in_the_same_rounds():
    result = run([str(REPO_ROOT / "benchmarks" / "skewadam.py"), "--quick", "--only", "state"],
                 timeout=600)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    optimizers = {"torch_adamw", "torch_adamw_fused", "pagedoptim_adamw_8bit", "skewadam"}
    state = {r["optimizer"]: r for r in records if r["bench"] == "state_bytes"}
    assert state.keys() == optimizers - {"torch_adamw_fused"}
    # SkewAdam's factors take a small fraction of AdamW's two fp32 moments.
    assert state["skewadam"]["ratio_to_torch_adamw"] < 0.1 < state["pagedoptim_adamw_8bit"][
        "ratio_to_torch_adamw"] < 1.0 == state["torch_adamw"]["ratio_to_torch_adamw"]
    steps = {r["optimizer"]: r for r in records if r["bench"] == "step_time"}
    assert steps.keys() == optimizers | {"torch_ops_factor_statistics_only"}
    rounds = {r["rounds"] for r in steps.values()}
    assert len(rounds) == 1, "every optimizer is timed over the same rounds"
    for name in optimizers:
        record = steps[name]
        assert 0 < record["min_seconds"] <= record["seconds"], record
        assert math.isclose(record["speed_vs_torch_adamw_fused"] *
                            record["ratio_to_torch_adamw_fused"], 1.0), record
    target = records[-1]
    assert target["bench"] == "skewadam_target"
    assert target["met"] == (steps["skewadam"]["seconds"] <= steps["torch_adamw_fused"]["seconds"])


def test_import_time_benchmark_compares_with_import_torch():
    result = run([str(REPO_ROOT / "benchmarks" / "import_time.py"), "--repeats", "1"],
                 timeout=300)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.splitlines()[-1])
    assert record["benchmark"] == "import_time"
    assert record["import_torch_and_pagedoptim_s"] > 0 and record["import_torch_s"] > 0
    assert record["ratio"] == pytest.approx(record["import_torch_and_pagedoptim_s"]
                                            / record["import_torch_s"], rel=1e-2)
