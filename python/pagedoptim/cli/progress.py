"""Progress on stderr that a terminal shows live and a log keeps short.

A bar redraws itself with carriage returns; written to a file or a pipe, each redraw becomes
a line of its own (tqdm's bar for 300 steps logs hundreds of them). So where the stream is
not a terminal, progress is a few whole lines and nothing in between. Two shapes:

- `progress_bar(total, desc)`: a long loop (the demo's training runs), with tqdm's
  interface; in a log, one line at each quarter of the work.
- `PhaseProgress(n)`: a command that runs in a few phases (bench); on a terminal each phase
  draws a bar, in a log each phase writes one line when it ends.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator, Optional, TextIO

# The fractions of the work at which a log gets a line.
LOG_MILESTONES = (0.25, 0.5, 0.75, 1.0)


class TerminalProgressBar:
    """The subset of tqdm's interface used by our commands, drawn with carriage returns:
    for terminals without tqdm installed."""

    _WIDTH = 30

    def __init__(self, total: int, desc: str, stream: TextIO):
        self._total, self._desc, self._stream = total, desc, stream
        self._done, self._postfix = 0, ""
        self._drawn_fraction = -1.0

    def set_postfix_str(self, postfix: str) -> None:
        self._postfix = postfix

    def update(self, count: int) -> None:
        self._done += count
        fraction = self._done / self._total
        # Redraw on each visible change only: a terminal's scrollback keeps what is written.
        if fraction - self._drawn_fraction >= 1 / self._WIDTH or self._done == self._total:
            self._drawn_fraction = fraction
            filled = int(fraction * self._WIDTH)
            bar = "#" * filled + "." * (self._WIDTH - filled)
            self._stream.write(f"\r{self._desc} [{bar}] {self._done}/{self._total} {self._postfix}")
            self._stream.flush()

    def close(self) -> None:
        self._stream.write("\n")
        self._stream.flush()


class LogProgress:
    """The same interface, writing one whole line at each of LOG_MILESTONES: at most four
    lines however long the loop, each readable on its own in a CI log."""

    def __init__(self, total: int, desc: str, stream: TextIO):
        self._total, self._desc, self._stream = total, desc, stream
        self._done, self._postfix = 0, ""
        self._next_milestone = 0
        self._start = time.perf_counter()

    def set_postfix_str(self, postfix: str) -> None:
        self._postfix = postfix

    def update(self, count: int) -> None:
        self._done += count
        reached = None
        # A short loop can pass several milestones in one update; it gets one line for them.
        while (self._next_milestone < len(LOG_MILESTONES)
               and self._done >= LOG_MILESTONES[self._next_milestone] * self._total):
            reached = LOG_MILESTONES[self._next_milestone]
            self._next_milestone += 1
        if reached is not None:
            elapsed = time.perf_counter() - self._start
            postfix = f", {self._postfix}" if self._postfix else ""
            self._stream.write(f"{self._desc}: {self._done}/{self._total} ({reached:.0%}) "
                               f"after {elapsed:.1f} s{postfix}\n")
            self._stream.flush()

    def close(self) -> None:
        pass  # every line written is already complete


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def progress_bar(total: int, desc: str, stream: Optional[TextIO] = None):
    """A progress display for `total` steps on `stream` (default: stderr), with tqdm's
    update / set_postfix_str / close: tqdm's bar on a terminal (ours without tqdm), a few
    lines otherwise."""
    if total < 1:
        raise ValueError(f"total must be >= 1 step, got {total}")
    stream = sys.stderr if stream is None else stream
    if not _is_terminal(stream):
        return LogProgress(total, desc, stream)
    try:
        from tqdm import tqdm
    except ImportError:
        return TerminalProgressBar(total, desc, stream)
    return tqdm(total=total, desc=desc, file=stream)


class PhaseProgress:
    _BAR_WIDTH = 30

    def __init__(self, total_phases: int, *, stream: Optional[TextIO] = None,
                 interactive: Optional[bool] = None):
        self._stream = stream if stream is not None else sys.stderr
        self._interactive = _is_terminal(self._stream) if interactive is None else interactive
        self._total_phases = total_phases
        self._phase_index = 0

    def _prefix(self, name: str) -> str:
        return f"[{self._phase_index}/{self._total_phases}] {name}"

    def skip(self, name: str, reason: str) -> None:
        """A phase that does not run here, with why: one line in both modes."""
        self._phase_index += 1
        self._write_line(f"{self._prefix(name)}: skipped ({reason})")

    @contextlib.contextmanager
    def phase(self, name: str, steps: int = 1) -> Iterator[Callable[[], None]]:
        """Yields `advance()`, to be called once per finished step of the phase. The line
        for the phase ends with its wall time, or with "failed" when the block raises."""
        self._phase_index += 1
        prefix = self._prefix(name)
        done = 0
        start = time.perf_counter()

        def draw() -> None:
            filled = min(self._BAR_WIDTH, done * self._BAR_WIDTH // max(steps, 1))
            bar = "#" * filled + "." * (self._BAR_WIDTH - filled)
            self._stream.write(f"\r{prefix} [{bar}] {done}/{steps}")
            self._stream.flush()

        def advance() -> None:
            nonlocal done
            done += 1
            if self._interactive:
                draw()

        if self._interactive:
            draw()
        try:
            yield advance
        except BaseException:
            self._end(prefix, "failed")
            raise
        self._end(prefix, f"done in {time.perf_counter() - start:.1f} s")

    def _end(self, prefix: str, outcome: str) -> None:
        if self._interactive:
            # Clear the bar's line (it may be longer than the final one) and finish it.
            self._stream.write("\r\033[K")
        self._write_line(f"{prefix}: {outcome}")

    def _write_line(self, text: str) -> None:
        self._stream.write(text + "\n")
        self._stream.flush()
