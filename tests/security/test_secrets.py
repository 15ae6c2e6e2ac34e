"""Secrets stay out of sight: a password in a URL reaches the driver and nothing else.

A full cycle (save, load, ``ls``, ``inspect``, ``verify``, ``cp``, with ``--json`` too) runs
against the real SFTP server with ``sftp://user:<secret>@host/…``. The server takes keys only,
so it ignores the password, but sshfs receives it, like any other: then every file written,
every log record (DEBUG included), every event and every line the CLI printed is searched for
it. The background saver's TCP store is checked to listen on loopback only.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_fsspec import Checkpointer, ResumeOptions, cli
from dcp_fsspec.checkpoint.events import CheckpointEvent
from dcp_fsspec.checkpoint.save.background import _join_group
from dcp_fsspec.checkpoint.save.handles import HandleReceiver
from dcp_fsspec.errors import DcpFsspecError
from dcp_fsspec.storage.transport.urls import redact_text, resolve
from tests.conftest import Backend
from tests.servers.sshd import LocalSSHServer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SECRET = "hunter2-5f3a9c"  # unlikely to appear anywhere by chance


def _secret_url(server: LocalSSHServer, path: Path) -> str:
    return f"sftp://{server.username}:{SECRET}@127.0.0.1:{server.port}{path}"


def _options(server: LocalSSHServer) -> dict[str, Any]:
    """The server's options less what the URL now says (host, port, user)."""
    return {"client_keys": [server.client_key], "known_hosts": None, "skip_instance_cache": True}


def _files_holding(root: Path, secret: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def test_redact_url_hides_the_password_of_every_userinfo_and_nothing_else() -> None:
    from dcp_fsspec.storage.transport.urls import redact_url

    assert redact_url(f"sftp://me:{SECRET}@host:22/a/b") == "sftp://me:***@host:22/a/b"
    assert redact_url(f"s3://AKIA:{SECRET}@bucket/run") == "s3://AKIA:***@bucket/run"
    assert redact_url(f"simplecache::ftp://u:{SECRET}@h/x") == "simplecache::ftp://u:***@h/x"
    assert redact_url("sftp://me:p@ss@host/a") == "sftp://me:***@host/a"  # an unescaped '@' in it
    assert redact_url("sftp://me@host/a") == "sftp://me@host/a"
    assert redact_url("s3://bucket/a:b@c") == "s3://bucket/a:b@c"  # in the path, not userinfo
    assert redact_url("/tmp/x") == "/tmp/x"


def test_resolve_connects_with_the_password_but_shows_it_redacted(
    sftp_server: LocalSSHServer, tmp_path: Path
) -> None:
    location = resolve(_secret_url(sftp_server, tmp_path), _options(sftp_server))
    assert SECRET not in location.url and ":***@" in location.url
    assert SECRET not in location.url_of(location.join("iter_000000001"))
    assert SECRET not in repr(location)
    assert location.fs.storage_options["password"] == SECRET  # the driver got it
    # A redacted URL this process resolved connects as the original did.
    again = resolve(location.url_of(location.join("x")), _options(sftp_server))
    assert again.fs.storage_options["password"] == SECRET


def test_a_full_cycle_leaks_the_password_nowhere(
    sftp_server: LocalSSHServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="dcp_fsspec")
    run = tmp_path / "run"
    url = _secret_url(sftp_server, run)
    options = _options(sftp_server)
    events: list[CheckpointEvent] = []
    with Checkpointer(url, options, keep_last_n=1, on_event=events.append) as ckpt:
        for it in (1, 2):
            ckpt.save(it, model={"w": torch.full((4, 4), float(it))}, extra={"step": it})
    restored = {"w": torch.zeros(4, 4)}
    with Checkpointer(url, options, on_event=events.append) as ckpt:
        assert ckpt.load(model=restored) == 2
        assert SECRET not in ckpt.url
    assert torch.equal(restored["w"], torch.full((4, 4), 2.0))
    assert {e.kind for e in events} == {"save_start", "save_end", "load_end"}

    flags = ["--storage-options", json.dumps(options)]
    key = f"{url}/iter_000000002/model"
    for argv in (
        ["ls", url],
        ["ls", url, "--json"],
        ["inspect", url],
        ["inspect", key, "--json"],
        ["verify", url],
        ["verify", key, "--json"],
        ["cp", key, str(tmp_path / "copy"), "--debug"],
        ["cp", str(tmp_path / "copy"), f"{url}_copy", "--json", "--dst-storage-options", json.dumps(options)],
        ["ls", f"{url}/nothing_here"],
        ["inspect", f"{url}/nothing_here", "--json"],
    ):
        code = cli.main([*argv, *flags])
        assert code == (3 if "nothing_here" in argv[1] else 0), (argv, code, capsys.readouterr())
    output = capsys.readouterr()

    assert (run / "iter_000000002" / "model" / ".metadata").exists()
    assert (tmp_path / "run_copy" / ".metadata").exists()
    assert _files_holding(tmp_path, SECRET) == []
    logged = [(r.name, r.getMessage()) for r in caplog.records]
    assert logged, "nothing was logged: the check below would prove nothing"
    assert [m for m in logged if SECRET in m[1]] == []
    assert [e for e in events if SECRET in repr(e)] == []
    assert ":***@" in events[0].url
    assert SECRET not in output.out and SECRET not in output.err
    assert ":***@" in output.out


def test_an_async_save_connects_with_the_password_and_leaks_it_nowhere(
    sftp_server: LocalSSHServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The background process resolves the URL by itself: it must get the password, and its
    # forwarded log records must not carry it.
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="dcp_fsspec")
    url = _secret_url(sftp_server, tmp_path / "run")
    events: list[CheckpointEvent] = []
    options = _options(sftp_server)
    with Checkpointer(url, options, async_mode="async_with_pinned_mem", on_event=events.append) as ckpt:
        ckpt.save(3, model={"w": torch.arange(6.0)})
        ckpt.wait()
    restored = {"w": torch.zeros(6)}
    with Checkpointer(url, _options(sftp_server)) as ckpt:
        assert ckpt.load(model=restored) == 3
    assert torch.equal(restored["w"], torch.arange(6.0))
    assert [e.kind for e in events] == ["save_start", "save_end"] and all(SECRET not in e.url for e in events)
    assert _files_holding(tmp_path, SECRET) == []
    assert [r.getMessage() for r in caplog.records if SECRET in r.getMessage()] == []


def test_errors_name_the_url_without_its_password(sftp_server: LocalSSHServer, tmp_path: Path) -> None:
    url = _secret_url(sftp_server, tmp_path / "empty")
    with pytest.raises(DcpFsspecError) as info:
        with Checkpointer(url, _options(sftp_server)) as ckpt:
            ckpt.load(0, model={"w": torch.zeros(1)})
    assert SECRET not in str(info.value) and ":***@" in str(info.value)
    with pytest.raises(DcpFsspecError) as info:
        resolve(f"nosuchscheme://me:{SECRET}@host/x")
    assert SECRET not in str(info.value) and ":***@" in str(info.value)
    with pytest.raises(ValueError) as refused:  # the options name their load_path, never its password
        ResumeOptions(load_path=url, load_training_state=True, only_load_scheduler_state=True)
    assert SECRET not in str(refused.value) and ":***@" in str(refused.value)


@pytest.mark.parametrize("as_json", [False, True])
def test_a_malformed_storage_options_error_says_where_without_echoing_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], as_json: bool
) -> None:
    bad = '{"key": "AKIA", "secret": "hunter2", "endpoint_url": '
    code = cli.main(["ls", str(tmp_path), "--storage-options", bad, *(["--json"] if as_json else [])])
    output = capsys.readouterr()
    assert code == 2  # a usage error
    assert "hunter2" not in output.out + output.err
    assert "--storage-options" in output.out + output.err and "column" in output.out + output.err
    assert cli.main(["ls", str(tmp_path), "--storage-options", '["hunter2"]']) == 2
    assert "hunter2" not in "".join(capsys.readouterr())


def test_the_background_savers_store_listens_on_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # the default: loopback
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=_join_group, args=(theirs, HandleReceiver(), 0, 1), daemon=True)
    process.start()
    try:
        assert ours.poll(120), "the background side never sent its store's port"
        kind, port = ours.recv()
        assert kind == "port"
        listening = _listening_addresses(port)
        assert listening, f"nothing listens on port {port}"
        assert all(address in ("127.0.0.1", "::1") for address in listening), listening
        other = _non_loopback_address()
        if other is not None:
            with pytest.raises(OSError), socket.create_connection((other, port), timeout=5):
                pass
        ours.send(("connect", "127.0.0.1", port))
        process.join(120)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
            process.join()


def _listening_addresses(port: int) -> list[str]:
    """The local addresses of the sockets listening on ``port`` (from /proc/net/tcp and tcp6)."""
    if not Path("/proc/net/tcp").exists():
        pytest.skip("no /proc/net/tcp on this system to read the listening sockets from")
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":  # 0A: LISTEN
                raw = bytes.fromhex(address)
                # /proc prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.append(socket.inet_ntop(family, raw))
    return found


def _non_loopback_address() -> str | None:
    """An IPv4 address of this machine other than loopback, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else str(address)


@pytest.mark.parametrize("as_json", [False, True])
def test_a_debug_traceback_hides_a_password_the_driver_quotes_without_its_scheme(
    s3_backend: Backend, capsys: pytest.CaptureFixture[str], as_json: bool
) -> None:
    # s3fs takes "key:secret@bucket" for the bucket name, and botocore's refusal quotes it whole.
    bucket = s3_backend.url.split("/")[2]
    url = f"s3://AKIAEXAMPLE:{SECRET}@{bucket}/run"
    argv = ["inspect", url, "--debug", "--storage-options", json.dumps(s3_backend.storage_options)]
    assert cli.main([*argv, *(["--json"] if as_json else [])]) == 1
    output = capsys.readouterr()
    assert "Traceback (most recent call last)" in output.err  # the check below looks at one
    assert SECRET not in output.err and SECRET not in output.out
    assert f'"AKIAEXAMPLE:***@{bucket}"' in output.err


def test_redact_text_hides_the_passwords_of_given_urls_wherever_they_appear() -> None:
    text = f'Invalid bucket name "me:{SECRET}@b"; see sftp://u:{SECRET}@h/x and %s' % SECRET.replace(
        "-", "%2D"
    )
    redacted = redact_text(text, [f"s3://me:{SECRET.replace('-', '%2D')}@b/x"])
    assert SECRET not in redacted and "%2D" not in redacted
    assert redacted.count("***") == 3
