"""What `import pagedoptim` adds to `import torch`, each in fresh processes, interleaved.

Under PAGEDOPTIM=1 every script that imports torch also imports pagedoptim, so this is a
cost paid by every run of every such script. Each repetition starts one process that
imports torch and one that imports torch then pagedoptim (alternating, so a busy machine
slows both alike), timing the imports inside the process (no interpreter start-up). One
JSON line: the medians, their difference and the ratio.

    python benchmarks/import_time.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

from utils import emit, significant

_CHILD = """
import time
start = time.perf_counter()
import torch
{extra}
print(time.perf_counter() - start)
"""


def import_seconds(extra: str) -> float:
    done = subprocess.run([sys.executable, "-c", _CHILD.format(extra=extra)],
                          capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch_alone, with_pagedoptim = [], []
    import_seconds("import pagedoptim")  # warm the file cache for both
    for _ in range(args.repeats):
        torch_alone.append(import_seconds(""))
        with_pagedoptim.append(import_seconds("import pagedoptim"))
    baseline, ours = statistics.median(torch_alone), statistics.median(with_pagedoptim)
    emit({"benchmark": "import_time", "repeats": args.repeats,
          "import_torch_s": significant(baseline),
          "import_torch_and_pagedoptim_s": significant(ours),
          "pagedoptim_adds_s": significant(ours - baseline),
          "ratio": significant(ours / baseline)})


if __name__ == "__main__":
    main()
