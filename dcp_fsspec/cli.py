"""The ``dcp-fsspec`` command line (also ``python -m dcp_fsspec``): one subcommand per job.

Each subcommand lives in its own module, which adds its options and runs it, so this file stays
a table of subcommands, plus the one place where errors become exit codes (listed in
:mod:`dcp_fsspec.tools._cli` and in ``--help``). A subcommand's module is imported only when
that subcommand runs (or shows its ``--help``). None of those modules imports torch, which takes
seconds: the command line, its URLs and its ``--storage-options`` JSON are checked first, and
only the conversions (and ``demo``) import torch, once they start work.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
import warnings
from collections.abc import Collection, Sequence
from types import ModuleType
from typing import NoReturn

from dcp_fsspec._version import __version__
from dcp_fsspec.tools import _cli

# name: (module under dcp_fsspec, its function that runs the subcommand, one-line help). The
# helps live here, not in the modules, so that the top-level --help imports none of them.
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "ls": (
        "tools.ls",
        "main",
        "list the iterations under a save_dirname: latest, committed or not, size, age",
    ),
    "inspect": (
        "tools.inspection",
        "main",
        "show the keys, tensors, dtypes, shapes and sizes of a checkpoint",
    ),
    "verify": (
        "tools.verify",
        "main",
        "check every file and every tensor's CRC-32 without loading; exit 1 on any problem",
    ),
    "cp": (
        "tools.transfer",
        "main",
        "copy a checkpoint or a whole run between any two URLs, committing last",
    ),
    "prune": ("tools.prune", "main", "delete all but the newest N committed iterations (never the latest)"),
    "to-torch": ("tools.convert_options", "main_to_torch", "convert a checkpoint to one torch.save file"),
    "to-safetensors": (
        "tools.safetensors.command",
        "main",
        "export a checkpoint's tensors as sharded safetensors (a folder) or one .safetensors file",
    ),
    "demo": (
        "demo",
        "main",
        "train a small model, checkpoint to an embedded S3, resume in a fresh process, compare bitwise",
    ),
}

_VERBOSE_HELP = "log what the checkpointer and the tools do; on an error, show its traceback"
_DEBUG_HELP = "on an error, show its traceback; log this package's debug messages"
_JSON_HELP = "print one JSON document instead of text (errors too: a JSON object on stdout)"


class _BadCommandLine(Exception):
    """What :meth:`_Parser.error` raises, so that :func:`main` reports it (as JSON with ``--json``)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class _Parser(argparse.ArgumentParser):
    """argparse's parser, raising :class:`_BadCommandLine` instead of printing and exiting."""

    def error(self, message: str) -> NoReturn:
        raise _BadCommandLine(self, message)


def build_parser(commands: Collection[str] = ()) -> argparse.ArgumentParser:
    """The argument parser: every subcommand with its one-line help, and the options of those
    in ``commands`` (their modules are imported for it; the others are not)."""
    parser = _Parser(
        prog="dcp-fsspec",
        description="torch.distributed.checkpoint on any fsspec URL, and a training checkpointer.",
        epilog=_cli.EXIT_CODES_HELP + "\n\nURLs are any fsspec URL or local path; credentials come from the "
        "usual environment, or --storage-options JSON. -v, --debug and --json go before or after the "
        "subcommand.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    parser.add_argument("--json", action="store_true", help=_JSON_HELP)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (_, function, help_text) in _COMMANDS.items():
        if name not in commands:
            subparsers.add_parser(name, help=help_text)
            continue
        module = _module(name)
        sub = subparsers.add_parser(
            name,
            help=help_text,
            description=_description(name, module),
            epilog=_cli.EXIT_CODES_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        # After the subcommand too; SUPPRESS keeps the value given before it when not repeated.
        sub.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=_VERBOSE_HELP
        )
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
        sub.set_defaults(run=getattr(module, function))
    return parser


def _module(command: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.{_COMMANDS[command][0]}")


def _description(command: str, module: ModuleType) -> str:
    """A subcommand's ``--help`` text, from its module's docstring, as plain text: a tool's first
    line; the demo's docstring after its first paragraph (which is about the README)."""
    doc = (module.__doc__ or "").strip()
    text = doc.split("\n\n", 1)[-1] if command == "demo" else doc.split("\n", 1)[0]
    return plain_text(text)


def plain_text(text: str) -> str:
    """reST markup out: ``:class:`~a.B``` → ``B``, ````code```` → ``code``."""
    text = re.sub(r":[a-z]+:`~[\w.]*?\.?(\w+)`", r"\1", text)
    text = re.sub(r":[a-z]+:`([^`]+)`", r"\1", text)
    return text.replace("``", "")


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv``: its first word that is not an option (the top-level
    options take no values)."""
    for word in argv:
        if word == "--":
            return None
        if not word.startswith("-"):
            return word if word in _COMMANDS else None
    return None


def _wants_json(argv: Sequence[str]) -> bool:
    return "--json" in argv[: argv.index("--")] if "--" in argv else "--json" in argv


def _storage_options_given(args: argparse.Namespace) -> bool:
    for name in ("storage_options", "dst_storage_options"):
        try:
            if _cli.storage_options(getattr(args, name, None)):
                return True
        except _cli.UsageError:
            continue
    return False


def _urls(args: argparse.Namespace) -> list[str]:
    return [getattr(args, name) for name in ("url", "src", "dst", "out") if getattr(args, name, None)]


def _check_storage_options(args: argparse.Namespace) -> None:
    """Parse the ``--storage-options`` JSON given, before the subcommand does anything (UsageError)."""
    for name, flag in (
        ("storage_options", "--storage-options"),
        ("dst_storage_options", "--dst-storage-options"),
    ):
        _cli.storage_options(getattr(args, name, None), flag)


def _run(args: argparse.Namespace) -> int:
    """Run the subcommand; its errors become one line (or JSON) and the exit code for their kind."""
    try:
        _check_storage_options(args)
        return int(args.run(args))
    except Exception as e:  # noqa: BLE001 - every error is reported, by type (see _cli.failure_for)
        urls = _urls(args)
        failure = _cli.failure_for(
            e,
            urls,
            storage_options_given=_storage_options_given(args),
            options_advice=_cli.source_only_options(args, urls),
        )
        _cli.report_failure(args.command, failure, e, as_json=args.json, debug=args.debug or args.verbose)
        return failure.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand, return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_in(argv)
    try:
        args = build_parser({command} if command else ()).parse_args(argv)
        if not hasattr(args, "run"):  # argparse found a subcommand where _command_in did not
            args = build_parser({args.command}).parse_args(argv)
    except _BadCommandLine as e:
        _report_bad_command_line(e, as_json=_wants_json(argv))
    level = logging.INFO if args.verbose or args.debug else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # torch warns at import when numpy is absent; nothing here needs numpy (a clean install has
    # none), so the warning would only be noise above every command's output.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    if args.debug:
        logging.getLogger(__package__).setLevel(logging.DEBUG)
    return _run(args)


def _report_bad_command_line(error: _BadCommandLine, *, as_json: bool) -> NoReturn:
    """Say what is wrong with the command line as argparse would (usage, then the error), or as
    a JSON object with ``--json``; exit 2."""
    if as_json:
        _cli.print_json(
            _cli.Failure("usage", _cli.EXIT_USAGE, f"{error.parser.prog}: {error.message}", None).to_dict()
        )
    else:
        error.parser.print_usage(sys.stderr)
        print(f"{error.parser.prog}: error: {error.message}", file=sys.stderr)
    raise SystemExit(_cli.EXIT_USAGE)
