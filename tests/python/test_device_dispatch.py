"""Where a step runs, decided by the params' device, and the errors that say why it cannot
run there. These run on every machine: without a GPU they check the routing and the
messages; the CUDA step itself is tested in test_cuda_step.py (skipped without a GPU)."""

import pytest
import torch

import pagedoptim as po
from pagedoptim._native import native

from optimizer_configs import configs, parametrize


def test_cpu_params_keep_state_on_the_cpu():
    p = torch.nn.Parameter(torch.randn(40))
    opt = po.AdamW([p], lr=1e-2)
    p.grad = torch.randn(40)
    opt.step()
    assert opt.state_store.engine.device == "cpu"
    assert opt.state[p]["step"].device.type == "cpu"


def test_cpu_state_does_not_claim_amp_support():
    """On the CPU GradScaler unscales and checks the grads itself (a CPU .item() costs no
    device sync), released ones too (through release_guard); only device state takes
    GradScaler's tensors."""
    p = torch.nn.Parameter(torch.randn(4))
    assert not po.AdamW([p])._step_supports_amp_scaling
    assert not po.AdamW([p], release_grads=True)._step_supports_amp_scaling


@parametrize("config", configs(core=True))
def test_params_on_an_unsupported_device_name_the_param(config):
    params = [torch.nn.Parameter(torch.randn(3, device="meta")) for _ in range(2)]
    opt = config.make(params)
    params[1].grad = torch.randn(3, device="meta")
    with pytest.raises(NotImplementedError, match=r"param 1 \(shape \(3,\)"):
        opt.step()


def test_engine_device_argument_is_checked():
    kinds = [[("exp_avg", 128, False), ("exp_avg_sq", 128, False)]]
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda:N'"):
        native.PagedState("adamw", kinds, 4096, device="gpu")


@pytest.mark.skipif(native.cuda_built(), reason="checks the message of a build without CUDA")
def test_build_without_cuda_says_how_to_get_it():
    assert native.cuda_version() == 0
    kinds = [[("exp_avg", 128, False), ("exp_avg_sq", 128, False)]]
    with pytest.raises(RuntimeError, match="no CUDA kernels"):
        native.PagedState("adamw", kinds, 4096, device="cuda:0")


def test_amp_tensors_are_refused_for_cpu_state():
    """found_inf/grad_scale belong to the CUDA protocol; passing them for CPU state is a
    caller error, not something to ignore."""
    p = torch.randn(64)
    g = torch.randn(64)
    kinds = [[("exp_avg", 128, False), ("exp_avg_sq", 128, False)]]
    engine = native.PagedState("adamw", kinds, 4096)
    slot = engine.register_param(64, 0)
    with pytest.raises(ValueError, match="found_inf and grad_scale"):
        engine.step_adamw([p], [g], [torch.tensor(0.0)], [slot], [0],
                          [(1e-3, 0.9, 0.999, 1e-8, 0.0, False, False)],
                          found_inf=torch.zeros(1))
