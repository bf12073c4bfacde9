"""`python -m pagedoptim plan` against reality: tiny models are built from the same configs
the planner reads and trained, and what they hold is compared with what plan said.

- Param shapes from a config equal those of the model transformers builds from it.
- Optimizer-state bytes equal `memory_report()` exactly, field by field (moments, scales,
  residuals, step counters, page slack, pages, page size, where the pages are), for every
  state format, paging tier and LoRA through PEFT.
- Paging traffic per step equals the pager's counted bytes.
- The peak of training (resident memory of a child process, see plan_peak_child.py) is
  within 10% of plan's peak, for torch.optim.AdamW and pagedoptim, with and without
  activation checkpointing.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import transformers  # a test dependency (requirements-dev.txt): never a skip

import pagedoptim as po  # noqa: E402
from pagedoptim import paging  # noqa: E402
from pagedoptim.cli import machine_profile, memory_plan, model_shapes, plan
from pagedoptim.__main__ import main as pagedoptim_main  # noqa: E402
from pagedoptim.integrations.optim_args import parse_optim_args  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PEAK_CHILD = pathlib.Path(__file__).with_name("plan_peak_child.py")
STATE_FIELDS = ("state_bytes", "moment_bytes", "scale_bytes", "residual_bytes", "step_bytes",
                "page_slack_bytes", "num_pages", "page_bytes")
PEAK_TOLERANCE = 0.10  # predicted peaks within 10% of the measured ones


def save_config(directory: pathlib.Path, config) -> pathlib.Path:
    config.save_pretrained(directory)
    return directory / "config.json"


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory) -> pathlib.Path:
    # Sizes that are not multiples of 32 where it matters: groups and pages get partial ends.
    config = transformers.LlamaConfig(hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=300, max_position_embeddings=128)
    return save_config(tmp_path_factory.mktemp("llama"), config)


def cli_plan(*args: str) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it, in this process (a fresh interpreter per call would
    spend seconds importing torch); test_the_command_runs_as_a_program runs it as one."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = pagedoptim_main(["plan", *args])
        except SystemExit as exit:  # argparse's own errors
            code = exit.code
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


def test_the_command_runs_as_a_program():
    result = subprocess.run([sys.executable, "-m", "pagedoptim", "plan", "--params", "1B",
                             "--gpu-memory", "24GiB"], capture_output=True, text=True,
                            timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert "recommended: po.AdamW(model.parameters(), " in result.stdout
    assert "optimizer state" in result.stdout and "peak on GPU" in result.stdout


# --- shapes ---------------------------------------------------------------------------------

TINY_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(hidden_size=64, intermediate_size=172,
                                              num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, vocab_size=256),
    "mixtral": lambda: transformers.MixtralConfig(hidden_size=64, intermediate_size=96,
                                                  num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=2, vocab_size=256,
                                                  num_local_experts=4),
    "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256,
                                            bos_token_id=0, eos_token_id=0),
    "qwen2": lambda: transformers.Qwen2Config(hidden_size=64, intermediate_size=160,
                                              num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, vocab_size=256),
}


@pytest.mark.parametrize("architecture", sorted(TINY_CONFIGS))
def test_shapes_from_a_config_are_the_models_own(architecture, tmp_path):
    config = TINY_CONFIGS[architecture]()
    path = save_config(tmp_path, config)
    spec = model_shapes.from_hf_config(path)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert spec.params == [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert spec.dims.hidden_size == 64 and spec.dims.num_layers == 2


# --- optimizer state: exact -----------------------------------------------------------------

STATE_CASES = {
    "8bit": (po.AdamW, {}, torch.float32),
    "exact": (po.AdamW, {"state_bits": 32}, torch.float32),
    "bf16_master24": (po.AdamW, {}, torch.bfloat16),
    "bf16_master32": (po.AdamW, {"master_bits": 32}, torch.bfloat16),
    "bf16_no_master": (po.AdamW, {"master_bits": None}, torch.bfloat16),
    "lion": (po.Lion, {}, torch.float32),
    "sgd": (po.SGD, {"lr": 0.1, "momentum": 0.9}, torch.float32),
    "nvme": (po.AdamW, {"offload": "nvme", "cache_bytes": 256 << 10}, torch.float32),
    "nvme_bf16": (po.AdamW, {"offload": "nvme", "cache_bytes": 96 << 10}, torch.bfloat16),
    "page_bytes": (po.AdamW, {"page_bytes": 8192}, torch.float32),
}
_ALGORITHMS = {po.AdamW: "adamw", po.Lion: "lion", po.SGD: "sgd"}


def stepped_report(optimizer, params) -> dict:
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.step()
    return optimizer.memory_report()


@pytest.mark.parametrize("case", sorted(STATE_CASES))
def test_state_bytes_equal_memory_report(case, llama_config, tmp_path):
    optimizer_class, settings, dtype = STATE_CASES[case]
    if "offload" in settings:
        settings = {**settings, "nvme_dir": str(tmp_path)}
    spec = model_shapes.from_hf_config(llama_config)
    params = memory_plan.trainable_params(spec, memory_plan.Method(), dtype)
    plan_settings = {key: value for key, value in settings.items() if key not in ("lr", "momentum")}
    column = memory_plan.build_column(case, params, settings=plan_settings,
                                      device=torch.device("cpu"),
                                      algorithm=_ALGORITHMS[optimizer_class], activations=0,
                                      loss_transient=0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(llama_config.parent)).to(dtype)
    optimizer = optimizer_class(model.parameters(), **settings)
    report = stepped_report(optimizer, list(model.parameters()))
    planned = column.exact_state
    assert {f: getattr(planned, f) for f in STATE_FIELDS} == {f: report[f] for f in STATE_FIELDS}
    if "offload" in settings:
        # The tier below holds every page; the cache is at most its budget, which it reached.
        assert planned.state_placement["nvme"] == report["state_placement"]["nvme"]
        stats = optimizer.paging_stats()
        assert planned.state_placement["host"] == stats["peak_resident_pages"] * planned.page_bytes
        assert report["state_placement"]["host"] <= planned.state_placement["host"]
        assert column.nvme == report["state_placement"]["nvme"]
    else:
        assert planned.state_placement == report["state_placement"]
    assert column.optimizer_state + column.master_residual == report["state_bytes"]


def test_gpu_placement_equals_the_simulated_devices(llama_config, tmp_path):
    """The GPU layout (a device cache over pinned host memory or the page file) as the
    simulated device, which runs the CUDA path's stores, reports it."""
    spec = model_shapes.from_hf_config(llama_config)
    params = memory_plan.trainable_params(spec, memory_plan.Method(), torch.float32)
    for tier in ("host", "nvme"):
        settings = {"offload": tier, "cache_bytes": 256 << 10}
        if tier == "nvme":
            settings["nvme_dir"] = str(tmp_path)
        planned = memory_plan.pagedoptim_state(params, "adamw", settings, torch.device("cuda"))
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(llama_config.parent))
        with paging.simulated_device():
            optimizer = po.AdamW(model.parameters(), **settings)
            report = stepped_report(optimizer, list(model.parameters()))
        assert {f: getattr(planned, f) for f in STATE_FIELDS} == \
            {f: report[f] for f in STATE_FIELDS}
        assert planned.state_placement == report["state_placement"], tier


def test_lora_state_through_peft_is_exact(llama_config):
    import peft  # a test dependency (requirements-dev.txt): never a skip
    config = transformers.AutoConfig.from_pretrained(llama_config.parent)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainable = [p for p in model.parameters() if p.requires_grad]
    spec = model_shapes.from_hf_config(llama_config)
    method = memory_plan.Method(4, ("q_proj", "v_proj"))
    params = memory_plan.trainable_params(spec, method, torch.float32)
    assert [shape for _, shape, _ in params.trainable] == [tuple(p.shape) for p in trainable]
    assert params.frozen_bytes == sum(p.numel() * 4 for p in model.parameters()
                                      if not p.requires_grad)
    planned = memory_plan.pagedoptim_state(params, "adamw", {}, torch.device("cpu"))
    report = stepped_report(po.AdamW(trainable), trainable)
    assert {f: getattr(planned, f) for f in STATE_FIELDS} == {f: report[f] for f in STATE_FIELDS}


def test_the_command_reports_the_exact_state_as_json(llama_config, tmp_path):
    result = cli_plan("--model", str(llama_config), "--json", "--host-memory", "16GiB",
                      "--nvme-dir", str(tmp_path), "--cache-bytes", "256KiB")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    columns = {column["name"]: column for column in record["columns"]}
    assert set(columns) == {"torch.optim.AdamW", "8-bit, no paging", "pagedoptim offload=None",
                            "pagedoptim offload=nvme"}
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(llama_config.parent))
    report = stepped_report(po.AdamW(model.parameters()), list(model.parameters()))
    unpaged = columns["pagedoptim offload=None"]["exact_state"]
    assert {f: unpaged[f] for f in STATE_FIELDS} == {f: report[f] for f in STATE_FIELDS}
    # torch's state: two fp32 moments and a 4-byte step per param.
    torch_column = columns["torch.optim.AdamW"]
    assert torch_column["optimizer_state"] == sum(8 * p.numel() + 4 for p in model.parameters())
    assert record["activations_are_estimate"] is True
    assert record["recommendation"]["settings"].get("offload") is None


def test_paging_traffic_equals_the_pagers_count(llama_config, tmp_path):
    spec = model_shapes.from_hf_config(llama_config)
    params = memory_plan.trainable_params(spec, memory_plan.Method(), torch.float32)
    # The plan-aware policy (the default) keeps its budget's pages; lru can miss a few more.
    for policy in ("auto", "plan"):
        settings = {"offload": "nvme", "cache_bytes": 96 << 10, "policy": policy,
                    "nvme_dir": str(tmp_path)}
        column = memory_plan.build_column("nvme", params, settings=settings,
                                          device=torch.device("cpu"), algorithm="adamw",
                                          activations=0, loss_transient=0)
        planned_read, planned_written = memory_plan.paging_traffic_bytes(column)
        assert planned_read > 0
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(llama_config.parent))
        optimizer = po.AdamW(model.parameters(), **settings)
        stepped_report(optimizer, list(model.parameters()))  # two steps: the cache is warm
        before = optimizer.paging_stats()
        optimizer.step()
        after = optimizer.paging_stats()
        assert sum(after["bytes_read"].values()) - sum(before["bytes_read"].values()) \
            == planned_read, policy
        assert sum(after["bytes_written"].values()) - sum(before["bytes_written"].values()) \
            == planned_written, policy


# --- peaks: within 10% ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def peak_config(tmp_path_factory) -> pathlib.Path:
    # Large enough that weights, state and activations dwarf the allocator's small change.
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4,
                                      vocab_size=4096, max_position_embeddings=256)
    return save_config(tmp_path_factory.mktemp("peak"), config)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("optimizer,column", [("torch", "torch.optim.AdamW"),
                                              ("8bit", "pagedoptim offload=None")])
def test_training_peak_is_within_ten_percent_of_the_plan(optimizer, column, checkpointing,
                                                         peak_config):
    if not pathlib.Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak")
    shape = ["--seq-len", "256", "--micro-batch", "4"]
    if checkpointing:
        shape.append("--activation-checkpointing")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    child = subprocess.run([sys.executable, str(PEAK_CHILD), str(peak_config), "--optimizer",
                            optimizer, *shape], capture_output=True, text=True, timeout=600,
                           env=env)
    assert child.returncode == 0, child.stderr
    measured = json.loads(child.stdout.strip().splitlines()[-1])["peak_bytes"]
    result = cli_plan("--model", str(peak_config), "--json", *shape)
    assert result.returncode == 0, result.stderr
    planned = {c["name"]: c for c in json.loads(result.stdout)["columns"]}[column]["device_peak"]
    assert abs(planned - measured) <= PEAK_TOLERANCE * measured, (planned, measured)


# --- recommendations, estimates, bad input --------------------------------------------------


def test_plan_compares_with_mixed_precision_torch_and_prints_the_trainer_form():
    """A user planning a bf16 full fine-tune sees torch's AdamW as autocast runs it (fp32
    master, grads and moments) beside bf16 torch, the saving against both, the recommended
    settings as a column and as Trainer's optim_args, and a GPU never planned to its last
    byte."""
    args = ["--shapes", "w=4096x4096*8", "--dtype", "bf16", "--gpu-memory", "2GiB",
            "--host-memory", "64GiB"]
    record = json.loads(cli_plan(*args, "--json").stdout)
    columns = {c["name"]: c for c in record["columns"]}
    mixed, plain = columns["torch.optim.AdamW (autocast)"], columns["torch.optim.AdamW"]
    elements = 8 * 4096 * 4096
    assert mixed["weights"] == mixed["grads"] == 4 * elements
    assert mixed["optimizer_state"] == 8 * elements + 4 * 8
    assert plain["optimizer_state"] == 4 * elements + 4 * 8
    recommendation = record["recommendation"]
    assert record["headroom_bytes"] == max(256 << 20, int(0.03 * (2 << 30)))
    assert recommendation["device_peak"] <= (2 << 30) - record["headroom_bytes"]
    assert any(c["settings"] == recommendation["settings"] for c in record["columns"])
    trainer = record["trainer_optim_args"]
    assert trainer["optim"] == "pagedoptim_adamw"
    assert parse_optim_args(trainer["optim_args"], po.AdamW) == recommendation["settings"]
    text = cli_plan(*args).stdout
    assert "fp32 params (the master copy), fp32 grads and moments" in text
    saving = 1 - recommendation["device_peak"] / mixed["device_peak"]
    assert f"{saving:.0%} less than torch.optim.AdamW (autocast)" in text
    assert f'optim="pagedoptim_adamw", optim_args="{trainer["optim_args"]}"' in text


def test_when_nothing_fits_plan_says_which_smaller_training_shape_would(llama_config):
    """The README's 8B-style request without activation checkpointing: plan names the flag
    that makes it fit, and the settings then."""
    args = ["--model", str(llama_config), "--seq-len", "8192", "--micro-batch", "16"]
    probe = json.loads(cli_plan(*args, "--json", "--gpu-memory", "80GiB").stdout)
    unpaged = {c["name"]: c for c in probe["columns"]}["pagedoptim offload=None"]
    # Room for everything but half of these activations.
    gpu = unpaged["device_peak"] - unpaged["activations"] // 2
    result = cli_plan(*args, "--json", "--gpu-memory", str(gpu), "--host-memory", "64GiB")
    assert result.returncode == 1
    fits_with = json.loads(result.stdout)["fits_with"]
    assert fits_with["flags"].startswith("--activation-checkpointing")
    assert fits_with["device_peak"] <= gpu
    text = cli_plan(*args, "--gpu-memory", str(gpu), "--host-memory", "64GiB").stdout
    assert f"It fits with {fits_with['flags']}: po.AdamW(model.parameters()," in text


def test_an_impossible_request_says_what_is_missing_in_bytes():
    result = cli_plan("--params", "70B", "--gpu-memory", "8GB", "--host-memory", "16GB")
    assert result.returncode == 1, result.stderr
    assert "does not fit" in result.stdout
    missing = int(result.stdout.split("short by")[1].split("(")[1].split(" bytes")[0]
                  .replace(",", ""))
    # The weights alone (70e9 bf16) exceed 8 GB by far more than 100 GB.
    assert missing > 2 * 70e9 - 8e9


def test_paging_is_recommended_when_the_state_does_not_fit():
    # 134M bf16 params: weights and grads of 256 MiB each, 8-bit state and residual of
    # 400 MiB. A GPU with room for weights, grads, the CUDA overhead and 128 MiB more:
    # the unpaged state does not fit, a host cache of about 128 MiB does.
    args = ["--shapes", "w=4096x4096*8", "--dtype", "bf16", "--json"]
    probe = json.loads(cli_plan(*args, "--gpu-memory", "80GiB").stdout)
    unpaged = {c["name"]: c for c in probe["columns"]}["pagedoptim offload=None"]
    assert probe["recommendation"]["settings"].get("offload") is None
    state = unpaged["optimizer_state"] + unpaged["master_residual"]
    # The 128 MiB, and the 256 MiB the plan keeps free for the allocator on a GPU this small.
    gpu = unpaged["device_peak"] - state + (128 << 20) + (256 << 20)
    result = cli_plan(*args, "--gpu-memory", str(gpu), "--host-memory", "64GiB")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    recommendation = record["recommendation"]
    assert record["headroom_bytes"] == 256 << 20
    assert recommendation["settings"]["offload"] == "host"
    assert recommendation["settings"].get("release_grads") is None
    assert recommendation["device_peak"] <= gpu - record["headroom_bytes"]
    assert recommendation["pinned_host"] >= state - (4 << 10) * 8
    # Without the host memory for the pinned pages, the page file it is.
    result = cli_plan(*args, "--gpu-memory", str(gpu), "--host-memory", "2200MiB",
                      "--nvme-free", "10GB")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["recommendation"]["settings"]["offload"] == "nvme"


def test_measured_bench_results_drive_the_step_estimate(llama_config, tmp_path):
    bench = tmp_path / "bench.json"
    machine_profile.save_profile({"schema": 1, "created": "test", "memory": {"bytes_per_s": 1e9},
                                  "steps": [{"mode": "8bit", "device": "cpu",
                                             "params_per_s": 1e6}]}, bench)
    record = json.loads(cli_plan("--model", str(llama_config), "--json", "--bench-file",
                                 str(bench)).stdout)
    columns = {c["name"]: c for c in record["columns"]}
    eight_bit = columns["pagedoptim offload=None"]["estimates"]
    assert eight_bit["step_seconds"] == pytest.approx(record["trainable_params"] / 1e6)
    assert "measured by bench" in eight_bit["kernel_source"]
    torch_estimate = columns["torch.optim.AdamW"]["estimates"]
    assert "measured by bench" in torch_estimate["kernel_source"]  # the memory link was
    assert record["bench_file"] == str(bench)


@pytest.mark.parametrize("cache,prefetch", [("256KiB", 4), ("128MiB", 8), ("1GiB", 32)])
def test_a_cpu_page_file_is_recommended_a_deeper_prefetch(cache, prefetch, llama_config,
                                                          tmp_path):
    # The CPU pager reads the page file as deep as its prefetch window (docs/paging.md):
    # plan asks for 32 pages ahead, at most an eighth of the cache's pages, at least the
    # default 4.
    record = json.loads(cli_plan("--model", str(llama_config), "--json", "--nvme-dir",
                                 str(tmp_path), "--cache-bytes", cache).stdout)
    paged = {c["name"]: c for c in record["columns"]}["pagedoptim offload=nvme"]
    assert paged["settings"]["prefetch"] == prefetch
    assert paged["settings"]["cache_bytes"] == plan.parse_size(cache, "--cache-bytes")
    # The settings are the optimizer's own keyword arguments.
    po.AdamW([torch.nn.Parameter(torch.zeros(4))], **paged["settings"])


def test_a_paged_cpu_step_is_estimated_as_the_larger_of_kernel_and_disk_time(llama_config,
                                                                               tmp_path):
    # The CPU pager reads and writes pages while the kernel steps resident ones, so the
    # step takes the longer of the two, not their sum (docs/paging.md measures it).
    bench = tmp_path / "bench.json"
    machine_profile.save_profile({"schema": 1, "created": "test",
                                  "disk": {"mixed_bytes_per_s": 1e8},
                                  "steps": [{"mode": "8bit", "device": "cpu",
                                             "params_per_s": 1e6}]}, bench)
    record = json.loads(cli_plan("--model", str(llama_config), "--json", "--bench-file",
                                 str(bench), "--cache-bytes", "64KiB").stdout)
    paged = {c["name"]: c for c in record["columns"]}["pagedoptim offload=nvme"]["estimates"]
    assert paged["kernel_seconds"] == pytest.approx(record["trainable_params"] / 1e6)
    assert paged["io_seconds"] == pytest.approx(
        (paged["paging_read_bytes"] + paged["paging_written_bytes"]) / 1e8)
    assert paged["kernel_seconds"] > 0 and paged["io_seconds"] > 0
    assert paged["step_seconds"] == max(paged["kernel_seconds"], paged["io_seconds"])


@pytest.mark.parametrize("args,message", [
    (["--params", "seven"], "--params"),
    (["--params", "0"], "--params"),
    (["--params", "7B", "--gpu-memory", "-3GB"], "--gpu-memory"),
    (["--params", "7B", "--gpu-memory", "lots"], "--gpu-memory"),
    (["--params", "7B", "--seq-len", "0"], "--seq-len"),
    (["--params", "7B", "--lora-rank", "8"], "--lora-rank"),
    (["--shapes", "q=4096xx4096"], "--shapes"),
    ([], "exactly one of"),
    (["--params", "7B", "--shapes", "q=4x4"], "exactly one of"),
    (["--model", "/nonexistent/config.json"], "no config file"),
])
def test_bad_input_gets_a_message_naming_the_field(args, message):
    result = cli_plan(*args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("content,message", [
    ({"hidden_size": 64}, "model_type"),
    ({"model_type": "no-such-model", "hidden_size": 64}, "does not know"),
    ({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
      "vocab_size": 256}, "'hidden_size'"),
    ({"model_type": "llama", "hidden_size": -64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "vocab_size": 256}, "'hidden_size' must be a positive"),
])
def test_bad_configs_name_the_field(content, message, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(content))
    result = cli_plan("--model", str(path))
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_sizes_parse_in_decimal_and_binary_units():
    assert plan.parse_size("24GiB", "--x") == 24 << 30
    assert plan.parse_size("24G", "--x") == 24 << 30
    assert plan.parse_size("500GB", "--x") == 500 * 10**9
    assert plan.parse_size("1.5TB", "--x") == int(1.5e12)
    assert plan.parse_size("4096", "--x") == 4096
