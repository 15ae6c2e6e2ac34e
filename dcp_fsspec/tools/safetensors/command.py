"""``to-safetensors``: a checkpoint's tensors as a sharded safetensors folder (or one file) on any URL.

An OUT ending in ``.safetensors`` is one file, written by :mod:`~dcp_fsspec.tools.convert`. Any other OUT is a
folder in Hugging Face's layout, streamed by :mod:`~dcp_fsspec.tools.safetensors.export`. Both need torch, so they
are imported once the command line is known to be right.
"""

from __future__ import annotations

import argparse
import re

from dcp_fsspec.errors import UsageError
from dcp_fsspec.tools import _cli, convert_options
from dcp_fsspec.tools.progress import Progress

# safetensors_export's DEFAULT_MAX_SHARD_SIZE and OUTPUT_DTYPES' names, here without torch
# (tests/test_cli_startup.py keeps them equal).
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # Hugging Face's "5GB"
OUTPUT_DTYPE_NAMES = ("bf16", "bfloat16", "float16", "float32", "fp16", "fp32")

# The options only a folder export takes, by their argparse names.
_FOLDER_ONLY = {
    "max_shard_size": "--max-shard-size",
    "dtype": "--dtype",
    "key_map": "--key-map",
    "config": "--config",
}


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``"5GB"`` → ``5 * 10**9``, as Hugging Face reads it; ``"500MiB"`` → ``500 * 2**20``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in _UNITS or float(match.group(1)) <= 0:
        raise UsageError(f"--max-shard-size {text!r} is not a size; give bytes or e.g. 5GB, 500MB, 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    convert_options.add_arguments(
        parser,
        "the folder to write (any fsspec URL or local path); a name ending in .safetensors is one file",
    )
    parser.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help=f"the most tensor bytes in one shard, e.g. 5GB or 500MiB (default: {DEFAULT_MAX_SHARD_SIZE})",
    )
    parser.add_argument(
        "--dtype",
        choices=OUTPUT_DTYPE_NAMES,
        default=None,
        help="cast floating-point tensors to this dtype (default: keep each tensor's)",
    )
    parser.add_argument(
        "--key-map",
        default=None,
        metavar="FILE",
        help='a JSON file {"checkpoint name": "output name" or null}; unlisted names are kept',
    )
    parser.add_argument("--config", default=None, metavar="FILE", help="a config.json to copy into OUT")


def main(args: argparse.Namespace) -> int:
    if args.out.endswith(".safetensors"):
        given = [flag for name, flag in _FOLDER_ONLY.items() if getattr(args, name) is not None]
        if given:
            raise UsageError(
                f"{args.out} is one .safetensors file; {', '.join(given)} apply to a folder export only"
            )
        return convert_options.main_to_safetensors(args)
    source_options, out_options = _cli.both_storage_options(args, args.url, args.out)
    max_shard_size = (
        DEFAULT_MAX_SHARD_SIZE if args.max_shard_size is None else parse_size(args.max_shard_size)
    )
    from dcp_fsspec.tools.safetensors.export import OUTPUT_DTYPES, export_safetensors, load_key_map  # torch

    with Progress("exporting") as progress:
        result = export_safetensors(
            args.url,
            args.out,
            source_options,
            out_options,
            max_shard_size=max_shard_size,
            dtype=OUTPUT_DTYPES[args.dtype] if args.dtype else None,
            key_map=load_key_map(args.key_map) if args.key_map else None,
            config=args.config,
            overwrite=args.overwrite,
            progress=progress,
            trust_checkpoint=args.trust,
        )
    _cli.report(args, result.to_dict(), result.lines())
    return _cli.EXIT_OK
