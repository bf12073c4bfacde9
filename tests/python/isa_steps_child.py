"""The child process of test_emulated_cpus.py: two steps of each CPU kernel family (AdamW,
SGD, Lion, SkewAdam) in each state form (fp32 state, 8-bit state, bf16 and fp16 params with
the 24-bit master), printed as one JSON object: the kernel ISA the dispatcher chose, and a
SHA-256 of every parameter and state tensor after the steps.

The test runs it twice: on an emulated CPU that has only one ISA (qemu-user's CPU models),
where the dispatcher must choose that ISA, and natively with PAGEDOPTIM_CPU_ISA set to it.
Every input is built with exact arithmetic from Python's integer generator, so both runs
start from the same bits whatever vector code torch and libm choose on either CPU.
"""

import ctypes
import hashlib
import json
import random
import sys

import torch

import pagedoptim as po
from pagedoptim import _C

# A matrix of 150 full groups in rows of 3 (AVX2 steps 16 groups a batch, AVX-512 128), one
# row that ends in a partial group, rows of 40 (a full and a partial group each: a page
# segment per row) and a bias (1-D: fp32 moments); SkewAdam also gets its three tiers: a
# [E, rows, cols] expert tensor, a router and a norm (exact second moments). min_8bit_size=0
# gives every matrix 8-bit moments.
SHAPES = {"layers.0.attn.q_proj.weight": (50, 96), "layers.0.attn.k_proj.weight": (1, 1037),
          "layers.0.attn.v_proj.weight": (20, 40), "layers.0.attn.q_proj.bias": (1037,)}
SKEWADAM_SHAPES = {**SHAPES, "layers.0.mlp.experts.gate_up_proj": (4, 16, 40),
                   "layers.0.mlp.gate.weight": (4, 100), "norm.weight": (100,)}
FORMS = {
    "fp32-state": dict(dtype=torch.float32, state_bits=32, master_bits=None),
    "8bit-state": dict(dtype=torch.float32, state_bits=8, master_bits=None),
    "bf16-master24": dict(dtype=torch.bfloat16, state_bits=8, master_bits=24),
    # fp16 takes the generic loops on every ISA, through element access that was once shared
    # between the ISAs' translation units (see csrc/kernels/cpu/element_access.h).
    "fp16-master24": dict(dtype=torch.float16, state_bits=8, master_bits=24),
}
FAMILIES = {
    "adamw": lambda params, **kw: po.AdamW(params, lr=1e-2, weight_decay=0.01, **kw),
    "sgd": lambda params, **kw: po.SGD(params, lr=0.1, momentum=0.9, nesterov=True,
                                       weight_decay=0.01, **kw),
    "lion": lambda params, **kw: po.Lion(params, lr=1e-3, weight_decay=0.1, **kw),
    "skewadam": lambda params, **kw: po.SkewAdam(params, lr=1e-2, weight_decay=0.01, **kw),
}


def exact_values(rng: random.Random, count: int, significant_bits: int) -> list:
    """Values of at most `significant_bits` bits (so exact in the dtype), magnitudes spread
    over 2^-21 .. 2^2 inside every group (the range that stresses the 8-bit scales), and
    about one in thirteen zero."""
    out = []
    for _ in range(count):
        word = rng.getrandbits(40)
        if word % 13 == 0:
            out.append(0.0)
            continue
        mantissa = (word >> 16) % (1 << significant_bits)
        out.append((mantissa / (1 << significant_bits) - 0.5) * 2.0 ** ((word & 0xff) % 24 - 20))
    return out


def tensor(rng: random.Random, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    count = 1
    for size in shape:
        count *= size
    bits = {torch.bfloat16: 8, torch.float16: 11}.get(dtype, 24)
    return torch.tensor(exact_values(rng, count, bits), dtype=torch.float32).reshape(shape).to(dtype)


def digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous()
    return hashlib.sha256(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())).hexdigest()


def run_case(family: str, form: dict) -> dict:
    rng = random.Random(f"{family}/{form['state_bits']}/{form['dtype']}")
    shapes = SKEWADAM_SHAPES if family == "skewadam" else SHAPES
    named = [(name, tensor(rng, shape, form["dtype"]).requires_grad_())
             for name, shape in shapes.items()]
    params = named if family == "skewadam" else [p for _, p in named]
    opt = FAMILIES[family](params, state_bits=form["state_bits"], master_bits=form["master_bits"],
                           min_8bit_size=0)
    for _ in range(2):
        for _, p in named:
            p.grad = tensor(rng, tuple(p.shape), form["dtype"])
        opt.step()
    hashes = {f"param {name}": digest(p) for name, p in named}
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                hashes[f"state {index} {key}"] = digest(value)
    return hashes


def main() -> None:
    torch.set_num_threads(1)
    cases = {f"{family} {form_name}": run_case(family, form)
             for family in FAMILIES for form_name, form in FORMS.items()}
    json.dump({"isa": _C.cpu_isa(), "cases": cases}, sys.stdout)


if __name__ == "__main__":
    main()
