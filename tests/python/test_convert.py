"""`python -m pagedoptim convert` and the conversions behind it: pagedoptim's 8-bit state to
torch.optim's format and back, checked against torch's own optimizers (the converted state
must step in torch.optim.AdamW / SGD as ours steps in exact mode), the CLI end to end as a
subprocess, and bad input (clear errors, never a partial output file)."""

import copy
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import pagedoptim as po
from support import (Grads, assert_state_equal, clone_params, make_params, run_lockstep,
                      run_steps, set_grads)
from pagedoptim.cli import convert
from pagedoptim.__main__ import main
from pagedoptim._native import native
from pagedoptim.checkpoint.conversion import (AlreadyInTargetFormat, to_pagedoptim_format,
                                              to_torch_format)

from optimizer_configs import BY_NAME, configs, parametrize

# A 0-dim and a 1-D param (fp32 moments in every format) and params of rows that end in
# partial groups (8-bit moments: optimizer_configs.MIN_8BIT_SIZE).
SHAPES = [(), (7,), (1, 33), (5, 13), (3, 31, 3)]
STEPS = 4
EXACT = dict(state_bits=32, master_bits=None)

# Every algorithm's branches (optimizer_configs.CORE); those torch.optim has are converted
# to and from torch's own optimizers.
CORE = configs(core=True)
IN_TORCH = configs(core=True, in_torch_optim=True)
ADAMW, SGD_MOMENTUM = BY_NAME["AdamW-default"], BY_NAME["SGD-momentum"]
PACKAGE_PARENT = pathlib.Path(po.__file__).resolve().parents[1]


def to_8bit(state_dict, algorithm):
    """to_pagedoptim_format(..., 8) for the optimizers of these tests, whose params of two or
    more dimensions all keep 8-bit moments (optimizer_configs.MIN_8BIT_SIZE)."""
    return to_pagedoptim_format(state_dict, algorithm, 8, min_8bit_size=0)


def trained(config, dtype=torch.float32, **options):
    """(params, optimizer) after STEPS steps of pagedoptim's `config` (8-bit by default)."""
    params = make_params(SHAPES, dtype=dtype)
    opt = config.make(params, **options)
    run_steps(opt, params, Grads([p.shape for p in params], STEPS), 0, STEPS)
    return params, opt


def trained_torch(config):
    params = make_params(SHAPES)
    opt = config.make_torch(params)
    run_steps(opt, params, Grads(SHAPES, STEPS), 0, STEPS)
    return params, opt


def tensors_of(state_dict):
    return {(index, key): value for index, state in state_dict["state"].items()
            for key, value in state.items()}


# -- the conversions -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@parametrize("config", CORE)
def test_to_torch_is_torch_state_dict(config, dtype):
    """Converting a saved 8-bit state_dict gives what the live optimizer's torch_state_dict()
    gives, bit for bit (bf16 params: the master residual is dropped)."""
    _, opt = trained(config, dtype)
    converted = to_torch_format(opt.state_dict(), config.algorithm)
    assert_state_equal(tensors_of(converted), tensors_of(opt.torch_state_dict()), config.name)
    assert converted["param_groups"] == opt.state_dict()["param_groups"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@parametrize("config", CORE)
def test_8bit_to_torch_and_back_is_bit_identical(config, dtype):
    """Dequantized codes quantize back to themselves; the residual survives a round trip
    through pagedoptim's 32-bit format."""
    _, opt = trained(config, dtype)
    saved, algorithm = opt.state_dict(), config.algorithm
    via_torch = to_8bit(to_torch_format(saved, algorithm), algorithm)
    via_fp32 = to_8bit(to_pagedoptim_format(saved, algorithm, 32), algorithm)
    without_residual = {k: v for k, v in tensors_of(saved).items() if k[1] != "master_residual"}
    assert_state_equal(tensors_of(via_torch), without_residual, f"{config.name} via torch")
    assert_state_equal(tensors_of(via_fp32), tensors_of(saved), f"{config.name} via 32-bit")


@pytest.mark.parametrize("gradient", [1e-4, 1e-5])
def test_8bit_round_trip_is_exact_for_normal_scales_and_within_half_a_step_for_subnormal_ones(
        gradient):
    """Gradients small enough that every group's scale is an fp16 subnormal
    (docs/checkpoints.md): codes may move there, each decoded value by less than half a
    code step of its old scale, and converting again changes nothing."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1, 32 * 3000 + 7))
    opt = po.AdamW([p], lr=1e-3)
    for _ in range(3):
        p.grad = torch.randn_like(p) * gradient * torch.rand_like(p)
        opt.step()
    saved = opt.state_dict()
    once = to_8bit(to_torch_format(saved, "adamw"), "adamw")
    twice = to_8bit(to_torch_format(once, "adamw"), "adamw")
    assert_state_equal(tensors_of(twice), tensors_of(once), "a second round trip")
    for name, second in (("exp_avg", False), ("exp_avg_sq", True)):
        decode = native.decode_second_moment if second else native.decode_moment
        before, after = saved["state"][0], once["state"][0]
        scales = before[f"{name}_scales"].reshape(-1).to(torch.float16)
        old = decode(before[f"{name}_codes"].reshape(-1), scales)
        new = decode(after[f"{name}_codes"].reshape(-1), after[f"{name}_scales"].reshape(-1)
                     .to(torch.float16))
        scale = scales.float().repeat_interleave(32)[:old.numel()]
        normal = scale >= 2.0 ** -14
        assert torch.equal(old[normal], new[normal]), name
        # Half a step: of sqrt(v) (linear, 1/255 of the scale), of m (companded, at most
        # 2/127 of the scale next to the absmax).
        moved = (old.sqrt() - new.sqrt()) if second else (old - new)
        step = (1 / 255 if second else 2 / 127) * scale
        assert bool((moved.abs() <= 0.5 * step).all()), name


@parametrize("config", IN_TORCH)
def test_8bit_checkpoint_steps_in_torch_as_ours_does_in_exact_mode(config):
    """The reason to convert: torch's optimizer, given the converted 8-bit checkpoint,
    continues exactly as pagedoptim's exact mode does from the same checkpoint."""
    params, opt = trained(config)
    converted = to_torch_format(opt.state_dict(), config.algorithm)
    torch_params, exact_params = clone_params(params), clone_params(params)
    # One copy each: torch's load_state_dict keeps the given 'step' tensors, which both
    # optimizers would then increment.
    theirs = config.make_torch(torch_params)
    theirs.load_state_dict(copy.deepcopy(converted))
    exact = config.make(exact_params, **EXACT)
    exact.load_state_dict(copy.deepcopy(converted))
    grads = Grads(SHAPES, STEPS, seed=7)
    run_lockstep(exact, exact_params, theirs, torch_params, grads, label=config.name)


@parametrize("config", IN_TORCH)
@pytest.mark.parametrize("state", ["8-bit", "bf16 residuals"])
def test_torch_optimizer_given_our_state_refuses_to_step_and_names_convert(config, state):
    """Without the guard torch's AdamW stops with KeyError: 'exp_avg', and torch's SGD
    trains on with a fresh momentum beside our codes. The step is refused before any param
    moves; the converted state steps."""
    dtype = torch.float32 if state == "8-bit" else torch.bfloat16
    kwargs = {} if state == "8-bit" else dict(state_bits=32, master_bits=24)
    params, opt = trained(config, dtype=dtype, **kwargs)
    torch_params = clone_params(params)
    theirs = config.make_torch(torch_params)
    theirs.load_state_dict(copy.deepcopy(opt.state_dict()))
    set_grads(torch_params, Grads([p.shape for p in params], 1, seed=3)[0])
    before = [p.detach().clone() for p in torch_params]
    with pytest.raises(ValueError, match=r"PagedOptim's compressed state .*pagedoptim convert"):
        theirs.step()
    assert all(torch.equal(a, b) for a, b in zip(torch_params, before))
    converted = config.make_torch(torch_params)
    converted.load_state_dict(opt.torch_state_dict())
    converted.step()
    assert not all(torch.equal(a, b) for a, b in zip(torch_params, before))


def test_the_guard_covers_subclasses_of_torchs_algorithms_not_wrappers_of_ours():
    """A user's subclass of torch.optim.AdamW reads fp32 moments as AdamW does: refused. A
    wrapper that steps one of ours inside and shows its state (ZeroRedundancyOptimizer,
    accelerate's AcceleratedOptimizer) is left alone (test_distributed_zero.py runs ZeRO)."""
    params, opt = trained(ADAMW)

    class MyAdamW(torch.optim.AdamW):
        pass

    class Forwarding(torch.optim.Optimizer):
        def __init__(self, inner):
            super().__init__([p for g in inner.param_groups for p in g["params"]], {})
            self.inner = inner
            self.state = inner.state

        def step(self, closure=None):
            return self.inner.step(closure)

    mine = MyAdamW(clone_params(params))
    mine.load_state_dict(copy.deepcopy(opt.state_dict()))
    with pytest.raises(ValueError, match="MyAdamW holds PagedOptim's compressed state"):
        mine.step()
    set_grads(params, Grads([p.shape for p in params], 1, seed=3)[0])
    Forwarding(opt).step()  # steps ours, whose state it shows: no refusal


@parametrize("config", IN_TORCH)
def test_torch_checkpoint_to_8bit_loads_into_ours_and_steps(config):
    """A torch checkpoint converted to 8 bits is the state ours would make of it on load,
    and training goes on from it exactly as from the torch checkpoint itself."""
    params, theirs = trained_torch(config)
    converted = to_8bit(theirs.state_dict(), config.algorithm)
    from_converted_params, from_torch_params = clone_params(params), clone_params(params)
    from_converted = config.make(from_converted_params)
    from_converted.load_state_dict(copy.deepcopy(converted))
    from_torch = config.make(from_torch_params)
    from_torch.load_state_dict(copy.deepcopy(theirs.state_dict()))
    grads = Grads(SHAPES, STEPS, seed=7)
    run_steps(from_converted, from_converted_params, grads, 0, STEPS)
    run_steps(from_torch, from_torch_params, grads, 0, STEPS)
    for a, b in zip(from_converted_params, from_torch_params):
        assert torch.equal(a, b)
    assert_state_equal(tensors_of(from_converted.state_dict()),
                       tensors_of(from_torch.state_dict()), config.name)


@parametrize("config", IN_TORCH)
def test_torch_checkpoint_is_already_torch_and_pagedoptim_32bit(config):
    """torch's fp32 format is pagedoptim's state_bits=32 format: nothing to convert."""
    _, theirs = trained_torch(config)
    algorithm = config.algorithm
    with pytest.raises(AlreadyInTargetFormat, match="already in torch.optim's format"):
        to_torch_format(theirs.state_dict(), algorithm)
    with pytest.raises(AlreadyInTargetFormat, match="state_bits=32 format"):
        to_pagedoptim_format(theirs.state_dict(), algorithm, 32)


def test_8bit_checkpoint_is_already_8bit_and_empty_state_is_in_every_format():
    _, opt = trained(ADAMW)
    with pytest.raises(AlreadyInTargetFormat, match="state_bits=8 format"):
        to_8bit(opt.state_dict(), "adamw")
    unstepped = po.AdamW(make_params(SHAPES)).state_dict()
    with pytest.raises(AlreadyInTargetFormat):
        to_torch_format(unstepped, "adamw")


def test_adam_with_coupled_weight_decay_is_refused():
    params = make_params(SHAPES)
    for weight_decay in (0.0, 0.1):
        adam = torch.optim.Adam(params, lr=1e-3, weight_decay=weight_decay)
        run_steps(adam, params, Grads(SHAPES, 1), 0, 1)
        if weight_decay == 0.0:
            to_8bit(adam.state_dict(), "adam")
            continue
        with pytest.raises(ValueError, match="torch.optim.Adam with weight_decay != 0"):
            to_8bit(adam.state_dict(), "adam")


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("exp_avg_scales"), "has only one of 'exp_avg_codes' and 'exp_avg_scales'"),
    (lambda s: s.update(exp_avg_scales=torch.zeros(1, dtype=torch.float16)),
     r"'exp_avg_scales' of param 0 has 1 elements, expected 5"),
    (lambda s: s.update(exp_avg_codes=[1, 2]), "'exp_avg_codes' of param 0 must be a tensor"),
])
def test_malformed_state_is_a_clear_error(edit, message):
    _, opt = trained(ADAMW)
    state_dict = opt.state_dict()
    state_dict["state"] = {index: dict(state) for index, state in state_dict["state"].items()}
    first = next(i for i, s in state_dict["state"].items()
                 if "exp_avg_codes" in s and s["exp_avg_codes"].numel() == 65)
    state_dict["state"] = {0: state_dict["state"][first]}
    edit(state_dict["state"][0])
    with pytest.raises(ValueError, match=message):
        to_torch_format(state_dict, "adamw")


def test_bad_arguments_are_named():
    _, opt = trained(ADAMW)
    with pytest.raises(ValueError, match=r"algorithm must be one of .*got 'adafactor'"):
        to_torch_format(opt.state_dict(), "adafactor")
    with pytest.raises(ValueError, match=r"state_bits must be one of \[8, 32\], got 16"):
        to_pagedoptim_format(opt.state_dict(), "adamw", 16)
    with pytest.raises(ValueError, match="state_dict must be an optimizer state_dict"):
        to_torch_format({"model": {}}, "adamw")


# -- the command line ------------------------------------------------------------------------


def run_cli(*args):
    """`python -m pagedoptim convert ...` as users run it, on this pagedoptim."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(PACKAGE_PARENT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "pagedoptim", "convert", *map(str, args)],
                          capture_output=True, text=True, timeout=120, env=env)


def test_cli_converts_a_training_checkpoint_to_torch_and_back(tmp_path):
    """A checkpoint holding model and optimizer: --to torch keeps everything but the
    optimizer state, which torch.optim.AdamW then loads and steps; --to pagedoptim brings
    back the 8-bit state bit for bit."""
    params, opt = trained(ADAMW)
    checkpoint = {"model": {"w": params[3].detach()}, "optimizer": opt.state_dict(), "epoch": 3}
    ours_path, torch_path, back_path = (tmp_path / "ours.pt", tmp_path / "torch.pt",
                                        tmp_path / "back.pt")
    torch.save(checkpoint, ours_path)

    result = run_cli(ours_path, torch_path, "--to", "torch")
    assert result.returncode == 0, result.stderr
    assert "adamw" in result.stdout
    loaded = torch.load(torch_path, weights_only=True)
    assert loaded["epoch"] == 3 and torch.equal(loaded["model"]["w"], params[3])
    assert_state_equal(tensors_of(loaded["optimizer"]), tensors_of(opt.torch_state_dict()),
                       "--to torch")
    theirs_params = clone_params(params)
    theirs = torch.optim.AdamW(theirs_params, lr=1e-2, weight_decay=0.1)
    theirs.load_state_dict(loaded["optimizer"])
    set_grads(theirs_params, Grads(SHAPES, 1)[0])
    theirs.step()
    assert all(torch.isfinite(p).all() for p in theirs_params)

    result = run_cli(torch_path, back_path, "--to", "pagedoptim", "--state-bits", "8",
                     "--min-8bit-size", "0")
    assert result.returncode == 0, result.stderr
    back = torch.load(back_path, weights_only=True)
    assert_state_equal(tensors_of(back["optimizer"]), tensors_of(checkpoint["optimizer"]),
                       "--to pagedoptim")


def test_cli_converts_a_torch_sgd_state_dict_file_to_8bit(tmp_path):
    """The file is the state_dict itself (as HF Trainer's optimizer.pt); the algorithm is
    read from it; pagedoptim.SGD loads the result and steps."""
    params, theirs = trained_torch(SGD_MOMENTUM)
    torch.save(theirs.state_dict(), tmp_path / "optimizer.pt")
    result = run_cli(tmp_path / "optimizer.pt", tmp_path / "out.pt", "--to", "pagedoptim",
                     "--state-bits", "8", "--min-8bit-size", "0")
    assert result.returncode == 0, result.stderr
    ours = SGD_MOMENTUM.make(params)
    ours.load_state_dict(torch.load(tmp_path / "out.pt", weights_only=True))
    set_grads(params, Grads(SHAPES, 1)[0])
    ours.step()
    assert "momentum_buffer_codes" in ours.state_dict()["state"][SHAPES.index((5, 13))]


def test_cli_already_in_target_format_writes_nothing_and_exits_3(tmp_path):
    _, theirs = trained_torch(ADAMW)
    torch.save(theirs.state_dict(), tmp_path / "optimizer.pt")
    result = run_cli(tmp_path / "optimizer.pt", tmp_path / "out.pt", "--to", "torch")
    assert result.returncode == convert.EXIT_ALREADY_IN_TARGET_FORMAT == 3
    assert "already in torch.optim's format" in result.stderr
    assert not (tmp_path / "out.pt").exists()


def cli_error(capsys, *args):
    """Runs the command in this process (fast); returns (exit status, stderr)."""
    status = main(["convert", *map(str, args)])
    return status, capsys.readouterr().err


def save(tmp_path, obj, name="in.pt"):
    torch.save(obj, tmp_path / name)
    return tmp_path / name


def test_cli_bad_inputs_are_clear_errors(tmp_path, capsys):
    out = tmp_path / "out.pt"
    _, opt = trained(ADAMW)
    ours = opt.state_dict()
    cases = [
        ((tmp_path / "missing.pt", out, "--to", "torch"), "INPUT .*missing.pt does not exist"),
        ((tmp_path, out, "--to", "torch"), "is a directory"),
        ((save(tmp_path, b"not a checkpoint", "bytes.pt"), out, "--to", "torch"),
         "not an optimizer checkpoint: .*got bytes"),
        ((save(tmp_path, {"model": {"w": torch.zeros(2)}}, "model.pt"), out, "--to", "torch"),
         r"not an optimizer checkpoint: .*keys \['model'\]"),
        ((save(tmp_path, {"a": ours, "b": ours}, "two.pt"), out, "--to", "torch"),
         r"several optimizer state_dicts, under \['a', 'b'\]; choose one with --key"),
        ((save(tmp_path, {"a": ours}, "one.pt"), out, "--to", "torch", "--key", "b"),
         r"--key 'b': .* has no such key \(its keys: \['a'\]\)"),
        ((save(tmp_path, ours, "ours.pt"), out, "--to", "pagedoptim"),
         "--to pagedoptim needs --state-bits"),
        ((save(tmp_path, ours, "ours.pt"), out, "--to", "torch", "--algorithm", "lion"),
         "--algorithm lion does not fit .*saved by AdamW"),
        ((save(tmp_path, {"state": {}, "param_groups": [{"params": [0], "lr": 1.0}]}, "bare.pt"),
          out, "--to", "torch"), "cannot tell which optimizer saved .*pass --algorithm"),
        ((save(tmp_path, ours, "ours.pt"), tmp_path / "no_dir" / "out.pt", "--to", "torch"),
         "OUTPUT .* directory .*no_dir does not exist"),
    ]
    for args, message in cases:
        status, err = cli_error(capsys, *args)
        assert status == 1, (args, err)
        assert err.startswith("error: ") and re.search(message, err), (
            args, err)
    assert not out.exists()


def test_cli_refuses_a_file_that_would_run_code(tmp_path, capsys):
    """weights_only=True: a pickled object outside torch's allowlist is refused, not run."""
    status, err = cli_error(capsys, save(tmp_path, {"optimizer": pathlib.PurePath("x")}),
                            tmp_path / "out.pt", "--to", "torch")
    assert status == 1 and "torch.load(weights_only=True)" in err


def test_cli_failed_write_keeps_the_old_output_and_leaves_no_temporary_file(tmp_path, capsys,
                                                                             monkeypatch):
    _, opt = trained(ADAMW)
    source = save(tmp_path, opt.state_dict())
    out = tmp_path / "out.pt"
    out.write_bytes(b"previous")

    def save_half_then_fail(obj, handle):
        handle.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(convert.torch, "save", save_half_then_fail)
    status, err = cli_error(capsys, source, out, "--to", "torch")
    assert status == 1 and "OUTPUT" in err and "No space left on device" in err
    assert out.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt", "out.pt"]


def test_cli_output_gets_a_new_files_mode(tmp_path, capsys):
    _, opt = trained(ADAMW)
    status, _ = cli_error(capsys, save(tmp_path, opt.state_dict()), tmp_path / "out.pt",
                          "--to", "torch")
    umask = os.umask(0)
    os.umask(umask)
    assert status == 0 and (tmp_path / "out.pt").stat().st_mode & 0o777 == 0o666 & ~umask
