"""Writes pickles of stepped optimizers as the version before the package layering (flat
modules: pagedoptim.adamw, pagedoptim.options, pagedoptim.stand_ins, ...) wrote them; the
files beside this script were made by it at that version, and test_package_layers.py checks
that they still load. Run again only to add a case, from a checkout of that version."""

import pathlib
import pickle

import torch

import pagedoptim as po

HERE = pathlib.Path(__file__).resolve().parent


def stepped(make):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 8)), torch.nn.Parameter(torch.randn(33))]
    opt = make(params)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return opt


CASES = {
    "adamw_8bit": lambda ps: po.AdamW(ps, lr=1e-2),
    "sgd_exact": lambda ps: po.SGD(ps, lr=1e-2, momentum=0.9, state_bits=32, master_bits=None),
    "lion_paged": lambda ps: po.Lion(ps, lr=1e-3, offload="nvme", cache_bytes=8192),
    "skewadam": lambda ps: po.SkewAdam([("backbone.w", ps[0]), ("backbone.b", ps[1])]),
}

if __name__ == "__main__":
    for name, make in CASES.items():
        opt = stepped(make)
        (HERE / f"old_pickle_{name}.pkl").write_bytes(pickle.dumps(opt))
    po.patch()
    try:
        opt = stepped(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
        (HERE / "old_pickle_patched_adamw.pkl").write_bytes(pickle.dumps(opt))
    finally:
        po.unpatch()
