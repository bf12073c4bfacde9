"""Steps that fail: how the next step() tells a retry of an interrupted step from a new one.

A native step that raises (a failed read, a checksum error, Ctrl-C at a batch boundary)
leaves a journal in the engine: its plan, how many pages it applied, its parameters. The
step's counters are advanced and its first pages are stepped; the rest are not. Calling
step() again with the same gradients finishes it: the engine steps the remaining pages
only, so params and state end exactly as after a step that never failed. Anything else
(other gradients, params, groups or hyperparameters) would mix two steps, so it raises
InterruptedStepError, which names the ways out. See docs/reliability.md, "Steps that fail".
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch


class InterruptedStepError(RuntimeError):
    """The last step raised before it finished, and this step is not a retry of it."""


def _ref(tensor: torch.Tensor) -> "weakref.ref[torch.Tensor]":
    # Weak: the record must not keep a model's worth of gradients alive after
    # zero_grad(set_to_none=True); a gradient that is gone is not the same gradient.
    return weakref.ref(tensor)


@dataclass
class StepFingerprint:
    """What makes a step() call the same step: every (param, grad, group) it steps, each
    grad's version (in-place accumulation and zero_() bump it; set_to_none makes a new
    tensor), and the groups' hyperparameters."""

    entries: list[tuple[Any, Any, int, int]]
    hyperparameters: list[tuple]

    @classmethod
    def of(cls, pending: list[tuple[torch.Tensor, int, torch.Tensor, dict[str, Any]]],
           hyperparameters: list[tuple]) -> "StepFingerprint":
        return cls([(_ref(p), _ref(grad), grad._version, group_id)
                    for p, group_id, grad, _ in pending], list(hyperparameters))

    def matches(self, pending: list[tuple[torch.Tensor, int, torch.Tensor, dict[str, Any]]],
                hyperparameters: list[tuple]) -> bool:
        if len(pending) != len(self.entries) or list(hyperparameters) != self.hyperparameters:
            return False
        return all(p_ref() is p and grad_ref() is grad and grad._version == version
                   and group_id == saved_group
                   for (p, group_id, grad, _), (p_ref, grad_ref, version, saved_group)
                   in zip(pending, self.entries))


@dataclass
class Interrupted:
    """A step() whose native round `round_index` raised, and what the engine journaled."""

    fingerprint: StepFingerprint
    round_index: int
    error: str  # "PageIOError: ..." as raised


def describe_error(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def refusal(owner: str, journal: dict[str, Any], record: Interrupted) -> InterruptedStepError:
    """The error of a step() after an interrupted one that is not a retry of it."""
    where = (f"the last step of this {owner} was interrupted after {journal['pages_done']} "
             f"of {journal['pages']} pages ({record.error})")
    if not journal["resumable"]:
        return InterruptedStepError(
            f"{where}, and it cannot be finished: a device error left a batch of pages half "
            "stepped. Call optimizer.discard_interrupted_step() to keep the state as it is "
            "and go on, or load a checkpoint.")
    return InterruptedStepError(
        f"{where}: its step counters are advanced and those pages are stepped, the rest "
        "are not. This step has other gradients, params, groups or hyperparameters, so it "
        "is not a retry and would mix two steps. Call step() again with the same gradients "
        "to finish the interrupted step exactly, call optimizer.discard_interrupted_step() "
        "to keep it half applied and go on, or load a checkpoint.")


def plan_rounds(owner: str, engine: Any, record: Optional[Interrupted],
                pending: list[tuple[torch.Tensor, int, torch.Tensor, dict[str, Any]]],
                hyperparameters: list[tuple]) -> tuple[int, bool]:
    """(first native round to run, whether it resumes the engine's journal) for a step()
    over `pending`; raises InterruptedStepError when it is neither a new step nor a retry.
    Rounds before the first one were applied in full by the interrupted call."""
    journal = engine.interrupted_step if engine is not None else None
    if record is None or journal is None:
        if journal is not None:
            engine.discard_interrupted_step()  # journaled outside step(): nothing to retry
        return 0, False
    retry = record.fingerprint.matches(pending, hyperparameters)
    if journal["complete"]:
        # Every page was applied; only an error that surfaced afterwards (a failed
        # write-back) is left. A retry has nothing more to do in that round.
        engine.discard_interrupted_step()
        return (record.round_index + 1, False) if retry else (0, False)
    if not retry or not journal["resumable"]:
        raise refusal(owner, journal, record)
    return record.round_index, True
