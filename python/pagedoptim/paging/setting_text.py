"""Settings written as text: the PAGEDOPTIM_* environment variables and HF Trainer's
`optim_args`. One parser per kind of value, so both read '512MiB' or 'on' the same way.

Each parser raises ValueError saying only what was expected ("a whole number of bytes");
the caller adds which setting it was.
"""

from __future__ import annotations

import argparse
import fractions
import re
from typing import Any, Callable

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")

# Binary units are what memory is counted in (a bare K, M, G or T too, as in `free -g`);
# decimal ones are accepted with their SI meaning rather than guessed to be binary.
SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30,
              "tib": 1 << 40, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
              "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*([a-z]*)")


def parse_byte_size(text: str) -> int:
    """'1GiB' -> 1073741824, '2GB' -> 2000000000, '1.5KiB' -> 1536, '4096' -> 4096."""
    match = _SIZE.fullmatch(text.strip().lower())
    multiplier = SIZE_UNITS.get(match.group(2)) if match else None
    if multiplier is None:
        raise ValueError("expected a number of bytes or a size such as 512MiB, 4GiB or 2GB")
    size = fractions.Fraction(match.group(1)) * multiplier  # exact: no float rounding
    if size.denominator != 1:
        raise ValueError("expected a whole number of bytes")
    return int(size)


def byte_size_argument(text: str) -> int:
    """parse_byte_size as an argparse type (--cache-bytes 64KiB), as the settings read it."""
    try:
        return parse_byte_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None


def parse_bool(text: str) -> bool:
    """on: 1, true, yes, on; off: 0, false, no, off (and empty)."""
    lowered = text.strip().lower()
    if lowered in ON:
        return True
    if lowered in OFF or not lowered:
        return False
    raise ValueError(f"expected one of {', '.join(ON)} (on) or {', '.join(OFF)} (off)")


def parse_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError("expected an integer") from None


def parse_float(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError("expected a number") from None


def optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, with 'none' read as None (master_bits=none, cache_bytes=none)."""
    def parse_or_none(text: str) -> Any:
        return None if text.strip().lower() == "none" else parse(text)
    return parse_or_none
