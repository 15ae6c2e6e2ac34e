"""Bad input gets a clear error naming the URL or file — never a hang, never wrong data."""

from __future__ import annotations

import sys

import pytest
import torch

from dcp_fsspec import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    FsspecStorageReader,
    FsspecStorageWriter,
    InvalidURLError,
    MissingDriverError,
)
from tests.conftest import Backend
from tests.helpers import load, raises_through_dcp, save


def _data_file(backend: Backend) -> str:
    root = backend.fs._strip_protocol(backend.url)
    return next(p for p in backend.fs.ls(root, detail=False) if p.endswith(".distcp"))


def test_loading_a_url_without_a_checkpoint_names_the_url(backend: Backend) -> None:
    """Guarantee row: 'permanent errors (403, 404, bad credentials, missing bucket) fail at once, naming the URL' (local, memory)"""
    with pytest.raises(CheckpointNotFoundError) as info:
        FsspecStorageReader(backend.url, storage_options=backend.storage_options).read_metadata()
    assert backend.sub(".metadata") in str(info.value)
    # DCP re-raises metadata failures as its own AssertionError; the message must survive.
    with raises_through_dcp(Exception) as raised:
        load({"w": torch.zeros(2)}, backend)
    assert backend.sub(".metadata") in str(raised.value) and "does not exist" in str(raised.value)


def test_a_missing_bucket_is_reported_with_the_url(s3_backend: Backend) -> None:
    url = "s3://no-such-bucket-dcp-fsspec/ckpt"
    with pytest.raises(FileNotFoundError) as info:
        FsspecStorageReader(url, storage_options=s3_backend.storage_options).read_metadata()
    assert url in str(info.value)
    with raises_through_dcp(OSError) as raised:
        save({"w": torch.zeros(2)}, s3_backend, url=url)
    assert "no-such-bucket-dcp-fsspec" in str(raised.value)


def test_an_unknown_scheme_is_an_invalid_url_naming_it() -> None:
    with pytest.raises(InvalidURLError, match="nosuchscheme://bucket/x"):
        FsspecStorageWriter("nosuchscheme://bucket/x")
    assert not FsspecStorageReader.validate_checkpoint_id("nosuchscheme://bucket/x")
    assert FsspecStorageReader.validate_checkpoint_id("s3://bucket/x")


def test_a_scheme_whose_driver_is_missing_names_the_pip_package(monkeypatch: pytest.MonkeyPatch) -> None:
    # Make gcsfs unimportable whether or not it is installed here.
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    registered = sys.modules["fsspec.registry"]._registry  # instances fsspec already built
    for scheme in ("gs", "gcs"):
        monkeypatch.delitem(registered, scheme, raising=False)
    with pytest.raises(MissingDriverError, match="pip install gcsfs") as info:
        FsspecStorageReader("gs://bucket/ckpt")
    assert isinstance(info.value, ImportError) and "gs://bucket/ckpt" in str(info.value)


def test_storage_options_must_be_a_dict() -> None:
    with pytest.raises(InvalidURLError, match="storage_options"):
        FsspecStorageWriter("memory://x", storage_options=[("key", "v")])  # type: ignore[arg-type]


def test_relative_paths_and_home_are_resolved_once(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert FsspecStorageWriter("rel/ckpt").checkpoint_id == str(tmp_path / "rel" / "ckpt")
    assert FsspecStorageWriter("~/ckpt").checkpoint_id == str(tmp_path / "home" / "ckpt")


def test_a_truncated_data_file_names_the_file(backend: Backend) -> None:
    save({"w": torch.randn(1000), "v": torch.randn(10)}, backend)
    path = _data_file(backend)
    backend.fs.pipe_file(path, backend.fs.cat_file(path)[:-100])
    with raises_through_dcp(CorruptCheckpointError) as raised:
        load({"w": torch.zeros(1000), "v": torch.zeros(10)}, backend)
    assert path.rsplit("/", 1)[-1] in str(raised.value) and "truncated" in str(raised.value)


def test_a_missing_data_file_names_the_checkpoint(backend: Backend) -> None:
    save({"w": torch.randn(10)}, backend)
    backend.fs.rm_file(_data_file(backend))
    with raises_through_dcp(CorruptCheckpointError) as raised:
        load({"w": torch.zeros(10)}, backend)
    assert backend.url in str(raised.value) and "missing" in str(raised.value)


@pytest.mark.parametrize("keep", [0, 10, -1])
def test_a_truncated_metadata_file_is_reported_as_corrupt(backend: Backend, keep: int) -> None:
    save({"w": torch.randn(10)}, backend)
    path = backend.fs._strip_protocol(backend.sub(".metadata"))
    backend.fs.pipe_file(path, backend.fs.cat_file(path)[:keep])
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt") as info:
        FsspecStorageReader(backend.url, storage_options=backend.storage_options).read_metadata()
    assert backend.sub(".metadata") in str(info.value)
    with raises_through_dcp(Exception) as raised:
        load({"w": torch.zeros(10)}, backend)
    assert backend.sub(".metadata") in str(raised.value) and "truncated or corrupt" in str(raised.value)


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_one_flipped_byte_in_tensor_data_fails_the_checksum(backend: Backend, where: str) -> None:
    """Guarantee row: 'bit flips in tensor data detected on load' (local, memory, S3, GCS, Azure, SFTP)"""
    tensor = torch.randn(4096)
    save({"w": tensor}, backend, files_per_rank=1)
    path = _data_file(backend)
    blob = bytearray(backend.fs.cat_file(path))
    # The tensor's bytes are the run of the file that equals the tensor; flip one inside it.
    start = bytes(blob).find(tensor.numpy().tobytes())
    at = {"start": start, "middle": start + len(tensor.numpy().tobytes()) // 2, "end": start + 4 * 4096 - 1}[
        where
    ]
    blob[at] ^= 0x01
    backend.fs.pipe_file(path, bytes(blob))
    with raises_through_dcp(ChecksumMismatchError) as raised:
        load({"w": torch.zeros(4096)}, backend)
    message = str(raised.value)
    assert path.rsplit("/", 1)[-1] in message and "'w'" in message and "stored CRC-32" in message


def test_a_flipped_byte_is_caught_when_the_record_is_buffered_too(backend: Backend) -> None:
    # Loading a slice of a saved tensor takes the buffered path rather than the direct one.
    tensor = torch.randn(64, 64)
    save({"w": tensor}, backend)
    path = _data_file(backend)
    blob = bytearray(backend.fs.cat_file(path))
    blob[bytes(blob).find(tensor.numpy().tobytes()) + 100] ^= 0x40
    backend.fs.pipe_file(path, bytes(blob))
    target = {"w": torch.zeros(64, 64).t()}  # non-contiguous target: buffered decode
    with raises_through_dcp(ChecksumMismatchError):
        load(target, backend)


def test_a_shape_mismatch_is_an_error_not_silent_data(backend: Backend) -> None:
    save({"decoder_weight": torch.randn(4, 4)}, backend)
    target = torch.zeros(4, 5)
    with raises_through_dcp(ValueError) as raised:
        load({"decoder_weight": target}, backend)
    message = str(raised.value)
    assert "decoder_weight" in message and "[4, 4]" in message and "[4, 5]" in message
    assert not target.any()  # nothing landed in the target


def test_a_dtype_mismatch_is_converted_like_torch_does(backend: Backend) -> None:
    # DCP's semantics: the destination's dtype wins (copy_ converts), as with torch's reader.
    tensor = torch.randn(8)
    save({"w": tensor}, backend)
    loaded = load({"w": torch.zeros(8, dtype=torch.float64)}, backend)
    assert torch.equal(loaded["w"], tensor.double())


def test_every_error_class_has_the_bases_the_tree_in_errors_py_draws() -> None:
    import re

    from dcp_fsspec import errors

    tree = errors.__doc__ or ""
    drawn = re.findall(r"[├└]── (\w+)(?:\s+\((\w+)\))?", tree)
    assert len(drawn) >= 9, tree
    classes = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, Exception)
    }
    assert {name for name, _ in drawn} == classes - {"DcpFsspecError"}, "a class is missing from the tree"
    builtins = {
        "FileNotFoundError": FileNotFoundError,
        "FileExistsError": FileExistsError,
        "ValueError": ValueError,
        "ImportError": ImportError,
        "OSError": OSError,
        "RuntimeError": RuntimeError,
    }
    for name, builtin in drawn:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.DcpFsspecError), name
        if builtin:
            assert issubclass(cls, builtins[builtin]), f"{name} should derive from {builtin}"
