"""``to-torch`` (and ``to-safetensors``' one-file form): the options, and the command that runs it.

This module does not import torch, so a usage error is reported at once; :mod:`~dcp_fsspec.tools.convert`, which
does the work and needs torch, is imported when the command runs.
"""

from __future__ import annotations

import argparse
from typing import Literal

from dcp_fsspec.tools import _cli
from dcp_fsspec.tools.progress import Progress


def add_arguments(
    parser: argparse.ArgumentParser, out_help: str = "the file to write (any fsspec URL or local path)"
) -> None:
    source = ("url", "a DCP checkpoint, an iteration folder, or a save_dirname (its latest iteration)")
    _cli.add_standard_arguments(parser, source, ("out", out_help), destination=True)
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    _cli.add_trust_flag(parser)
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=None,
        metavar="N",
        help="the most tensor bytes a checkpoint's .metadata may make the conversion hold in memory "
        "(default: this machine's memory); sizes read from storage beyond it are refused before allocating",
    )


def _main(args: argparse.Namespace, fmt: Literal["torch", "safetensors"]) -> int:
    source_options, out_options = _cli.both_storage_options(args, args.url, args.out)
    from dcp_fsspec.tools.convert import (
        MACHINE_MEMORY,
        convert,
    )  # torch: only once the command line is known to be right

    with Progress("converting") as progress:
        result = convert(
            args.url,
            args.out,
            source_options,
            out_options,
            fmt=fmt,
            overwrite=args.overwrite,
            progress=progress,
            trust_checkpoint=args.trust,
            max_bytes=MACHINE_MEMORY if args.max_bytes is None else args.max_bytes,
        )
    _cli.report(args, result.to_dict(), result.lines())
    return _cli.EXIT_OK


def main_to_torch(args: argparse.Namespace) -> int:
    return _main(args, "torch")


def main_to_safetensors(args: argparse.Namespace) -> int:
    return _main(args, "safetensors")
