"""The ``dcp-fsspec`` command line (also ``python -m dcp_fsspec``): one subcommand per job.

For now only ``demo``; each subcommand lives in its own module, which adds its options and runs
it, so this file stays a table of subcommands.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from . import demo


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="dcp-fsspec", description="torch.distributed.checkpoint on any fsspec URL, and a training checkpointer."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the checkpointer does")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo",
        help="train a small model, checkpoint to an embedded S3, resume in a fresh process, compare bitwise",
        description=(demo.__doc__ or "").split("\n\n", 1)[-1],
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand, return its exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return int(args.run(args))
