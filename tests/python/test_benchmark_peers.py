"""benchmarks/peers.py --quick, run as a subprocess the way docs/comparison.md runs it.

Checks the shape of what the comparison page is built from, with or without the peers
installed: one JSON object per line, every candidate accounted for (measured, or skipped with
a reason), positive throughputs and ratios, memory figures that add up. No timing assertions:
the numbers themselves belong to the benchmark.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from peer_optimizers import BASELINE, CANDIDATES, availability  # noqa: E402

COMMON_KEYS = {"benchmark", "optimizer", "device", "load_average_1m"}
KEYS = {
    "peers_skipped": COMMON_KEYS | {"part", "workload", "reason"},
    "peers_machine": {"benchmark", "device", "cpu", "cpus", "avx2", "avx512f", "memory_gib",
                      "torch", "versions", "load_average"},
    "peers_throughput": COMMON_KEYS | {"workload", "dtype", "params", "repeats", "step_s_median",
                                       "params_per_s", "ratio_vs_torch_fused"},
    "peers_memory": COMMON_KEYS | {"workload", "params", "state_storage_bytes_per_param",
                                   "rss_growth_bytes_per_param",
                                   "transient_peak_bytes_per_param"},
    "peers_quality": COMMON_KEYS | {"workload", "seed", "steps", "final_loss", "held_out_loss",
                                    "final_ratio_vs_torch_fused",
                                    "held_out_ratio_vs_torch_fused"},
    "peers_quality_summary": COMMON_KEYS | {"workload", "seeds", "final_ratio_mean",
                                            "held_out_ratio_mean"},
}


@pytest.fixture(scope="module")
def records() -> list[dict]:
    result = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "peers.py"), "--quick"],
                            capture_output=True, text=True, timeout=1500, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_every_line_is_a_known_record_with_its_fields(records):
    for record in records:
        assert record["benchmark"] in KEYS, record
        assert KEYS[record["benchmark"]] <= record.keys(), record
    assert [r["benchmark"] for r in records].count("peers_machine") == 1


def test_every_candidate_is_measured_or_skipped_with_a_reason(records):
    measured = {r["optimizer"] for r in records if r["benchmark"] == "peers_throughput"}
    judged = {r["optimizer"] for r in records if r["benchmark"] == "peers_quality"}
    skipped = {r["optimizer"]: r for r in records if r["benchmark"] == "peers_skipped"}
    for candidate in CANDIDATES:
        if candidate.name in skipped:
            assert skipped[candidate.name]["reason"].strip(), skipped[candidate.name]
        else:
            assert candidate.name in measured and candidate.name in judged, candidate.name
    # What the probe says cannot run here is skipped, never measured; what it says can run is
    # measured unless its own line says why not.
    for candidate in CANDIDATES:
        reason = availability(candidate, "cpu")
        if reason is not None:
            assert candidate.name not in measured
            assert skipped[candidate.name]["part"] == "all"
    assert {BASELINE, "ours_exact", "ours_8bit", "torch_foreach"} <= measured


def test_each_workload_has_every_measured_candidate_once(records):
    throughput = [r for r in records if r["benchmark"] == "peers_throughput"]
    memory = [r for r in records if r["benchmark"] == "peers_memory"]
    workloads = {r["workload"] for r in throughput}
    assert workloads == {"fp32_1M", "lora16", "bf16_1M"}
    for workload in workloads:
        names = [r["optimizer"] for r in throughput if r["workload"] == workload]
        assert len(names) == len(set(names)) and BASELINE in names, names
        assert sorted(names) == sorted(r["optimizer"] for r in memory if r["workload"] == workload)


def test_throughputs_and_ratios_are_positive(records):
    for record in records:
        if record["benchmark"] == "peers_throughput":
            assert record["params_per_s"] > 0 and record["ratio_vs_torch_fused"] > 0, record
            assert record["step_s_min"] <= record["step_s_median"] <= record["step_s_max"]
            if record["optimizer"] == BASELINE:
                assert record["ratio_vs_torch_fused"] == 1.0
        if record["benchmark"] == "peers_quality":
            assert record["final_ratio_vs_torch_fused"] > 0, record
            assert record["held_out_ratio_vs_torch_fused"] > 0, record


def test_memory_figures_match_the_state_formats(records):
    memory = {(r["optimizer"], r["workload"]): r for r in records if r["benchmark"] == "peers_memory"}
    # torch keeps exp_avg and exp_avg_sq in the param's dtype: 8 B/param on fp32 params.
    assert memory[BASELINE, "fp32_1M"]["state_storage_bytes_per_param"] == pytest.approx(8.0, abs=0.01)
    # The companded 8-bit state is a quarter of that plus its scales and page slack.
    ours = memory["ours_8bit", "lora16"]["state_storage_bytes_per_param"]
    assert 2.0 < ours < 8.0
    for record in memory.values():
        assert record["state_storage_bytes_per_param"] > 0, record
        # The kernel's resident-set growth over the first step includes the state it allocated,
        # give or take pages the allocator already held.
        assert record["rss_growth_bytes_per_param"] > 0.5 * record["state_storage_bytes_per_param"]
        assert record["transient_peak_bytes_per_param"] is None or \
            record["transient_peak_bytes_per_param"] >= 0
