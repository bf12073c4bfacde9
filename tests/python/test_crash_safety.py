"""Crash safety of streaming checkpoints: a training process killed with SIGKILL at random
points, in the middle of a step and in the middle of a checkpoint, always leaves the last
checkpoint intact under its final name, loadable, and continuing bit-identically to a run
that was never killed; no half-written file under the final name, and nothing in nvme_dir.

The child (crash_safety_child.py) reports its phases through a pipe; the parent kills it
a random fraction of a phase's observed duration after the phase began, then checks what
the child left, and restarts it from its checkpoint. Children come from a forkserver that
imported torch once, so the loop of kills stays within seconds.
"""

import multiprocessing
import os
import random
import re
import signal
import time

import pytest
import torch

from pagedoptim.checkpoint import atomic_file, stream as checkpoint_stream

import crash_safety_child as child

KILLS = 20
TIME_BUDGET_S = 60.0
CONTINUE_STEPS = 2


@pytest.fixture(scope="module")
def context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "pagedoptim", "crash_safety_child"])
    return ctx


def reference_run():
    """params and state_dict() after every step of a run that is never interrupted (not
    paged: paging never changes results)."""
    params = child.make_params()
    opt = child.make_optimizer(params)
    snapshots = {}
    for step in range(child.MAX_STEPS + CONTINUE_STEPS):
        child.set_grads(params, step)
        opt.step()
        snapshots[step + 1] = ([p.detach().clone() for p in params], opt.state_dict())
    return snapshots


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b)


def check_continues_like_the_reference(workdir, step, reference):
    """Loads the checkpoint at its final name into a fresh optimizer and steps on."""
    path = workdir / child.CHECKPOINT
    checkpoint_stream.verify(path)
    params = [t.requires_grad_() for t in torch.load(child.params_path(workdir, step),
                                                     weights_only=True)]
    opt = child.make_optimizer(params)
    opt.load_checkpoint(path)
    for index in range(step, step + CONTINUE_STEPS):
        child.set_grads(params, index)
        opt.step()
    ref_params, ref_state = reference[step + CONTINUE_STEPS]
    assert all(same_bits(p, q) for p, q in zip(params, ref_params)), step
    state = opt.state_dict()["state"]
    for index, entry in ref_state["state"].items():
        for key, value in entry.items():
            assert same_bits(state[index][key], value), (step, index, key)


TEMPORARY = re.compile(r"\.(opt\.ckpt|params-\d+\.pt)\.(\d+)\.[0-9a-f]{8}"
                       + re.escape(atomic_file.TEMP_SUFFIX))


def drain(conn):
    """Every message the child sent before it died (a message cut by the kill ends it)."""
    messages = []
    try:
        while conn.poll(0.5):
            messages.append(conn.recv())
    except (EOFError, OSError):
        pass
    return messages


def test_sigkill_anywhere_leaves_the_last_checkpoint_intact(context, tmp_path):
    reference = reference_run()
    workdir, nvme_dir = tmp_path / "run", tmp_path / "nvme"
    workdir.mkdir()
    nvme_dir.mkdir()
    rng = random.Random(0)
    durations = {"step": [], "checkpoint": []}
    landed = {"step": 0, "checkpoint": 0, "between": 0}
    last_saved = None  # the step of the last checkpoint the child reported renamed
    pids_since_save = set()  # children that may have left a temporary of the checkpoint
    kills = 0
    start = time.monotonic()
    while kills < KILLS and time.monotonic() - start < TIME_BUDGET_S:
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(target=child.train, args=(workdir, nvme_dir, sender))
        process.start()
        sender.close()
        pids_since_save.add(process.pid)
        target = "checkpoint" if kills % 2 == 0 else "step"
        began = {}
        killed = False
        last = None
        while not killed:
            try:
                if not receiver.poll(30):
                    pytest.fail(f"the child sent nothing for 30 s after {last}")
                last = receiver.recv()
            except EOFError:
                process.join()
                pytest.fail(f"the child died on its own after {last} "
                            f"(exit code {process.exitcode})")
            phase, step = last
            now = time.monotonic()
            if phase in ("step", "checkpoint"):
                began[phase] = now
            if phase == "checkpoint" and "step" in began:
                durations["step"].append(now - began.pop("step"))
            if phase == "saved":
                durations["checkpoint"].append(now - began.pop("checkpoint"))
                last_saved, pids_since_save = step, {process.pid}
            if phase == "finished":
                break
            if phase == target and len(durations[target]) >= 2:
                # A random point inside the phase, as long as it took before.
                time.sleep(rng.uniform(0.0, 0.9 * min(durations[target][-3:])))
                os.kill(process.pid, signal.SIGKILL)
                killed = True
        process.join()
        rest = drain(receiver)
        receiver.close()
        if not killed:  # the run reached its end: start over from nothing
            for f in workdir.iterdir():
                f.unlink()
            last_saved, pids_since_save = None, set()
            continue
        kills += 1
        for phase, step in rest:  # sent before the kill, read after it
            if phase == "saved":
                last_saved, pids_since_save = step, {process.pid}
        final_phase, final_step = (rest or [last])[-1]
        landed[final_phase if final_phase in ("step", "checkpoint") else "between"] += 1

        # The final name holds a whole checkpoint: the last one reported, or the one being
        # written if the kill fell between its rename and its report.
        path = workdir / child.CHECKPOINT
        if last_saved is None and not path.exists():
            continue
        step = child.checkpoint_step(path)
        in_progress = final_step if final_phase == "checkpoint" else None
        assert step in (last_saved, in_progress), (step, last_saved, in_progress)
        check_continues_like_the_reference(workdir, step, reference)
        if step != last_saved:  # the next child resumes from the one renamed unreported
            last_saved, pids_since_save = step, {process.pid}
        # Nothing else under a final name; temporaries are recognizable, and those of the
        # checkpoint come only from children killed since the last completed save (the
        # next save removes those of dead writers).
        for f in workdir.iterdir():
            if f.name == child.CHECKPOINT or re.fullmatch(r"params-\d+\.pt", f.name):
                continue
            match = TEMPORARY.fullmatch(f.name)
            assert match, f"unexpected file {f.name}"
            if match.group(1) == "opt.ckpt":
                assert int(match.group(2)) in pids_since_save, f.name
        # The page files were unlinked when opened: nothing is left of a killed child.
        assert list(nvme_dir.iterdir()) == []
    elapsed = time.monotonic() - start
    assert kills >= KILLS // 2, f"only {kills} kills in {elapsed:.0f} s"
    # The kills really landed inside both phases (the test can see a torn checkpoint).
    assert landed["checkpoint"] >= 3 and landed["step"] >= 3, landed
