"""What the tool subcommands share: storage-option flags, JSON and table output, exit codes, and
how an error becomes one line.

Exit codes (also in ``dcp-fsspec --help`` and the README): 0 ok; 1 a problem was found (damage,
a checkpoint that does not fit) or an unexpected error; 2 a usage error (bad arguments, bad
``--storage-options``, an unknown URL scheme, an output in the way without ``--overwrite``); 3
nothing at the URL; 4 the storage backend failed (unreachable, no credentials, refused); 5 a
needed package is missing.

An error is one line on stderr, ``dcp-fsspec <command>: error: <what happened and what to do>``,
naming the URL; with ``--json`` it is one JSON object on stdout instead (where a script reading
``--json`` already looks), ``{"error": …, "kind": …, "url": …, "exit_code": …}``. ``--debug`` (or
``-v``) adds the traceback on stderr. :func:`failure_for` decides by the exception's type and its
causes' types, never by its text.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcp_fsspec.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    DcpFsspecError,
    InvalidURLError,
    MissingDriverError,
    StorageError,
    UsageError,
)
from dcp_fsspec.storage.backends import DRIVER_PACKAGES
from dcp_fsspec.storage.transport.driver_errors import credentials_advice, is_unreachable
from dcp_fsspec.storage.transport.retry import causes
from dcp_fsspec.storage.transport.urls import redact_text, redact_url, scheme_of
from dcp_fsspec.tools.progress import human_bytes

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_STORAGE = 4
EXIT_MISSING_PACKAGE = 5

EXIT_CODES_HELP = """exit codes:
  0  ok
  1  a problem was found (verify: damage; a checkpoint that does not fit or cannot be decoded),
     or an unexpected error (--debug shows its traceback)
  2  usage error (bad arguments or --storage-options, unknown URL scheme, output exists: --overwrite)
  3  nothing at the URL (no checkpoint, iteration folder or save_dirname)
  4  the storage backend failed (unreachable, no credentials, permissions, ...)
  5  a needed package is missing (an fsspec driver such as gcsfs, or safetensors)

errors: one line on stderr; with --json, a JSON object {"error", "kind", "url", "exit_code"} on
stdout; with --debug (or -v), the traceback too"""

_PACKAGE_DIR = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Failure:
    """How the command line reports an error.

    Attributes:
        kind: ``usage``, ``storage_options``, ``not_found``, ``storage``, ``unreachable``,
            ``credentials``, ``missing_package``, ``problem`` or ``unexpected``.
        exit_code: one of the ``EXIT_*`` codes.
        message: one line naming the URL and what to do.
        url: the URL the command was given (for ``cp`` and the conversions, the source).
    """

    kind: str
    exit_code: int
    message: str
    url: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"error": self.message, "kind": self.kind, "url": self.url, "exit_code": self.exit_code}


def failure_for(
    error: BaseException,
    urls: Sequence[str] = (),
    *,
    storage_options_given: bool = False,
    options_advice: str | None = None,
) -> Failure:
    """How to report ``error``, raised by a command given ``urls``.

    Args:
        error: what the command raised.
        urls: the command's URLs, in the order given (named in messages that lack one).
        storage_options_given: whether the user passed storage options; only then can a
            ``TypeError`` from a driver mean a wrong option name.
        options_advice: what to do about storage options that went to the source alone (see
            :func:`source_only_options`); it takes the place of the usual advice on a failure
            to reach or use the storage.
    """
    failure = _failure_for(
        error,
        [redact_url(u) for u in urls],
        storage_options_given=storage_options_given,
        options_advice=options_advice,
    )
    # A driver's own error may quote the URL it was given, or parts of it, password included.
    return Failure(failure.kind, failure.exit_code, redact_text(failure.message, urls), failure.url)


def _failure_for(
    error: BaseException, urls: Sequence[str], *, storage_options_given: bool, options_advice: str | None
) -> Failure:
    url = urls[0] if urls else None
    where = " → ".join(urls) if urls else "the URL"
    for cause in causes(error):
        advice = credentials_advice(cause)
        if advice is not None:
            advice = options_advice or advice
            return Failure(
                "credentials", EXIT_STORAGE, f"no credentials to access {where} ({cause}); {advice}", url
            )
        if is_unreachable(cause):
            advice = options_advice or (
                "check the address (endpoint_url in --storage-options), the network, and that the server is up"
            )
            return Failure(
                "unreachable",
                EXIT_STORAGE,
                f"cannot reach the storage of {where} ({type(cause).__name__}: {cause}); {advice}",
                url,
            )
    if isinstance(error, MissingDriverError):
        return Failure("missing_package", EXIT_MISSING_PACKAGE, str(error), url)
    if isinstance(error, (UsageError, InvalidURLError, CheckpointExistsError)):
        return Failure("usage", EXIT_USAGE, str(error), url)
    if isinstance(error, CheckpointNotFoundError):
        return Failure("not_found", EXIT_NOT_FOUND, str(error), url)
    also = f"; {options_advice}" if options_advice else ""
    if isinstance(error, StorageError):
        return Failure("storage", EXIT_STORAGE, f"{error}{also}", url)
    if isinstance(error, DcpFsspecError):
        return Failure("problem", EXIT_PROBLEM, str(error), url)
    if isinstance(error, OSError):  # a driver's own, not wrapped: it may not name the URL
        return Failure("storage", EXIT_STORAGE, f"{where}: {type(error).__name__}: {error}{also}", url)
    if isinstance(error, TypeError) and storage_options_given and not _raised_in_package(error):
        package = DRIVER_PACKAGES.get(scheme_of(url or ""), "the fsspec driver")
        return Failure(
            "storage_options",
            EXIT_USAGE,
            f"the storage driver for {where} refused the storage options ({error}); check their names "
            f"in the documentation of {package}",
            url,
        )
    return Failure(
        "unexpected",
        EXIT_PROBLEM,
        f"unexpected {type(error).__name__} while working on {where}: {error} (run again with --debug for the "
        "traceback, and please report it)",
        url,
    )


def exit_code_for(error: BaseException) -> int:
    """The exit code for an error a subcommand raised."""
    return failure_for(error).exit_code


def report_failure(
    command: str, failure: Failure, error: BaseException, *, as_json: bool, debug: bool
) -> None:
    """Print ``failure``: one line on stderr, or with ``as_json`` a JSON object on stdout;
    ``debug`` prints the traceback first (on stderr)."""
    if debug:
        # Its messages may quote a URL's password (the line below is redacted by failure_for).
        print(redact_text("".join(traceback.format_exception(error))), end="", file=sys.stderr)
    if as_json:
        print_json(failure.to_dict())
    else:
        print(f"dcp-fsspec {command}: error: {failure.message}", file=sys.stderr)


def _raised_in_package(error: BaseException) -> bool:
    """Whether the innermost frame of ``error``'s traceback is in this package (a bug of ours,
    not a driver refusing an argument)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE_DIR)


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
        "--storage-options",
        default=None,
        metavar="JSON",
        help="fsspec options for the URL, as a JSON object (default: credentials from the environment)",
    )
    if destination:
        parser.add_argument(
            "--dst-storage-options",
            default=None,
            metavar="JSON",
            help="fsspec options for the destination (default: --storage-options when both URLs have "
            "the same scheme, else none)",
        )


def storage_options(text: str | None, flag: str = "--storage-options") -> dict[str, Any]:
    """Parse a ``--storage-options`` value: a JSON object, or ``{}`` when not given.

    Its values are credentials often, so an error says where the JSON is wrong (line, column)
    or what type it is, never the text itself.
    """
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        # e.msg and the position only: str(e) is the same, but the doc (the secrets) stays out.
        raise UsageError(
            f"{flag} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (character {e.pos} "
            f"of {len(text)}); its text is not shown, since it may hold credentials"
        ) from e
    if not isinstance(value, dict):
        raise UsageError(
            f"{flag} must be a JSON object like '{{\"anon\": true}}', got a JSON {type(value).__name__}"
        )
    return value


def destination_options(args: argparse.Namespace, src: str, dst: str) -> dict[str, Any]:
    """``--dst-storage-options``, else the source's options when both URLs share a scheme."""
    if getattr(args, "dst_storage_options", None) is not None:
        return storage_options(args.dst_storage_options, "--dst-storage-options")
    if scheme_of(src) == scheme_of(dst):
        return storage_options(args.storage_options)
    return {}


def source_only_options(args: argparse.Namespace, urls: Sequence[str]) -> str | None:
    """What to do when ``--storage-options`` went to the source alone, else None.

    That happens to a command that writes elsewhere (``urls`` is its source and destination)
    given ``--storage-options`` but no ``--dst-storage-options``, for URLs of two schemes.
    """
    if not hasattr(args, "dst_storage_options") or len(urls) != 2:
        return None
    src, dst = (redact_url(u) for u in urls)
    if (
        args.dst_storage_options is not None
        or args.storage_options is None
        or scheme_of(src) == scheme_of(dst)
    ):
        return None
    return (
        f"--storage-options went to the source {src} only, as the two URLs' schemes differ: "
        f"pass the options for {dst} as --dst-storage-options"
    )


def both_storage_options(
    args: argparse.Namespace, src: str, dst: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The source's and the destination's storage options, for commands that write elsewhere."""
    return storage_options(args.storage_options), destination_options(args, src, dst)


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """``--json`` after the subcommand. Its default is left to the top-level parser, which takes
    ``--json`` before the subcommand too (a subcommand's default would overwrite that one)."""
    parser.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print one JSON document instead of text (errors too: a JSON object on stdout)",
    )


def print_json(document: Any) -> None:
    json.dump(document, sys.stdout, indent=1, default=str)
    sys.stdout.write("\n")


def report(args: argparse.Namespace, document: dict[str, Any], lines: Sequence[str]) -> None:
    """Print what a subcommand found: ``document`` as JSON with ``--json``, else ``lines``."""
    if getattr(args, "json", False):
        print_json(document)
    else:
        print("\n".join(lines))


def table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns, two spaces apart; the first row is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def size(n: int) -> str:
    """A size for a table column, as ``ls -h`` writes it: bytes below 1 KiB (``"288"``), else
    ``"1.5 KiB"``, ``"12.0 MiB"``, ``"3.2 GiB"``."""
    return str(n) if n < 1024 else human_bytes(n)


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
        "--trust",
        action="store_true",
        help="the checkpoint is your own: unpickle .metadata and non-tensor entries in full, whatever "
        "classes they name (this runs any code they hold; without it such a checkpoint is refused, exit 1)",
    )


def add_references_flag(parser: argparse.ArgumentParser) -> None:
    """``--references``: follow an incremental save's references to sibling checkpoints (``references=True``)."""
    parser.add_argument(
        "--references",
        action="store_true",
        help="follow references to sibling checkpoints (../step-10/…: a plain layout's incremental saves); "
        "references between a Checkpointer's iterations are always followed",
    )
