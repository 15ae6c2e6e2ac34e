"""What the tool subcommands share: storage-option flags, JSON and table output, exit codes.

Exit codes (also in ``dcp-fsspec --help`` and the README): 0 ok; 1 a problem was found (damage,
a checkpoint that does not fit); 2 a usage error (bad arguments, bad ``--storage-options``, an
unknown URL scheme, an output in the way without ``--overwrite``); 3 nothing at the URL; 4 the
storage backend failed; 5 a needed package is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    DcpFsspecError,
    InvalidURLError,
    MissingDriverError,
    StorageError,
)
from ..storage.urls import normalize_url, scheme_of

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_STORAGE = 4
EXIT_MISSING_PACKAGE = 5

EXIT_CODES_HELP = """exit codes:
  0  ok
  1  a problem was found (verify: damage; a checkpoint that does not fit or cannot be decoded)
  2  usage error (bad arguments or --storage-options, unknown URL scheme, output exists: --overwrite)
  3  nothing at the URL (no checkpoint, iteration folder or save_dirname)
  4  the storage backend failed (network, permissions, ...)
  5  a needed package is missing (an fsspec driver such as gcsfs, or safetensors)"""


class UsageError(DcpFsspecError, ValueError):
    """A command-line argument that cannot be used (exit code 2)."""


def exit_code_for(error: BaseException) -> int:
    """The exit code for an error a subcommand raised."""
    if isinstance(error, MissingDriverError):
        return EXIT_MISSING_PACKAGE
    if isinstance(error, (UsageError, InvalidURLError, CheckpointExistsError)):
        return EXIT_USAGE
    if isinstance(error, CheckpointNotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(error, (StorageError, OSError)):
        return EXIT_STORAGE
    return EXIT_PROBLEM


def add_standard_arguments(
    parser: argparse.ArgumentParser, *positionals: tuple[str, str], destination: bool = False
) -> None:
    """The positional URLs (name, help), ``--storage-options`` (and ``--dst-storage-options``
    with ``destination``) and ``--json``: what every subcommand takes."""
    for name, text in positionals:
        parser.add_argument(name, help=text)
    add_storage_options(parser, destination=destination)
    add_json_flag(parser)


def add_storage_options(parser: argparse.ArgumentParser, *, destination: bool = False) -> None:
    """``--storage-options JSON`` (and ``--dst-storage-options`` for commands that write elsewhere)."""
    parser.add_argument(
        "--storage-options", default=None, metavar="JSON",
        help="fsspec options for the URL, as a JSON object (default: credentials from the environment)",
    )  # fmt: skip
    if destination:
        parser.add_argument(
            "--dst-storage-options", default=None, metavar="JSON",
            help="fsspec options for the destination (default: --storage-options when both URLs have "
            "the same scheme, else none)",
        )  # fmt: skip


def storage_options(text: str | None, flag: str = "--storage-options") -> dict[str, Any]:
    """Parse a ``--storage-options`` value: a JSON object, or ``{}`` when not given."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{flag} is not valid JSON ({e}): {text!r}") from e
    if not isinstance(value, dict):
        raise UsageError(f"{flag} must be a JSON object like '{{\"anon\": true}}', got {text!r}")
    return value


def destination_options(args: argparse.Namespace, src: str, dst: str) -> dict[str, Any]:
    """``--dst-storage-options``, else the source's options when both URLs share a scheme."""
    if getattr(args, "dst_storage_options", None) is not None:
        return storage_options(args.dst_storage_options, "--dst-storage-options")
    if scheme_of(normalize_url(src)) == scheme_of(normalize_url(dst)):
        return storage_options(args.storage_options)
    return {}


def both_storage_options(args: argparse.Namespace, src: str, dst: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The source's and the destination's storage options, for commands that write elsewhere."""
    return storage_options(args.storage_options), destination_options(args, src, dst)


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")


def print_json(document: Any) -> None:
    json.dump(document, sys.stdout, indent=1, default=str)
    sys.stdout.write("\n")


def report(args: argparse.Namespace, document: dict[str, Any], lines: Sequence[str]) -> None:
    """Print what a subcommand found: ``document`` as JSON with ``--json``, else ``lines``."""
    if args.json:
        print_json(document)
    else:
        print("\n".join(lines))


def table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns, two spaces apart; the first row is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def age(seconds: float | None) -> str:
    """``93`` → ``"1m"``, ``7200`` → ``"2h"``; ``"-"`` when unknown."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{max(0, int(seconds))}s"


def add_trust_flag(parser: argparse.ArgumentParser) -> None:
    """``--trust``: for commands that read checkpoints, unpickle them in full (``trust_checkpoint=True``)."""
    parser.add_argument(
        "--trust", action="store_true",
        help="the checkpoint is your own: unpickle .metadata and non-tensor entries in full, whatever "
        "classes they name (this runs any code they hold; without it such a checkpoint is refused, exit 1)",
    )  # fmt: skip
