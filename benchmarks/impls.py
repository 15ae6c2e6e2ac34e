"""The DCP storage implementations under test, by name, and where each can run.

Each one is a pair of factories ``writer(url, storage_options)`` / ``reader(url,
storage_options)`` plus the backends it supports. Peers run with their defaults (one I/O
thread for torch's writers and s3torchconnector's), as a user who picks them up gets them;
the options used are recorded in every sample.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dcp_fsspec.local_s3 import REGION

Factory = Callable[[str, dict[str, Any]], Any]


@dataclass(frozen=True)
class Impl:
    name: str
    label: str
    backends: tuple[str, ...]
    writer: Factory
    reader: Factory
    needs: str  # the module whose import the implementation needs

    def unavailable(self) -> str | None:
        """Why this implementation cannot run here, or ``None``."""
        try:
            importlib.import_module(self.needs)
        except Exception as e:  # missing, or present but broken / half-written: report, go on
            return f"import {self.needs} failed: {type(e).__name__}: {e}"
        return None


def _ours_writer(url: str, so: dict[str, Any]) -> Any:
    from dcp_fsspec import FsspecStorageWriter

    return FsspecStorageWriter(url, so, overwrite=True)


def _ours_reader(url: str, so: dict[str, Any]) -> Any:
    from dcp_fsspec import FsspecStorageReader

    return FsspecStorageReader(url, so)


def _ours_obstore_writer(url: str, so: dict[str, Any]) -> Any:
    from dcp_fsspec import FsspecStorageWriter

    return FsspecStorageWriter(url, {**so, "transport": "obstore"}, overwrite=True)


def _ours_obstore_reader(url: str, so: dict[str, Any]) -> Any:
    from dcp_fsspec import FsspecStorageReader

    return FsspecStorageReader(url, {**so, "transport": "obstore"})


# Bodies unsigned, as every https:// endpoint sends them (moto's is http://, where they are signed).
_UNSIGNED = {"transport": "obstore", "config_kwargs": {"s3": {"payload_signing_enabled": False}}}


def _ours_obstore_unsigned_writer(url: str, so: dict[str, Any]) -> Any:
    from dcp_fsspec import FsspecStorageWriter

    return FsspecStorageWriter(url, {**so, **_UNSIGNED}, overwrite=True)


def _ours_obstore_unsigned_reader(url: str, so: dict[str, Any]) -> Any:
    from dcp_fsspec import FsspecStorageReader

    return FsspecStorageReader(url, {**so, **_UNSIGNED})


def _torch_fsspec_writer(url: str, so: dict[str, Any]) -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    # torch passes its **kwargs to fsspec.url_to_fs: that is where storage options go.
    return FsspecWriter(url, **so)


def _torch_fsspec_reader(url: str, so: dict[str, Any]) -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url, **so)


def _torch_fs_writer(url: str, so: dict[str, Any]) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(url, sync_files=True)


def _torch_fs_reader(url: str, so: dict[str, Any]) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(url)


def _floor_writer(url: str, so: dict[str, Any]) -> Any:
    from benchmarks.null_storage import NullWriter

    return NullWriter(url)


def _floor_reader(url: str, so: dict[str, Any]) -> Any:
    from benchmarks.null_storage import NullReader

    return NullReader(url)


def _s3tc_config() -> Any:
    from s3torchconnector import S3ClientConfig

    # Path-style addressing: the endpoint is an IP address. Endpoint and credentials come
    # from AWS_ENDPOINT_URL / AWS_ACCESS_KEY_ID / ... in the worker's environment.
    return S3ClientConfig(force_path_style=True)


def _s3tc_writer(url: str, so: dict[str, Any]) -> Any:
    from s3torchconnector.dcp import S3StorageWriter

    return S3StorageWriter(REGION, url, s3client_config=_s3tc_config())


def _s3tc_reader(url: str, so: dict[str, Any]) -> Any:
    from s3torchconnector.dcp import S3StorageReader

    return S3StorageReader(REGION, url, s3client_config=_s3tc_config())


FLOOR = "dcp_floor"

IMPLS: dict[str, Impl] = {
    i.name: i
    for i in [
        Impl(
            "dcp_fsspec",
            "dcp_fsspec FsspecStorageWriter/Reader",
            ("s3", "local", "memory"),
            _ours_writer,
            _ours_reader,
            "dcp_fsspec",
        ),
        Impl(
            "dcp_fsspec_obstore",
            "dcp_fsspec FsspecStorageWriter/Reader, transport=obstore",
            ("s3",),
            _ours_obstore_writer,
            _ours_obstore_reader,
            "obstore",
        ),
        Impl(
            "dcp_fsspec_obstore_unsigned",
            "dcp_fsspec, transport=obstore, bodies unsigned (as over https://)",
            ("s3",),
            _ours_obstore_unsigned_writer,
            _ours_obstore_unsigned_reader,
            "obstore",
        ),
        Impl(
            "torch_fsspec",
            "torch FsspecWriter/Reader",
            ("s3", "local", "memory"),
            _torch_fsspec_writer,
            _torch_fsspec_reader,
            "torch.distributed.checkpoint",
        ),
        Impl(
            "torch_fs",
            "torch FileSystemWriter/Reader (fsync)",
            ("local",),
            _torch_fs_writer,
            _torch_fs_reader,
            "torch.distributed.checkpoint",
        ),
        Impl(
            "s3torchconnector",
            "s3torchconnector S3StorageWriter/Reader",
            ("s3",),
            _s3tc_writer,
            _s3tc_reader,
            "s3torchconnector.dcp",
        ),
        Impl(
            FLOOR,
            "floor: DCP itself, storage without I/O (null_storage.py)",
            ("memory",),
            _floor_writer,
            _floor_reader,
            "torch.distributed.checkpoint",
        ),
    ]
}

OURS = "dcp_fsspec"
