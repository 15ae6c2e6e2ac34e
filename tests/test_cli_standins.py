"""The torch-free stand-ins ``inspect`` and ``verify`` read ``.metadata`` and records into.

They must say what torch's own classes say (every dtype, shape, chunk and record), refuse what
the allow-list refuses, and stay in step with the torch installed and the modules that need torch.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_fsspec import FsspecStorageWriter, cli
from dcp_fsspec.errors import CorruptCheckpointError
from dcp_fsspec.storage.format import metadata_standins
from dcp_fsspec.storage.format.metadata_file import read_metadata
from dcp_fsspec.storage.format.metadata_unpickler import METADATA_CLASSES
from dcp_fsspec.storage.transport.urls import resolve
from dcp_fsspec.tools.safetensors import command, export

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_the_dtype_table_names_every_dtype_of_the_installed_torch_with_its_size() -> None:
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            stand_in = metadata_standins.DTYPES[name]
            assert (str(stand_in), stand_in.itemsize) == (str(value), value.itemsize), name
    for name, value in vars(torch).items():
        dtype = getattr(value, "_dtype", None)
        if name.endswith("Storage") and isinstance(dtype, torch.dtype):
            assert str(metadata_standins.STORAGE_DTYPES[name]) == str(dtype), name


def test_every_torch_class_of_the_allow_list_has_a_stand_in() -> None:
    torch_names = {(m, n) for m, names in METADATA_CLASSES.items() if m.startswith("torch") for n in names}
    assert torch_names == set(metadata_standins.STAND_INS)


def test_the_safetensors_options_name_what_the_export_takes() -> None:
    assert command.DEFAULT_MAX_SHARD_SIZE == export.DEFAULT_MAX_SHARD_SIZE
    assert sorted(command.OUTPUT_DTYPE_NAMES) == sorted(export.OUTPUT_DTYPES)


def _as_plain(value: object) -> object:
    """A parsed ``.metadata``'s value as plain data, torch's classes and stand-ins alike."""
    if isinstance(value, (torch.dtype, metadata_standins.DType)):
        return metadata_standins.dtype_name(value)
    if isinstance(value, torch.layout) or type(value).__name__ == "_Named":
        return str(getattr(value, "name", value)).removeprefix("torch.")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _as_plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.name != "memory_format"
        }
    if isinstance(value, dict):
        return {repr(_as_plain(k)): _as_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_plain(v) for v in value]
    return value


def test_stand_ins_read_the_same_metadata_as_torch_for_every_saved_dtype(tmp_path: Path) -> None:
    state = {
        f"t_{dtype}".replace("torch.", ""): torch.zeros(3, 2, dtype=dtype)
        for dtype in (
            torch.float32,
            torch.bfloat16,
            torch.float16,
            torch.int64,
            torch.uint8,
            torch.bool,
            torch.complex64,
            torch.float8_e4m3fn,
        )
    }
    state["step"] = 7  # type: ignore[assignment]
    dcp.save(state, storage_writer=FsspecStorageWriter(str(tmp_path / "ckpt")))
    location = resolve(tmp_path / "ckpt")

    real = read_metadata(location)
    stand_in = read_metadata(location, stand_ins=True)

    assert isinstance(stand_in, metadata_standins.Metadata)
    assert _as_plain(stand_in.state_dict_metadata) == _as_plain(real.state_dict_metadata)
    assert _as_plain(stand_in.storage_data) == _as_plain(real.storage_data)


def test_stand_ins_refuse_a_metadata_that_names_a_callable_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))

    with pytest.raises(CorruptCheckpointError, match="system") as raised:
        read_metadata(resolve(folder), stand_ins=True)
    assert str(folder / ".metadata") in str(raised.value)
    assert cli.main(["inspect", str(folder)]) == 1
    assert not marker.exists()
