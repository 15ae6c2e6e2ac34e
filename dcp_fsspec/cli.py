"""The ``dcp-fsspec`` command line (also ``python -m dcp_fsspec``): one subcommand per job.

Each subcommand lives in its own module, which adds its options and runs it, so this file stays
a table of subcommands, plus the one place where errors become exit codes (listed in
:mod:`dcp_fsspec.tools._cli` and in ``--help``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import demo
from ._version import __version__
from .errors import DcpFsspecError
from .tools import _cli, convert, inspection, listing, prune, transfer, verify

Command = Callable[[argparse.Namespace], int]

# name, module (for its description), add_arguments, run, one-line help
_TOOLS: list[tuple[str, Any, Callable[[argparse.ArgumentParser], None], Command, str]] = [
    ("ls", listing, listing.add_arguments, listing.main,
     "list the iterations under a save_dirname: latest, committed or not, size, age"),
    ("inspect", inspection, inspection.add_arguments, inspection.main,
     "show the keys, tensors, dtypes, shapes and bytes of a checkpoint"),
    ("verify", verify, verify.add_arguments, verify.main,
     "check every file and every tensor's CRC-32 without loading; exit 1 on any problem"),
    ("cp", transfer, transfer.add_arguments, transfer.main,
     "copy a checkpoint or a whole run between any two URLs, committing last"),
    ("prune", prune, prune.add_arguments, prune.main,
     "delete all but the newest N committed iterations (never the latest)"),
    ("to-torch", convert, convert.add_arguments, convert.main_to_torch,
     "convert a checkpoint to one torch.save file"),
    ("to-safetensors", convert, convert.add_arguments, convert.main_to_safetensors,
     "convert a checkpoint's tensors to one .safetensors file (needs safetensors)"),
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="dcp-fsspec",
        description="torch.distributed.checkpoint on any fsspec URL, and a training checkpointer.",
        epilog=_cli.EXIT_CODES_HELP + "\n\nURLs are any fsspec URL or local path; credentials come from the "
        "usual environment, or --storage-options JSON.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the checkpointer and the tools do")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module, add_arguments, run, help_text in _TOOLS:
        sub = commands.add_parser(
            name, help=help_text, description=_summary(module), epilog=_cli.EXIT_CODES_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )  # fmt: skip
        add_arguments(sub)
        sub.set_defaults(run=_reporting_errors(run))
    demo_parser = commands.add_parser(
        "demo",
        help="train a small model, checkpoint to an embedded S3, resume in a fresh process, compare bitwise",
        description=(demo.__doc__ or "").split("\n\n", 1)[-1],
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=_reporting_errors(demo.main))
    return parser


def _summary(module: Any) -> str:
    """A tool module's first docstring line, as plain text, for its ``--help``."""
    return (module.__doc__ or "").strip().split("\n", 1)[0].replace("``", "")


def _reporting_errors(run: Command) -> Command:
    """Run a tool; its errors become one line on stderr and the exit code for their kind."""

    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except (DcpFsspecError, OSError) as e:
            print(f"dcp-fsspec {args.command}: error: {e}", file=sys.stderr)
            return _cli.exit_code_for(e)

    return wrapped


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand, return its exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return int(args.run(args))
