"""Command line: `python -m pagedoptim <command> [options]`.

Each command lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
adding one (bench, plan) is one entry in COMMANDS.
"""

from __future__ import annotations

import argparse
import sys

from pagedoptim.cli import bench, convert, demo, plan

# name -> (module, one-line help)
COMMANDS = {
    "demo": (demo, "train a tiny LM with pagedoptim.AdamW and torch.optim.AdamW side by side"),
    "convert": (convert, "convert an optimizer checkpoint between pagedoptim's state format "
                         "and torch.optim's"),
    "plan": (plan, "will a training run fit: memory by component, the settings that fit, "
                   "and the step time, before the first step"),
    "bench": (bench, "measure memory, disk and GPU link bandwidth and each mode's step "
                     "throughput against torch AdamW, for plan"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pagedoptim", description="PagedOptim command line tools.")
    subparsers = parser.add_subparsers(dest="command", metavar="command", title="commands")
    for name, (module, summary) in COMMANDS.items():
        subparser = subparsers.add_parser(
            name, help=summary, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.add_arguments(subparser)
        subparser.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
