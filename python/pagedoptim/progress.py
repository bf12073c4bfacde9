"""Progress of a command that runs in a few phases, on stderr.

On a terminal each phase draws a bar that is redrawn in place. Anywhere else (a log file, a
CI job, a pipe) nothing is drawn while a phase runs and one line is written when it ends,
so a logged run shows one line per phase however many steps each phase has.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator, Optional, TextIO


class PhaseProgress:
    _BAR_WIDTH = 30

    def __init__(self, total_phases: int, *, stream: Optional[TextIO] = None,
                 interactive: Optional[bool] = None):
        self._stream = stream if stream is not None else sys.stderr
        self._interactive = self._stream.isatty() if interactive is None else interactive
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
