"""memory_report(): exact bytes per kind, computed here by hand from the state format.

Format (docs/compression.md, "Bytes per parameter"): a companded moment is 1 B of code per
element plus one 2 B fp16 scale per group of 32 elements of each parameter (per page segment;
segments hold whole groups, so that is ceil(numel / 32) scales); an fp32 moment is 4 B; the
master residual is 1 B (master_bits=24) or 2 B (32) per element of a bf16/fp16 param; the step
counter is 4 B per stepped param. Pages: every stream of a page starts on a 64 B boundary, and
a page holds as many groups as fit (page_geometry.cpp); params of one kind fill pages in
registration order, whole pages first, remainders packed into the open page.
"""

import pytest
import torch

import pagedoptim as po

GROUP = 32
STREAM_ALIGNMENT = 64


def groups(numel):
    return (numel + GROUP - 1) // GROUP


def align(x):
    return (x + STREAM_ALIGNMENT - 1) // STREAM_ALIGNMENT * STREAM_ALIGNMENT


def page_capacity_groups(bytes_per_group, page_bytes):
    """Largest group count whose streams, each aligned to 64 B, fit in one page."""
    def layout(g):
        end = 0
        for b in bytes_per_group:
            end = align(end) + b * g
        return end
    g = 0
    while layout(g + 1) <= page_bytes:
        g += 1
    return g


def test_hand_computed_8bit_adamw_report():
    """fp32 (1, 1000), (1, 33) and bf16 (1, 4096), (7,) params, AdamW 8-bit, master_bits=24,
    min_8bit_size=0, page_bytes=4096, bf16/fp32 grads present.

    fp32 kind: streams m codes 32, m scales 2, v codes 32, v scales 2 B/group: 60 groups fit
      (1920 + 120 -> 2048 + 1920 + 120 = 4088 <= 4096); 32 + 2 groups: one page.
    bf16 kind: + residual 32 B/group: 40 groups fit (1280 + 80 -> 1408 + 1280 + 80 -> 2816
      + 1280 = 4096); 4096 elements = 3 whole pages + 8 groups in a 4th.
    The 1-D (7,) keeps fp32 moments (4 B each) and its residual: a kind, and a page, of its
    own.
    """
    shapes = [((1, 1000), torch.float32), ((1, 33), torch.float32),
              ((1, 4096), torch.bfloat16), ((7,), torch.bfloat16)]
    params = [torch.nn.Parameter(torch.randn(s).to(d)) for s, d in shapes]
    opt = po.AdamW(params, lr=1e-3, page_bytes=4096, min_8bit_size=0)
    for p in params:
        p.grad = torch.randn(p.shape).to(p.dtype)
    opt.step()
    report = opt.memory_report()

    assert page_capacity_groups([32, 2, 32, 2], 4096) == 60
    assert page_capacity_groups([32, 2, 32, 2, 32], 4096) == 40
    numel = 1000 + 33 + 4096 + 7
    expected = {
        "param_bytes": 4 * 1033 + 2 * 4103,
        "grad_bytes": 4 * 1033 + 2 * 4103,
        "moment_bytes": 2 * (numel - 7) + 2 * 4 * 7,       # codes, 1 B; the (7,)'s fp32
        "scale_bytes": 2 * 2 * (32 + 2 + 128),              # two moments, one fp16 per group
        "residual_bytes": 4096 + 7,                         # int8 per bf16 element
        "step_bytes": 4 * 4,
        "num_pages": 1 + 4 + 1,
        "num_elements": numel,
        "fp32_state_elements": 7,
    }
    expected["state_bytes"] = expected["num_pages"] * 4096 + expected["step_bytes"]
    expected["page_slack_bytes"] = (expected["num_pages"] * 4096 - expected["moment_bytes"]
                                    - expected["scale_bytes"] - expected["residual_bytes"])
    for key, value in expected.items():
        assert report[key] == value, (key, report[key], value)
    assert report["state_bytes_per_param"] == expected["state_bytes"] / numel
    assert report["total_bytes_per_param"] == (
        expected["param_bytes"] + expected["grad_bytes"] + expected["state_bytes"]) / numel


# (name, optimizer, kwargs, dtype, bytes per group of 32 of each page stream, in page order)
Q = [32, 2]  # a companded moment: codes + fp16 scales
PER_ELEMENT = [
    ("AdamW 8-bit, master 24", po.AdamW, dict(), torch.bfloat16, Q + Q + [32]),
    ("AdamW 8-bit, master 32", po.AdamW, dict(master_bits=32), torch.bfloat16, Q + Q + [64]),
    ("AdamW 8-bit, no master", po.AdamW, dict(master_bits=None), torch.bfloat16, Q + Q),
    ("AdamW 8-bit amsgrad, fp32", po.AdamW, dict(amsgrad=True), torch.float32, Q + Q + Q),
    ("AdamW 32-bit, fp32", po.AdamW, dict(state_bits=32), torch.float32, [128, 128]),
    ("SGD momentum 8-bit, master 24", po.SGD, dict(momentum=0.9), torch.bfloat16, Q + [32]),
    ("Lion 8-bit, fp16, master 32", po.Lion, dict(master_bits=32), torch.float16, Q + [64]),
]


@pytest.mark.parametrize("name,cls,kwargs,dtype,streams", PER_ELEMENT,
                         ids=[c[0] for c in PER_ELEMENT])
def test_bytes_per_param_of_a_large_param(name, cls, kwargs, dtype, streams):
    """One param of 2^20 + 64 elements with the default 2 MiB pages: the payload is the
    format's bytes per group times the groups, the pages are ceil(groups / capacity), and the
    slack is what the pages hold beyond the payload."""
    numel = (1 << 20) + 64
    page_bytes = 2 << 20
    p = torch.nn.Parameter(torch.zeros(1, numel, dtype=dtype))  # one row: 8-bit moments
    opt = cls([p], lr=1e-3, **kwargs)
    p.grad = torch.zeros_like(p)
    opt.step()
    r = opt.memory_report()
    payload = sum(streams) * groups(numel)
    assert r["moment_bytes"] + r["scale_bytes"] + r["residual_bytes"] == payload
    assert r["scale_bytes"] == 2 * groups(numel) * sum(1 for b in streams if b == 2)
    residual = {32: 1, 64: 2}.get(streams[-1], 0) if dtype != torch.float32 else 0
    assert r["residual_bytes"] == residual * numel
    capacity = page_capacity_groups(streams, page_bytes)
    assert r["num_pages"] == -(-groups(numel) // capacity)
    assert r["state_bytes"] == r["num_pages"] * page_bytes + 4
    assert r["page_slack_bytes"] == r["num_pages"] * page_bytes - payload
    element = torch.finfo(dtype).bits // 8
    assert r["param_bytes"] == r["grad_bytes"] == element * numel
    assert r["total_bytes_per_param"] == (2 * element * numel + r["state_bytes"]) / numel


def test_bf16_adamw_with_master_and_released_grads_reaches_the_design_numbers():
    """bf16 params, 8-bit AdamW, master_bits=24: 2 + 2 + 3.125 = 7.125 B/param of payload,
    and with release_grads the grads are gone after backward: 5.125 (DESIGN.md section 5:
    7.1 and 5.1). The param fills exactly two 2 MiB pages (4.2M elements), so the only slack
    is each page's unusable tail after its last whole group (below 0.5%)."""
    numel = 2 * 32 * page_capacity_groups(Q + Q + [32], 2 << 20)
    for release, target in ((False, 7.125), (True, 5.125)):
        p = torch.nn.Parameter(torch.zeros(1, numel, dtype=torch.bfloat16))
        opt = po.AdamW([p], lr=1e-3, release_grads=release)
        (p.float().sum() * 0.0).backward()
        opt.step()
        assert (p.grad is None) == release
        r = opt.memory_report()
        payload = r["param_bytes"] + r["grad_bytes"] + r["moment_bytes"] + r["scale_bytes"] \
            + r["residual_bytes"]
        assert payload / numel == target
        assert target <= r["total_bytes_per_param"] <= target * 1.005


def test_report_before_the_first_step_has_no_state():
    p = torch.nn.Parameter(torch.zeros(100))
    r = po.AdamW([p]).memory_report()
    assert r["state_bytes"] == r["num_pages"] == r["moment_bytes"] == 0
    assert r["param_bytes"] == 400 and r["grad_bytes"] == 0


def _stepped_twice(**kwargs):
    p = torch.nn.Parameter(torch.randn(64, 64))
    opt = po.AdamW([p], **kwargs)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    return opt


def test_host_offload_of_cpu_params_warns_once_that_it_holds_the_state_twice(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"offload='host' with params on the CPU keeps every "
                                            r"page twice.*saves no memory") as caught:
        opt = _stepped_twice(offload="host")
    assert len([w for w in caught if "offload='host'" in str(w.message)]) == 1
    placement = opt.memory_report()["state_placement"]
    assert placement["host"] == placement["host_tier"] > 0  # what the warning says

    import warnings
    from pagedoptim import paging
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _stepped_twice()
        _stepped_twice(offload="nvme", nvme_dir=str(tmp_path))
        with paging.simulated_device():  # the cache stands for device memory there
            _stepped_twice(offload="host")
    assert not [w for w in caught if "offload='host'" in str(w.message)]
