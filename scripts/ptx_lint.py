#!/usr/bin/env python3
"""Lints the PTX of the CUDA kernels for the numerics of the CPU <-> CUDA contract.

Bit-identity with the CPU kernels needs IEEE division and square root, kept denormals and no
multiply-add the source did not write (DESIGN.md section 7). The flags asking for that live in
cmake/cuda_kernel_flags.txt, which the CMake target reads too; this script compiles each
kernel source to PTX with them and fails on any instruction that breaks the contract:

    .approx            approximate math (sqrt, rcp, div, ex2, lg2, sin, ...)
    .ftz               denormals flushed to zero
    div.full           division correct to 2 ulp only, not IEEE
    mul/add/sub/mad    float forms without a rounding modifier (.rn/.rz/.rm/.rp): ptxas may
                       contract those into fma; with -fmad=false nvcc writes .rn forms

    scripts/ptx_lint.py [--nvcc NVCC] [--arch compute_90] [SOURCE.cu ...]
    scripts/ptx_lint.py --ptx FILE.ptx ...        # lint PTX compiled elsewhere
    scripts/ptx_lint.py --self-test               # the rules against known PTX, no nvcc
    scripts/ptx_lint.py --compile-commands build/compile_commands.json
                                                  # also check CMake compiled with the flags

Violations go to stderr as `ptx:line: source:line: rule: instruction`, then one JSON line on
stdout sums up the run. Exit status 1 when anything is found, 2 when nvcc fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS_FILE = ROOT / "cmake" / "cuda_kernel_flags.txt"
DEFAULT_SOURCES = ("csrc/kernels/cuda/table_kernels.cu",)
INCLUDE_DIRS = ("include", "csrc")
# What CMake's Release configuration adds to every CUDA compile (CMAKE_CUDA_FLAGS_RELEASE):
# NDEBUG removes device asserts, which changes the code around them.
RELEASE_FLAGS = ("-O3", "-DNDEBUG")
# -lineinfo only adds .loc directives, so violations can name the source line; it changes no
# instruction (unlike -G).
LINT_ONLY_FLAGS = ("-lineinfo",)

FLOAT_TYPES = {"f16", "f16x2", "bf16", "bf16x2", "f32", "f64"}
ROUNDINGS = {"rn", "rz", "rm", "rp"}
# Float arithmetic that ptxas may fuse into an fma when it carries no rounding modifier.
CONTRACTIBLE = {"mul", "add", "sub", "mad"}


def kernel_flags(path: Path = FLAGS_FILE) -> list[str]:
    """The nvcc flags of the kernels: the lines of `path` that begin with '-', as CMake reads
    them (file(STRINGS ... REGEX "^-"))."""
    return [line.strip() for line in path.read_text().splitlines() if line.startswith("-")]


def _shown(path: Path) -> str:
    """`path` relative to the checkout when inside it, else as it is."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


@dataclass
class Report:
    instructions: int = 0
    fma: int = 0
    violations: list[str] = field(default_factory=list)


def _rules(opcode: str) -> list[str]:
    parts = opcode.split(".")
    base, modifiers = parts[0], set(parts[1:])
    broken = []
    if "approx" in modifiers:
        broken.append(".approx")
    if "ftz" in modifiers:
        broken.append(".ftz")
    if base == "div" and "full" in modifiers:
        broken.append("div.full")
    if base in CONTRACTIBLE and modifiers & FLOAT_TYPES and not modifiers & ROUNDINGS:
        broken.append("unrounded float " + base)
    return broken


def lint_ptx(text: str, name: str, report: Report) -> None:
    """Adds the instructions of one PTX text to `report`."""
    # nvcc writes the .file table after the functions, so it is read first.
    files = dict(re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]*)"', text, re.MULTILINE))
    where = "?"
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("//", 1)[0]
        # nvcc writes one statement per line; inline asm may put a braced block on one.
        for statement in line.split(";"):
            statement = statement.strip().lstrip("{}").strip()
            if not statement:
                continue
            if statement.startswith(".loc"):
                fields = statement.split()
                if len(fields) >= 3:
                    source = files.get(fields[1], "file" + fields[1])
                    where = f"{_shown(Path(source))}:{fields[2]}"
                continue
            if statement.startswith(".") or statement.endswith(":") or statement == "}":
                continue  # a directive or a label
            tokens = statement.split()
            if tokens[0].startswith("@"):  # a guard predicate, @%p1 or @!%p1
                tokens = tokens[1:]
            if not tokens:
                continue
            opcode = tokens[0]
            report.instructions += 1
            if opcode.startswith("fma."):
                report.fma += 1
            for rule in _rules(opcode):
                report.violations.append(f"{name}:{number}: {where}: {rule}: {raw.strip()}")


def compile_ptx(nvcc: str, source: Path, arch: str, out: Path) -> None:
    command = [nvcc, "-ptx", f"-arch={arch}", *kernel_flags(), *RELEASE_FLAGS, *LINT_ONLY_FLAGS]
    command += [f"-I{ROOT / d}" for d in INCLUDE_DIRS]
    command += [str(source), "-o", str(out)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.stderr.write(f"ptx_lint: nvcc failed on {source}:\n{shlex.join(command)}\n"
                         f"{result.stdout}{result.stderr}")
        sys.exit(2)


def check_compile_commands(path: Path, sources: list[Path]) -> list[str]:
    """Problems with how CMake compiled `sources`: a source missing from `path`, or compiled
    without the flags of cmake/cuda_kernel_flags.txt in their order."""
    wanted = kernel_flags()
    entries = {str(Path(e["file"]).resolve()): e for e in json.loads(path.read_text())}
    problems = []
    for source in sources:
        entry = entries.get(str(source.resolve()))
        if entry is None:
            problems.append(f"{path}: no compile command for {source}")
            continue
        args = entry.get("arguments") or shlex.split(entry["command"])
        for start in range(len(args)):
            if args[start:start + len(wanted)] == wanted:
                break
        else:
            problems.append(f"{path}: {source} is compiled without {shlex.join(wanted)}: "
                            f"{shlex.join(args)}")
    return problems


SELF_TEST_PTX = """\
.version 9.0
.target sm_90
.address_size 64
.visible .entry k(.param .u64 k_param_0)
{
\t.reg .pred %p<2>;
\t.reg .f32 %f<9>;
\t.loc\t1 10 3
\tmul.rn.f32 %f3, %f1, %f2;
\tadd.rn.f64 %fd3, %fd1, %fd2;
\tfma.rn.f32 %f4, %f1, %f2, %f3;
\tmul.lo.s32 %r3, %r1, %r2;
\tadd.s64 %rd3, %rd1, %rd2;
\tmul.wide.u32 %rd4, %r1, 4;
\tsqrt.rn.f32 %f5, %f4;
\tdiv.rn.f32 %f6, %f5, %f4;
\tcvt.rn.f32.f64 %f7, %fd3;
$L__BB0_1:
\t.loc\t1 11 5
\tmul.f32 %f8, %f1, %f2;
\t@%p1 add.f64 %fd4, %fd1, %fd2;
\tsub.f32 %f8, %f8, %f1; // unrounded
\tsqrt.approx.f32 %f5, %f4;
\tex2.approx.ftz.f32 %f6, %f5;
\tdiv.full.f32 %f6, %f5, %f4;
\tmax.ftz.f32 %f7, %f6, %f5;
\t{ .reg .b32 t; add.rn.f32 %f1, %f2, %f3; mad.f32 %f2, %f3, %f4, %f5; }
\tret;
}
\t.file\t1 "/src/kernels/body.h"
"""

SELF_TEST_EXPECTED = [
    ("self-test.ptx:20", "body.h:11", "unrounded float mul"),
    ("self-test.ptx:21", "body.h:11", "unrounded float add"),
    ("self-test.ptx:22", "body.h:11", "unrounded float sub"),
    ("self-test.ptx:23", "body.h:11", ".approx"),
    ("self-test.ptx:24", "body.h:11", ".approx"),
    ("self-test.ptx:24", "body.h:11", ".ftz"),
    ("self-test.ptx:25", "body.h:11", "div.full"),
    ("self-test.ptx:26", "body.h:11", ".ftz"),
    ("self-test.ptx:27", "body.h:11", "unrounded float mad"),
]


def self_test() -> int:
    report = Report()
    lint_ptx(SELF_TEST_PTX, "self-test.ptx", report)
    found = [tuple(v.split(": ", 3)[:3]) for v in report.violations]
    found = [(ptx, source.rsplit("/", 1)[-1], rule) for ptx, source, rule in found]
    failures = []
    if found != SELF_TEST_EXPECTED:
        failures.append(f"violations {found}, expected {SELF_TEST_EXPECTED}")
    # Every statement of the body but the directives and the label.
    if report.instructions != 19 or report.fma != 1:
        failures.append(f"counted {report.instructions} instructions and {report.fma} fma, "
                        "expected 19 and 1")
    for failure in failures:
        print(f"ptx_lint self-test: {failure}", file=sys.stderr)
    print(json.dumps({"self_test": "failed" if failures else "passed",
                      "instructions": report.instructions, "fma": report.fma,
                      "violations": len(report.violations)}))
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="*", type=Path,
                        help=f"kernel sources (default: {' '.join(DEFAULT_SOURCES)})")
    parser.add_argument("--nvcc", default=os.environ.get("CUDACXX") or shutil.which("nvcc"))
    parser.add_argument("--arch", default="compute_90", help="virtual architecture of the PTX")
    parser.add_argument("--ptx", nargs="+", type=Path, help="lint these PTX files instead")
    parser.add_argument("--keep", type=Path, help="write the PTX into this directory")
    parser.add_argument("--compile-commands", type=Path,
                        help="CMake's compile_commands.json: check the sources' flags there")
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()

    if args.self_test:
        return self_test()

    report = Report()
    problems: list[str] = []
    sources = [s if s.is_absolute() else Path.cwd() / s for s in args.sources] or \
        [ROOT / s for s in DEFAULT_SOURCES]
    if args.ptx:
        for ptx in args.ptx:
            lint_ptx(ptx.read_text(), str(ptx), report)
    else:
        if not args.nvcc:
            print("ptx_lint: no nvcc (give --nvcc, or set CUDACXX or PATH)", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory() as scratch:
            out_dir = args.keep or Path(scratch)
            out_dir.mkdir(parents=True, exist_ok=True)
            for source in sources:
                out = out_dir / (source.stem + ".ptx")
                compile_ptx(args.nvcc, source, args.arch, out)
                lint_ptx(out.read_text(), str(out), report)
    if args.compile_commands:
        problems = check_compile_commands(args.compile_commands, sources)

    for line in report.violations + problems:
        print(line, file=sys.stderr)
    print(json.dumps({
        "arch": None if args.ptx else args.arch,
        "files": [str(p) for p in args.ptx] if args.ptx else
                 [_shown(p) for p in sources],
        "instructions": report.instructions,
        "fma": report.fma,
        "violations": len(report.violations),
        "flag_mismatches": len(problems),
    }))
    return 1 if report.violations or problems else 0


if __name__ == "__main__":
    sys.exit(main())
