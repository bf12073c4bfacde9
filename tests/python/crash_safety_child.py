"""The child process of test_crash_safety.py: trains a small NVMe-paged optimizer from its
last checkpoint, checkpointing every few steps, and reports each phase through a pipe so
the parent can kill it in the middle of one. Imported by the forkserver, so that a child
starts in milliseconds instead of re-importing torch.
"""

import pathlib

import torch

import pagedoptim as po
from pagedoptim.checkpoint import atomic_file, stream as checkpoint_stream

SHAPES = [(24_000,), (64, 130), (33,)]
PAGE = 4096
CHECKPOINT_EVERY = 3
MAX_STEPS = 90
CHECKPOINT = "opt.ckpt"


def make_params():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(torch.bfloat16).requires_grad_() for s in SHAPES]


def set_grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def make_optimizer(params, nvme_dir=None):
    """8-bit AdamW with the master split; paged through a 3-page cache when nvme_dir."""
    paging = {} if nvme_dir is None else dict(offload="nvme", nvme_dir=nvme_dir,
                                              page_bytes=PAGE, cache_bytes=3 * PAGE)
    return po.AdamW(params, lr=1e-2, weight_decay=0.1, **paging)


def params_path(workdir, step):
    return pathlib.Path(workdir) / f"params-{step}.pt"


def checkpoint_step(path):
    """The step a checkpoint was taken at (the step counter of param 0)."""
    return int(float(checkpoint_stream.read_header(path).params[0].state["step"]))


def resume(workdir, nvme_dir):
    """(step, params, optimizer) from the last checkpoint, or a fresh start."""
    path = pathlib.Path(workdir) / CHECKPOINT
    if not path.exists():
        params = make_params()
        return 0, params, make_optimizer(params, nvme_dir)
    step = checkpoint_step(path)
    params = [t.requires_grad_() for t in torch.load(params_path(workdir, step),
                                                     weights_only=True)]
    opt = make_optimizer(params, nvme_dir)
    opt.load_checkpoint(path)
    return step, params, opt


def train(workdir, nvme_dir, conn):
    torch.set_num_threads(1)
    step, params, opt = resume(workdir, nvme_dir)
    conn.send(("ready", step))
    while step < MAX_STEPS:
        conn.send(("step", step))
        set_grads(params, step)
        opt.step()
        step += 1
        if step % CHECKPOINT_EVERY:
            continue
        # The params first: a checkpoint's params file exists before the checkpoint does.
        with atomic_file.atomic_write(params_path(workdir, step)) as handle:
            torch.save([p.detach() for p in params], handle)
        conn.send(("checkpoint", step))
        opt.save_checkpoint(pathlib.Path(workdir) / CHECKPOINT)
        conn.send(("saved", step))
        old = params_path(workdir, step - 2 * CHECKPOINT_EVERY)
        old.unlink(missing_ok=True)
    conn.send(("finished", step))
