#!/usr/bin/env python3
"""Checks that no code compiled for a CPU ISA can run before the dispatcher has chosen it.

The CPU kernels are compiled once per ISA (baseline, AVX2, AVX-512) and one is chosen at
run time (csrc/kernels/cpu/dispatch.cpp). Two things defeat that choice without any test
of the kernels noticing on a machine that has every ISA:

  * load-time code: the loader runs every static initializer of every translation unit,
    whatever CPU it is on. An initializer in an AVX-512 translation unit is AVX-512 code run
    on an AVX2 CPU (`import pagedoptim` died with SIGILL that way: a table built by a
    constructor, vectorized with AVX-512);
  * shared inline code: an inline function or template instantiated in an ISA translation
    unit outside that ISA's namespace is a weak definition the linker may pick for every
    caller, the baseline code's included.

Checks, on ELF files (readelf and objdump from binutils):

  --isa-objects OBJ...  objects compiled with ISA flags: no initializer sections at all
                        (.init_array, .ctors, .preinit_array), and every function holding an
                        AVX-class instruction belongs to an ISA namespace
                        (pagedoptim::kernels::avx2:: or ::avx512::);
  --binary ELF...       a linked module or executable: the code every load-time initializer
                        runs (followed through direct calls and jumps) holds no AVX-class
                        instruction and enters no ISA namespace, and every function holding
                        an AVX-class instruction belongs to an ISA namespace.

AVX-class means VEX or EVEX encoded (every such mnemonic begins with 'v' in AT&T syntax) or
naming a ymm, zmm or opmask register. SSE2 and below is x86-64's baseline, which every
x86-64 CPU runs. Exits 1 and prints each violation; 0 with a summary line otherwise.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import re
import subprocess
import sys
from typing import Iterable, Optional

ISA_NAMESPACE = re.compile(r"pagedoptim::kernels::(avx2|avx512)::")
# The functions the loader calls when the module loads, and when the process exits.
INITIALIZER_SECTIONS = (".init_array", ".ctors", ".preinit_array", ".fini_array", ".dtors")
_AVX_REGISTER = re.compile(r"%(?:[yz]mm\d+|k[0-7])\b")
# Instruction prefixes objdump prints before the mnemonic.
_PREFIXES = {"lock", "rep", "repz", "repe", "repnz", "repne", "notrack", "bnd", "data16",
             "addr32", "cs", "ds", "es", "ss", "fs", "gs", "xacquire", "xrelease", "rex",
             "rex.w", "rex.b", "rex.r", "rex.x"}
_FUNCTION_HEADER = re.compile(r"^([0-9a-f]+) <(.+)>:$")
_INSTRUCTION = re.compile(r"^\s+([0-9a-f]+):\s+(.*)$")
_BRANCH_TARGET = re.compile(r"^([0-9a-f]+) <(.+?)(\+0x[0-9a-f]+)?>$")


@dataclasses.dataclass
class Function:
    name: str
    address: int
    section: str
    avx_instruction: Optional[str] = None  # the first one met, for the report
    branch_targets: list[int] = dataclasses.field(default_factory=list)


def run_tool(*argv: str) -> str:
    try:
        return subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    except FileNotFoundError:
        sys.exit(f"check_isa_objects: {argv[0]} not found (binutils is needed)")
    except subprocess.CalledProcessError as error:
        sys.exit(f"check_isa_objects: {' '.join(argv)} failed: {error.stderr.strip()}")


def split_instruction(text: str) -> tuple[str, str]:
    """(mnemonic, operands) of one instruction as objdump prints it, prefixes dropped."""
    words = text.split(None, 1)
    while len(words) == 2 and words[0] in _PREFIXES:
        words = words[1].split(None, 1)
    if not words:
        return "", ""
    return words[0], words[1].strip() if len(words) == 2 else ""


def is_avx_instruction(mnemonic: str, operands: str) -> bool:
    return mnemonic.startswith("v") or bool(_AVX_REGISTER.search(operands))


def disassemble(path: str) -> list[Function]:
    """Every function objdump finds in the executable sections of `path`, with its first
    AVX-class instruction and the addresses its direct calls and jumps lead to."""
    functions: list[Function] = []
    section = ""
    current: Optional[Function] = None
    for line in run_tool("objdump", "-d", "-w", "-C", "--no-show-raw-insn", path).splitlines():
        if line.startswith("Disassembly of section "):
            section = line[len("Disassembly of section "):].rstrip(":")
            continue
        header = _FUNCTION_HEADER.match(line)
        if header:
            current = Function(header.group(2), int(header.group(1), 16), section)
            functions.append(current)
            continue
        instruction = _INSTRUCTION.match(line)
        if not instruction or current is None:
            continue
        text = instruction.group(2).split("#")[0].strip()
        mnemonic, operands = split_instruction(text)
        if current.avx_instruction is None and is_avx_instruction(mnemonic, operands):
            current.avx_instruction = text
        if mnemonic.startswith(("call", "j")) and operands:
            target = _BRANCH_TARGET.match(operands)
            if target and not target.group(2).endswith("@plt"):
                current.branch_targets.append(int(target.group(1), 16))
    return functions


@dataclasses.dataclass
class Section:
    name: str
    address: int
    offset: int
    size: int


def sections(path: str) -> dict[str, Section]:
    found: dict[str, Section] = {}
    pattern = re.compile(r"^\s*\[\s*\d+\]\s+(\S+)\s+\S+\s+([0-9a-f]+)\s+([0-9a-f]+)\s+([0-9a-f]+)")
    for line in run_tool("readelf", "-S", "-W", path).splitlines():
        match = pattern.match(line)
        if match:
            found[match.group(1)] = Section(match.group(1), int(match.group(2), 16),
                                            int(match.group(3), 16), int(match.group(4), 16))
    return found


def initializer_addresses(path: str, found: dict[str, Section]) -> list[int]:
    """The functions the loader calls: the entries of the initializer (and finalizer) arrays. In a
    position-independent file they are relocations (R_X86_64_RELATIVE, the address in the
    addend); otherwise the words of the section."""
    addresses: set[int] = set()
    arrays = [found[name] for name in INITIALIZER_SECTIONS if name in found]
    if not arrays:
        return []
    inside = lambda offset: any(s.address <= offset < s.address + s.size for s in arrays)
    relocated: set[int] = set()
    relocation = re.compile(r"^([0-9a-f]+)\s+[0-9a-f]+\s+(R_X86_64_\w+)\s+(.*)$")
    for line in run_tool("readelf", "-r", "-W", path).splitlines():
        match = relocation.match(line.strip())
        if not match or not inside(int(match.group(1), 16)):
            continue
        relocated.add(int(match.group(1), 16))
        kind, rest = match.group(2), match.group(3).split()
        if kind != "R_X86_64_RELATIVE":
            sys.exit(f"check_isa_objects: {path}: initializer relocation {kind} at "
                     f"{match.group(1)} is not one this check can follow")
        addresses.add(int(rest[-1], 16))
    with open(path, "rb") as elf:
        for array in arrays:
            elf.seek(array.offset)
            data = elf.read(array.size)
            for at in range(0, len(data) - 7, 8):
                word = int.from_bytes(data[at:at + 8], "little")
                # 0 and -1 are the .ctors list's terminators.
                if array.address + at not in relocated and word not in (0, (1 << 64) - 1):
                    addresses.add(word)
    return sorted(addresses)


def isa_code_outside_namespaces(functions: Iterable[Function]) -> list[str]:
    return [f"{f.name} (section {f.section}) holds `{f.avx_instruction}` but is not in an ISA "
            f"namespace: it is shared code the linker may hand to any caller"
            for f in functions
            if f.avx_instruction is not None and not ISA_NAMESPACE.search(f.name)]


def check_isa_object(path: str) -> list[str]:
    problems = [f"{path}: has a {name} section: a static initializer runs at load time, on "
                f"whatever CPU loads the library (make the object constexpr, or build it on "
                f"first use inside the ISA's code)"
                for name in sections(path) if name in INITIALIZER_SECTIONS
                or name.startswith(tuple(s + "." for s in INITIALIZER_SECTIONS))]
    problems += [f"{path}: {p}" for p in isa_code_outside_namespaces(disassemble(path))]
    return problems


def check_binary(path: str) -> tuple[list[str], int]:
    found = sections(path)
    if ".symtab" not in found:
        sys.exit(f"check_isa_objects: {path} has no symbol table (stripped); build it with one")
    functions = disassemble(path)
    by_address = sorted(functions, key=lambda f: f.address)
    starts = [f.address for f in by_address]

    def function_at(address: int) -> Optional[Function]:
        index = bisect.bisect_right(starts, address) - 1
        return by_address[index] if index >= 0 else None

    problems = [f"{path}: {p}" for p in isa_code_outside_namespaces(functions)]
    roots = initializer_addresses(path, found)
    for root in roots:
        start = function_at(root)
        if start is None or start.address != root:
            problems.append(f"{path}: initializer at {root:#x} is not the start of a function")
            continue
        # Depth-first over direct calls and jumps, keeping the path for the report.
        seen: set[int] = set()
        stack: list[tuple[Function, tuple[str, ...]]] = [(start, (start.name,))]
        while stack:
            function, chain = stack.pop()
            if function.address in seen:
                continue
            seen.add(function.address)
            why = None
            if function.avx_instruction is not None:
                why = f"runs `{function.avx_instruction}`"
            elif ISA_NAMESPACE.search(function.name):
                why = "enters an ISA's code"
            if why:
                problems.append(f"{path}: load- or exit-time function {' -> '.join(chain)} {why}")
                continue
            for target in function.branch_targets:
                callee = function_at(target)
                if callee is not None and callee.address not in seen:
                    stack.append((callee, chain + (callee.name,)))
    return problems, len(roots)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa-objects", nargs="*", default=[], metavar="OBJ",
                        help="objects compiled with ISA flags")
    parser.add_argument("--binary", nargs="*", default=[], metavar="ELF",
                        help="linked modules or executables")
    args = parser.parse_args(argv)
    # CMake hands a target's objects over as one ';'-separated list.
    args.isa_objects = [path for arg in args.isa_objects for path in arg.split(";") if path]
    args.binary = [path for arg in args.binary for path in arg.split(";") if path]
    if not args.isa_objects and not args.binary:
        parser.error("give --isa-objects, --binary or both")
    problems: list[str] = []
    for path in args.isa_objects:
        problems += check_isa_object(path)
    initializers = 0
    for path in args.binary:
        found, count = check_binary(path)
        problems += found
        initializers += count
    for problem in problems:
        print(problem)
    if problems:
        print(f"check_isa_objects: {len(problems)} violation(s)")
        return 1
    print(f"check_isa_objects: {len(args.isa_objects)} ISA object(s) without initializers; "
          f"{len(args.binary)} binary(ies), {initializers} load- and exit-time function(s) free "
          f"of ISA code; AVX-class code only in ISA namespaces")
    return 0


if __name__ == "__main__":
    sys.exit(main())
