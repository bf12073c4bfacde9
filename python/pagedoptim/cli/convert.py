"""`python -m pagedoptim convert`: an optimizer checkpoint file from pagedoptim's state format
to torch.optim's, or back.

  python -m pagedoptim convert optimizer.pt torch_optimizer.pt --to torch
  python -m pagedoptim convert torch_optimizer.pt optimizer.pt --to pagedoptim --state-bits 8

INPUT is a file written by torch.save holding an optimizer state_dict (HF Trainer's
optimizer.pt and Accelerate's optimizer.bin are one), or a dict that holds one under a key,
such as a training checkpoint {"model": ..., "optimizer": ...} (--key names the key when
several values are optimizer state_dicts). It is read with torch.load(weights_only=True):
tensors, numbers, strings and containers, nothing that runs code. OUTPUT is the same
structure with the optimizer state converted and everything else unchanged, written to a
temporary file beside OUTPUT and renamed onto it, so a failed run leaves no partial OUTPUT.

--to torch: companded moments (X_codes + X_scales) are dequantized to fp32 X and master
residuals dropped, as opt.torch_state_dict() does; torch.optim.AdamW / torch.optim.SGD load
the result. Lion's and SkewAdam's fp32 form is the same, for optimizers outside torch.optim.
--to pagedoptim --state-bits 8|32: moments become companded codes + scales (8) or fp32 (32),
as pagedoptim's optimizer with that state_bits keeps them. (pagedoptim's optimizers also
convert a torch checkpoint as they load it; converting the file first makes it small.)

The algorithm is read from the param_groups and state keys, or given with --algorithm. The
model is not needed: the state tensors are saved shaped like their parameters. A
torch.optim.Adam checkpoint with weight decay is refused for --to pagedoptim: its decay is
coupled (L2 through the gradient), pagedoptim.AdamW's decoupled.

Exit status: 0 converted; 1 error (message on stderr, OUTPUT untouched); 2 bad command line;
3 INPUT is already in the target format: nothing is written, rather than a copy, so that a
wrong INPUT or --to is noticed, and a script that only needs the format can accept 3.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Mapping
from typing import Any, Optional

import torch

from pagedoptim.checkpoint import (atomic_file, algorithms as checkpoint_algorithms,
                                    conversion as checkpoint_conversion)
from pagedoptim.checkpoint.conversion import AlreadyInTargetFormat

EXIT_ERROR = 1
EXIT_ALREADY_IN_TARGET_FORMAT = 3


class ConvertError(Exception):
    """A failure the user can fix, reported as one line without a traceback."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=pathlib.Path, help="checkpoint file to read")
    parser.add_argument("output", type=pathlib.Path, help="file to write (replaced if it exists)")
    parser.add_argument("--to", required=True, choices=("torch", "pagedoptim"),
                        help="the format to convert to")
    parser.add_argument("--state-bits", type=int, choices=checkpoint_conversion.STATE_BITS,
                        help="with --to pagedoptim: 8 (companded, the default of pagedoptim's "
                             "optimizers) or 32 (fp32)")
    parser.add_argument("--min-8bit-size", type=int,
                        default=checkpoint_conversion.state_format.DEFAULT_MIN_8BIT_SIZE,
                        help="with --state-bits 8: params with fewer elements (and 1-D ones) "
                             "keep fp32 moments, as the optimizer with this min_8bit_size "
                             "keeps them (default: %(default)s, the optimizers' default)")
    parser.add_argument("--algorithm", choices=checkpoint_algorithms.KINDS,
                        help="the optimizer that saved INPUT (default: read from INPUT)")
    parser.add_argument("--key", help="the key of the optimizer state_dict inside INPUT "
                                      "(default: INPUT is one, or holds exactly one)")


def run(args: argparse.Namespace) -> int:
    try:
        if args.to == "pagedoptim" and args.state_bits is None:
            raise ConvertError("--to pagedoptim needs --state-bits 8 or --state-bits 32")
        if args.to == "torch" and args.state_bits is not None:
            raise ConvertError("--state-bits applies to --to pagedoptim only; torch.optim's "
                               "format is fp32")
        checkpoint = load_checkpoint(args.input)
        key = find_state_dict(checkpoint, args.key, args.input)
        state_dict = checkpoint if key is None else checkpoint[key]
        algorithm = resolve_algorithm(state_dict, args.algorithm, args.input)
        if args.to == "torch":
            converted = checkpoint_conversion.to_torch_format(state_dict, algorithm)
        else:
            converted = checkpoint_conversion.to_pagedoptim_format(
                state_dict, algorithm, args.state_bits, min_8bit_size=args.min_8bit_size)
        save_atomically(converted if key is None else {**checkpoint, key: converted},
                        args.output)
        target = ("torch.optim's format" if args.to == "torch"
                  else f"pagedoptim's state_bits={args.state_bits} format")
    except AlreadyInTargetFormat as error:
        print(f"{args.input}: {error}; nothing written", file=sys.stderr)
        return EXIT_ALREADY_IN_TARGET_FORMAT
    except (ConvertError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_ERROR
    print(f"wrote {args.output}: {algorithm} optimizer state in {target}")
    return 0


def load_checkpoint(path: pathlib.Path) -> Any:
    if not path.exists():
        raise ConvertError(f"INPUT {path} does not exist")
    if path.is_dir():
        raise ConvertError(f"INPUT {path} is a directory; expected a file written by "
                           "torch.save (distributed checkpoint directories are not supported)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load raises many types for a file it cannot read
        raise ConvertError(f"INPUT {path} could not be read by torch.load(weights_only=True): "
                           f"{type(error).__name__}: {error}") from error


def find_state_dict(checkpoint: Any, key: Optional[str], path: pathlib.Path) -> Optional[str]:
    """Where in `checkpoint` the optimizer state_dict is: None for the checkpoint itself,
    else its key."""
    is_state_dict = checkpoint_algorithms.is_optimizer_state_dict
    if key is not None:
        if not isinstance(checkpoint, Mapping) or key not in checkpoint:
            keys = sorted(map(str, checkpoint)) if isinstance(checkpoint, Mapping) else []
            raise ConvertError(f"--key {key!r}: INPUT {path} has no such key (its keys: {keys})")
        if not is_state_dict(checkpoint[key]):
            raise ConvertError(f"--key {key!r}: INPUT {path}[{key!r}] is not an optimizer "
                               "state_dict (a dict with 'state' and 'param_groups')")
        return key
    if is_state_dict(checkpoint):
        return None
    candidates = ([k for k, value in checkpoint.items() if is_state_dict(value)]
                  if isinstance(checkpoint, Mapping) else [])
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        raise ConvertError(f"INPUT {path} holds several optimizer state_dicts, under "
                           f"{candidates}; choose one with --key")
    holds = (f"a dict with keys {sorted(map(str, checkpoint))}"
             if isinstance(checkpoint, Mapping) else type(checkpoint).__name__)
    raise ConvertError(f"INPUT {path} is not an optimizer checkpoint: expected an optimizer "
                       f"state_dict (a dict with 'state' and 'param_groups') or a dict "
                       f"holding one, got {holds}")


def resolve_algorithm(state_dict: Mapping[str, Any], given: Optional[str],
                      path: pathlib.Path) -> str:
    if given is not None:
        mismatch = checkpoint_algorithms.algorithm_mismatch(given, state_dict)
        if mismatch is not None:
            raise ConvertError(f"--algorithm {given} does not fit INPUT {path}: {mismatch}")
        return given
    identified = checkpoint_algorithms.identify_algorithm(state_dict)
    if identified == checkpoint_algorithms.OTHER:
        raise ConvertError(f"INPUT {path}: "
                           f"{checkpoint_algorithms.algorithm_mismatch('adamw', state_dict)}; "
                           "convert knows pagedoptim's algorithms "
                           f"({'|'.join(checkpoint_algorithms.KINDS)}) only")
    if identified is None:
        raise ConvertError(f"cannot tell which optimizer saved INPUT {path} (neither its "
                           "param_groups keys nor its state keys say); pass --algorithm "
                           f"{'|'.join(checkpoint_algorithms.KINDS)}")
    return identified


def save_atomically(obj: Any, path: pathlib.Path) -> None:
    """torch.save(obj, path), all or nothing (pagedoptim/checkpoint/atomic_file.py): the bytes go to a
    temporary file in the same directory, are flushed to disk, and only then replace
    `path`."""
    directory = path.parent
    if not directory.is_dir():
        raise ConvertError(f"OUTPUT {path}: directory {directory} does not exist")
    try:
        with atomic_file.atomic_write(path) as handle:
            torch.save(obj, handle)
    except OSError as error:
        raise ConvertError(f"OUTPUT {path} could not be written: {error}") from error
