"""Shared fixtures: one fixture per storage backend, and a real S3 API on loopback.

Every backend-agnostic test takes the ``backend`` fixture, which is parametrized over the
backends below; adding a backend is one more ``Backend`` factory here. The S3 backend talks to
a moto server started once per session on 127.0.0.1 with a port the OS chose; each test gets
a fresh bucket. GCS (gcp-storage-emulator), Azure Blob (Azurite) and SFTP (OpenSSH's sshd) are
real servers too, started once per session from ``tests/servers/``; one whose program is
missing skips its tests with a message that says what to install, except under ``CI=true``,
where it fails them: a CI run that silently skipped a backend would still read as green
(``.ci/run`` installs every server first). The run ends with one line per backend: how many
tests used it, passed, skipped and failed.
"""

from __future__ import annotations

import importlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pytest

# torch sets TORCHINDUCTOR_CACHE_DIR in os.environ the first time torch._dynamo is imported
# (the first optimizer.step() of a process does it); importing it before any test keeps the
# os.environ guard below from blaming whichever test happens to run first.
import torch._dynamo  # noqa: F401

from dcp_fsspec.local_s3 import LocalS3Server
from dcp_fsspec.storage.transport.urls import resolve
from tests.servers import ServerUnavailable
from tests.servers.azurite import LocalAzurite
from tests.servers.ceph import LocalCephRGW
from tests.servers.gcs import ENVIRON as GCS_ENVIRON
from tests.servers.gcs import LocalGCSServer, import_gcsfs
from tests.servers.s3gateway import S3Gateway
from tests.servers.seaweedfs import LocalSeaweedFS
from tests.servers.sshd import LocalSSHServer

# gcsfs reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT once, at import: import it now, the way the GCS
# emulator needs, before any test or framework (fsspec's registry, a training framework's
# cloud-IO helpers) imports it with the variable's default.
try:
    import_gcsfs()
except ServerUnavailable:  # gcsfs absent: the gs:// tests say so themselves
    pass


@dataclass
class Backend:
    """A place to write checkpoints: a root URL and the storage options to reach it."""

    name: str
    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    # Backends a child process can reach (not memory://, which lives in one process).
    shared_between_processes: bool = True

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return fsspec.core.url_to_fs(self.url, **self.storage_options)[0]

    def sub(self, *names: str) -> str:
        return "/".join([self.url.rstrip("/"), *names])


@pytest.fixture(scope="session")
def s3_server() -> Iterator[LocalS3Server]:
    server = LocalS3Server().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_backend(s3_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch) -> Backend:
    # Credentials and region come from the environment for the duration of the test only
    # (monkeypatch restores them); the region must not go into client_kwargs (moto then
    # rejects bucket creation).
    for name, value in s3_server.environ().items():
        monkeypatch.setenv(name, value)
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    return Backend("s3", f"s3://{bucket}/ckpt", s3_server.storage_options())


@pytest.fixture
def s3_obstore_backend(s3_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> Backend:
    """The same moto bucket, read and written through obstore rather than s3fs (chosen by the
    environment, so the processes a test starts use it too; the test's own fsspec calls, with
    the same storage options, check through s3fs)."""
    import_or_skip("obstore", "the obstore transport needs obstore: pip install 'dcp-fsspec[obstore]'")
    monkeypatch.setenv("DCP_FSSPEC_TRANSPORT", "obstore")
    return _through_obstore(Backend("s3_obstore", s3_backend.url, s3_backend.storage_options))


@pytest.fixture
def local_backend(tmp_path: Any) -> Backend:
    return Backend("local", str(tmp_path / "ckpt"))


@pytest.fixture
def memory_backend() -> Iterator[Backend]:
    root = f"memory://dcp-fsspec-tests/{uuid.uuid4().hex}"
    yield Backend("memory", root, shared_between_processes=False)
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


# -- more object stores and SFTP, each a real server on 127.0.0.1 (see tests/servers/) ----------


def _start_or_skip(server: Any) -> Any:
    try:
        return server.start()
    except ServerUnavailable as e:
        if _in_ci():
            pytest.fail(f"{e} (CI=true: every backend must run; .ci/run installs its servers)", pytrace=False)
        pytest.skip(str(e))


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def import_or_skip(module: str, reason: str) -> Any:
    """``pytest.importorskip``, except under ``CI=true``, where a missing module fails the tests
    that need it: CI installs every extra the suite uses, so a skip there would hide a broken
    install."""
    if _in_ci():
        try:
            return importlib.import_module(module)
        except ImportError as e:
            pytest.fail(
                f"{reason} ({e}; CI=true: make venv installs every extra the suite uses)", pytrace=False
            )
    return pytest.importorskip(module, reason=reason)


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[LocalGCSServer]:
    server = _start_or_skip(LocalGCSServer())
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def gcs_backend(gcs_server: LocalGCSServer, monkeypatch: pytest.MonkeyPatch) -> Backend:
    for name, value in GCS_ENVIRON.items():  # for the processes the test starts
        monkeypatch.setenv(name, value)
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    gcs_server.create_bucket(bucket)
    return Backend("gcs", f"gs://{bucket}/ckpt", gcs_server.storage_options())


@pytest.fixture(scope="session")
def azure_server() -> Iterator[LocalAzurite]:
    server = _start_or_skip(LocalAzurite())
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def azure_backend(azure_server: LocalAzurite) -> Backend:
    container = f"test-{uuid.uuid4().hex[:12]}"
    azure_server.create_container(container)
    return Backend("azure", f"az://{container}/ckpt", azure_server.storage_options())


@pytest.fixture
def azure_obstore_backend(azure_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> Backend:
    """The same Azurite container, read and written through obstore rather than adlfs."""
    import_or_skip("obstore", "the obstore transport needs obstore: pip install 'dcp-fsspec[obstore]'")
    monkeypatch.setenv("DCP_FSSPEC_TRANSPORT", "obstore")
    return _through_obstore(Backend("azure_obstore", azure_backend.url, azure_backend.storage_options))


def _through_obstore(backend: Backend) -> Backend:
    """``backend``, once the package is seen to choose obstore for it (else the suites would
    test the fsspec driver under another name)."""
    chosen = resolve(backend.url, backend.storage_options).backend
    assert type(chosen).__name__ == "ObstoreBackend", f"{backend.url} went through {type(chosen).__name__}"
    return backend


@pytest.fixture(scope="session")
def sftp_server() -> Iterator[LocalSSHServer]:
    server = _start_or_skip(LocalSSHServer())
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def sftp_backend(sftp_server: LocalSSHServer, tmp_path: Any) -> Backend:
    # The server is this machine, so tmp_path is also where the files land (tests may look).
    # A connection per filesystem: a cached one that sshd closed would fail every later test.
    options = {**sftp_server.storage_options(), "skip_instance_cache": True}
    return Backend("sftp", sftp_server.url(str(tmp_path / "ckpt")), options)


# -- optional production S3 servers: SeaweedFS and Ceph RGW ----------------------------------------
# Not every machine has them: the shared suites (the backend fixture) run on them only when
# DCP_FSSPEC_TEST_S3_SERVERS names them (e.g. "seaweedfs,ceph"). A test that asks for SeaweedFS
# directly runs where it is installed (it starts in ~1 s); one that asks for Ceph only when it
# is named too (~20 s to start). A missing server skips, under CI=true too.

OPTIONAL_S3_SERVERS = {"seaweedfs": LocalSeaweedFS, "ceph": LocalCephRGW}
_SLOW_TO_START = {"ceph"}


def _optional_s3_server(name: str) -> Iterator[S3Gateway]:
    if name in _SLOW_TO_START and name not in _opted_in_s3_servers():
        pytest.skip(
            f"{name} takes ~20 s to start: set DCP_FSSPEC_TEST_S3_SERVERS={name} to run this test on it"
        )
    try:
        server = OPTIONAL_S3_SERVERS[name]().start()
    except ServerUnavailable as e:
        pytest.skip(f"{e} (an optional server: skipped under CI=true too)")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def seaweedfs_server() -> Iterator[S3Gateway]:
    yield from _optional_s3_server("seaweedfs")


@pytest.fixture(scope="session")
def ceph_server() -> Iterator[S3Gateway]:
    yield from _optional_s3_server("ceph")


def _gateway_backend(name: str, server: S3Gateway, monkeypatch: pytest.MonkeyPatch) -> Backend:
    for variable, value in server.environ().items():  # for the processes the test starts
        monkeypatch.setenv(variable, value)
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    server.create_bucket(bucket)
    return Backend(name, f"s3://{bucket}/ckpt", server.storage_options())


@pytest.fixture
def seaweedfs_backend(seaweedfs_server: S3Gateway, monkeypatch: pytest.MonkeyPatch) -> Backend:
    return _gateway_backend("seaweedfs", seaweedfs_server, monkeypatch)


@pytest.fixture
def ceph_backend(ceph_server: S3Gateway, monkeypatch: pytest.MonkeyPatch) -> Backend:
    return _gateway_backend("ceph", ceph_server, monkeypatch)


def _opted_in_s3_servers() -> list[str]:
    names = [n.strip() for n in os.environ.get("DCP_FSSPEC_TEST_S3_SERVERS", "").split(",") if n.strip()]
    unknown = sorted(set(names) - set(OPTIONAL_S3_SERVERS))
    if unknown:
        raise pytest.UsageError(
            f"DCP_FSSPEC_TEST_S3_SERVERS names unknown servers {unknown}; known: {sorted(OPTIONAL_S3_SERVERS)}"
        )
    return names


BACKENDS = [
    "local",
    "memory",
    "s3",
    "s3_obstore",
    "gcs",
    "azure",
    "azure_obstore",
    "sftp",
    *_opted_in_s3_servers(),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    """Every backend in turn; the shared suites take this fixture."""
    return request.getfixturevalue(f"{request.param}_backend")


# GCS and Azure pass the multi-rank suites too, but at ~10-20 s a test on two cores; what they
# exercise beyond the single-process suites is the ranks' protocol, which local and S3 cover.
@pytest.fixture(params=[b for b in BACKENDS if b in ("local", "s3", "s3_obstore")])
def shared_backend(request: pytest.FixtureRequest) -> Backend:
    """Backends that several processes can reach (for multi-rank tests)."""
    return request.getfixturevalue(f"{request.param}_backend")


@pytest.fixture(autouse=True)
def _no_stray_env_changes() -> Iterator[None]:
    before = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    yield
    after = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    assert after == before, "a test changed os.environ without restoring it"


# -- one line per backend at the end of the run ---------------------------------------------------

_ALL_BACKENDS = [*dict.fromkeys([*BACKENDS, *OPTIONAL_S3_SERVERS])]
_BACKEND_OF_FIXTURE = {f"{name}_{kind}": name for name in _ALL_BACKENDS for kind in ("backend", "server")}
_backends_of_test: dict[str, set[str]] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = {_BACKEND_OF_FIXTURE[f] for f in getattr(item, "fixturenames", ()) if f in _BACKEND_OF_FIXTURE}
        callspec = getattr(item, "callspec", None)
        # A fixture parametrized over backend names (backend, shared_backend, a test's own).
        used |= {
            v
            for v in (callspec.params.values() if callspec else ())
            if isinstance(v, str) and v in _ALL_BACKENDS
        }
        _backends_of_test[item.nodeid] = used


def pytest_terminal_summary(terminalreporter: Any) -> None:
    outcomes: dict[str, dict[str, str]] = {name: {} for name in _ALL_BACKENDS}
    for kind in ("passed", "failed", "skipped", "error", "xfailed", "xpassed"):
        for report in terminalreporter.stats.get(kind, []):
            for name in _backends_of_test.get(getattr(report, "nodeid", ""), ()):
                # A test's outcome is its worst phase: a failed teardown after a passed call fails it.
                if outcomes[name].get(report.nodeid) not in ("failed", "error"):
                    outcomes[name][report.nodeid] = kind
    terminalreporter.section("tests per backend")
    for name, by_test in outcomes.items():
        if name not in BACKENDS and not by_test:
            continue  # an optional server nobody asked for
        counts = {
            k: sum(1 for v in by_test.values() if v == k)
            for k in ("passed", "skipped", "failed", "error", "xfailed")
        }
        terminalreporter.write_line(
            f"{name:>6}: {len(by_test)} run, {counts['passed']} passed, {counts['skipped']} skipped, "
            f"{counts['failed'] + counts['error']} failed, {counts['xfailed']} xfailed"
        )
