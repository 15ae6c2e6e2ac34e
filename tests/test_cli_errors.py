"""How ``dcp-fsspec`` reports what goes wrong: one or two lines naming the URL and what to do,
the documented exit code, JSON with ``--json``, the traceback only with ``--debug`` or ``-v``.

The storage failures are real ones: an S3 endpoint on a port of 127.0.0.1 that nothing listens
on (chosen by the OS, then closed), an environment without credentials, a storage option the
driver does not know.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import s3fs

from dcp_fsspec import cli, errors
from dcp_fsspec.tools import _cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

URL = "s3://no-such-bucket/run"


def _cli_run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on: the OS picks a free one, then it is closed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def endpoint() -> str:
    return f"http://127.0.0.1:{_closed_port()}"


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An environment where botocore finds no credentials anywhere (monkeypatch restores it)."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup either
    # fsspec reuses a filesystem made with the same options: one an earlier test made while the
    # environment held credentials would still carry them.
    s3fs.S3FileSystem.clear_instance_cache()


def _one_or_two_lines(text: str) -> list[str]:
    lines = [line for line in text.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2 and "Traceback" not in text, text
    return lines


def _options(endpoint: str, **more: object) -> str:
    return json.dumps({"endpoint_url": endpoint, "key": "k", "secret": "s", **more})


def _options_failing_fast(endpoint: str) -> str:
    """As a user would also write them to fail fast: botocore tries once (its default is 5)."""
    return _options(endpoint, config_kwargs={"retries": {"max_attempts": 1}})


# -- the three a new user meets first ------------------------------------------------------------


def test_an_unreachable_endpoint_is_one_line_naming_the_url_and_exits_4(
    capsys: pytest.CaptureFixture[str], endpoint: str
) -> None:
    code, out, err = _cli_run(capsys, "ls", URL, "--storage-options", _options(endpoint))
    assert code == _cli.EXIT_STORAGE == 4 and out == ""
    (line, *_) = _one_or_two_lines(err)
    assert line.startswith("dcp-fsspec ls: error: cannot reach") and URL in line and "endpoint_url" in line


def test_missing_credentials_are_one_line_saying_where_to_put_them_and_exit_4(
    capsys: pytest.CaptureFixture[str], endpoint: str, no_credentials: None
) -> None:
    options = json.dumps({"endpoint_url": endpoint})
    code, _, err = _cli_run(capsys, "inspect", URL, "--storage-options", options)
    assert code == 4
    (line, *_) = _one_or_two_lines(err)
    assert (
        "no credentials" in line
        and URL in line
        and "AWS_ACCESS_KEY_ID" in line
        and "--storage-options" in line
    )


def test_a_storage_option_the_driver_does_not_know_is_a_usage_error_naming_it(
    capsys: pytest.CaptureFixture[str], endpoint: str
) -> None:
    code, _, err = _cli_run(capsys, "verify", URL, "--storage-options", _options(endpoint, no_such_option=1))
    assert code == _cli.EXIT_USAGE == 2
    (line, *_) = _one_or_two_lines(err)
    assert URL in line and "no_such_option" in line and "s3fs" in line


@pytest.mark.parametrize("flag", ["--debug", "-v"])
@pytest.mark.parametrize("before", [True, False])
def test_debug_or_verbose_before_or_after_the_subcommand_adds_the_traceback(
    capsys: pytest.CaptureFixture[str], endpoint: str, flag: str, before: bool
) -> None:
    argv = ["ls", URL, "--storage-options", _options_failing_fast(endpoint)]
    code, _, err = _cli_run(capsys, *([flag, *argv] if before else [*argv, flag]))
    assert code == 4
    assert "Traceback (most recent call last)" in err and "EndpointConnectionError" in err
    assert err.rstrip().splitlines()[-1].startswith("dcp-fsspec ls: error: cannot reach")


# -- --json --------------------------------------------------------------------------------------


@pytest.mark.parametrize("before", [True, False])
def test_with_json_an_error_is_a_json_object_on_stdout(
    capsys: pytest.CaptureFixture[str], endpoint: str, before: bool
) -> None:
    argv = ["ls", URL, "--storage-options", _options_failing_fast(endpoint)]
    code, out, err = _cli_run(capsys, *(["--json", *argv] if before else [*argv, "--json"]))
    assert code == 4 and err == ""
    doc = json.loads(out)
    assert doc["kind"] == "unreachable" and doc["url"] == URL and doc["exit_code"] == 4
    assert URL in doc["error"] and "\n" not in doc["error"]


def test_with_json_nothing_at_the_url_is_kind_not_found(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = _cli_run(capsys, "inspect", str(tmp_path / "nothing"), "--json")
    doc = json.loads(out)
    assert code == 3 and doc["kind"] == "not_found" and doc["url"] == str(tmp_path / "nothing")
    assert str(tmp_path / "nothing") in doc["error"]


def test_a_per_node_local_dirname_is_one_line_naming_each_ranks_save_dirname_and_exits_3(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Per node, a local_dirname holds rank{r}/ folders, each a save_dirname of its own.
    for name in ("rank0", "rank1", "rank01", "ranks"):
        (tmp_path / name / "iter_000000001").mkdir(parents=True)
    (tmp_path / "rank2").write_text("a file, not a rank's folder")
    for command in ("ls", "inspect"):
        code, _, err = _cli_run(capsys, command, str(tmp_path))
        assert code == 3 and _one_or_two_lines(err) == [
            f"dcp-fsspec {command}: error: {tmp_path} is a per-node local_dirname holding each rank's own "
            f"save_dirname (rank0, rank1): give one of them, e.g. {tmp_path}/rank0"
        ], err
    code, out, _ = _cli_run(capsys, "ls", str(tmp_path / "rank1"))
    assert code == 0 and "iter_000000001" in out


def test_with_json_a_bad_command_line_is_a_json_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["prune", "memory://x/run", "--json"])  # --keep is missing
    out, err = capsys.readouterr()
    assert info.value.code == 2 and err == ""
    doc = json.loads(out)
    assert doc["kind"] == "usage" and "--keep" in doc["error"]


def test_without_json_a_bad_command_line_prints_usage_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["prune", "memory://x/run"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("usage: dcp-fsspec prune") and "--keep" in err


# -- the flags' places ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "verbose", "debug", "as_json"),
    [
        (["ls", "u"], False, False, False),
        (["ls", "u", "-v"], True, False, False),
        (["-v", "ls", "u"], True, False, False),
        (["ls", "u", "--verbose", "--debug", "--json"], True, True, True),
        (["--debug", "--json", "ls", "u"], False, True, True),
        (["--json", "ls", "u", "-v"], True, False, True),
    ],
)
def test_global_flags_go_before_or_after_the_subcommand(
    argv: list[str], verbose: bool, debug: bool, as_json: bool
) -> None:
    args = cli.build_parser({"ls"}).parse_args(argv)
    assert (args.verbose, args.debug, args.json) == (verbose, debug, as_json)


# -- how errors are classified: by type, never by text --------------------------------------------


def test_errors_are_classified_by_type_with_the_documented_exit_codes() -> None:
    cases = [
        (errors.UsageError("x"), "usage", 2),
        (errors.InvalidURLError("x"), "usage", 2),
        (errors.CheckpointExistsError("x"), "usage", 2),
        (errors.CheckpointNotFoundError("x"), "not_found", 3),
        (errors.StorageError("x"), "storage", 4),
        (PermissionError(13, "denied"), "storage", 4),
        (ConnectionRefusedError(111, "refused"), "unreachable", 4),
        (errors.MissingDriverError("x"), "missing_package", 5),
        (errors.CorruptCheckpointError("x"), "problem", 1),
        (RuntimeError("x"), "unexpected", 1),
    ]
    for error, kind, code in cases:
        failure = _cli.failure_for(error, ["s3://b/run"])
        assert (failure.kind, failure.exit_code) == (kind, code), error
        assert _cli.exit_code_for(error) == code


def test_a_storage_error_caused_by_an_unreachable_endpoint_says_unreachable() -> None:
    try:
        try:
            raise ConnectionRefusedError(111, "Connect call failed")
        except OSError as e:
            raise errors.StorageError("giving up on s3://b/run after 4 attempt(s)") from e
    except errors.StorageError as e:
        failure = _cli.failure_for(e, ["s3://b/run"])
    assert failure.kind == "unreachable" and "s3://b/run" in failure.message


def test_a_type_error_of_our_own_is_unexpected_even_with_storage_options() -> None:
    with pytest.raises(TypeError) as info:
        _cli.age("not a number")  # type: ignore[arg-type]  # raised inside the package: a bug
    failure = _cli.failure_for(info.value, ["s3://b/run"], storage_options_given=True)
    assert failure.kind == "unexpected" and failure.exit_code == 1 and "--debug" in failure.message


def test_a_driver_type_error_without_storage_options_is_unexpected() -> None:
    failure = _cli.failure_for(TypeError("unexpected keyword"), ["s3://b/run"], storage_options_given=False)
    assert failure.kind == "unexpected"


def test_usage_error_lives_with_every_other_exception_class() -> None:
    assert issubclass(errors.UsageError, errors.DcpFsspecError) and issubclass(errors.UsageError, ValueError)
    assert _cli.UsageError is errors.UsageError
    assert "UsageError" in (errors.__doc__ or "")
