"""Measurement helpers shared by the benchmark scripts.

Every benchmark here compares against a baseline measured in the same process and relates its
result to a physical limit measured in the same process, because absolute times on shared
machines drift by tens of percent between runs. The helpers below are the pieces for that:
interleaved timing and a memory-bandwidth probe (from the package: pagedoptim.cli.timing,
pagedoptim.cli.memory_bandwidth) and a one-JSON-line-per-result printer.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Optional, TextIO

# The timing and bandwidth helpers live in the package, where `python -m pagedoptim bench`
# uses them too; the scripts here import them from this module as before.
from pagedoptim.cli.memory_bandwidth import MemoryBandwidth, StreamingProbe, measure_memory_bandwidth  # noqa: F401
from pagedoptim.cli.timing import Timing, synchronize, time_interleaved  # noqa: F401


def significant(value: float, digits: int = 4) -> float:
    """Round to `digits` significant digits so JSON lines stay readable."""
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - int(math.floor(math.log10(abs(value)))))


def emit(record: Mapping[str, Any], stream: TextIO = sys.stdout) -> None:
    """Print one result as one JSON line and flush, so partial runs still leave results."""
    stream.write(json.dumps(dict(record)) + "\n")
    stream.flush()


def run_child(script: str, arguments: Sequence[str], env: Optional[Mapping[str, str]] = None) -> dict:
    """Runs `script` under this Python as a child process and returns the JSON record on the
    last line of its output. Benchmarks measure in a fresh process what must not share one
    (an allocator's heap, a paged optimizer's disk). A failed child raises with its stderr."""
    done = subprocess.run([sys.executable, script, *arguments], capture_output=True, text=True,
                          check=False, env=None if env is None else dict(env))
    if done.returncode != 0:
        raise RuntimeError(f"{script} {' '.join(arguments)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])
