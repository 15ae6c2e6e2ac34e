"""Bad input that used to cost too much or say the wrong thing: each is now bounded and a
``CorruptCheckpointError`` naming the file (CLI exit 1), never a bare ``ValueError``,
``RecursionError``, ``RecordFormatError`` or a ``CheckpointMismatchError``.
"""

from __future__ import annotations

import pickletools
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_fsspec import Checkpointer, CheckpointMismatchError, CorruptCheckpointError, cli
from dcp_fsspec.errors import RecordFormatError, UsageError
from dcp_fsspec.storage.checkpoint_files.integrity import verify_checkpoint
from dcp_fsspec.tools.convert import load_state_dict
from tests.conftest import Backend
from tests.helpers import save
from tests.security.crafted import edit_metadata, fs_path, load_failure, storage_entry

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

MiB = 1024 * 1024


# -- sizes claimed by .metadata --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["local", "memory"])  # read in place, and streamed
def test_a_metadata_claiming_a_huge_record_allocates_only_the_bytes_stored(
    name: str, request: pytest.FixtureRequest
) -> None:
    backend: Backend = request.getfixturevalue(f"{name}_backend")
    save({"t": torch.randn(MiB)}, backend)  # one 4 MiB record
    url = edit_metadata(
        backend, backend.url, lambda md: setattr(storage_entry(md, "t"), "length", 1024 * MiB)
    )
    target = {"t": torch.zeros(MiB, dtype=torch.float64)}  # another dtype: the record is held whole
    tracemalloc.start()
    try:
        error = load_failure(target, backend, max_request_bytes=256 * 1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(error, CorruptCheckpointError), repr(error)
    assert "truncated" in str(error) and url.removesuffix("/.metadata") in str(error)
    assert peak < 64 * MiB, f"{peak / MiB:.0f} MiB allocated for a 4 MiB file"


@pytest.mark.parametrize(("field", "value"), [("length", 0), ("length", -5), ("offset", -1)])
def test_a_metadata_entry_without_bytes_or_before_the_file_is_corrupt_naming_it(
    local_backend: Backend, field: str, value: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save({"w": torch.arange(4.0), "other": torch.ones(2)}, local_backend)
    url = edit_metadata(
        local_backend, local_backend.url, lambda md: setattr(storage_entry(md, "w"), field, value)
    )
    error = load_failure({"w": torch.zeros(4), "other": torch.zeros(2)}, local_backend)
    assert isinstance(error, CorruptCheckpointError) and url in str(error)
    assert "'w'" in str(error) and repr(value) in str(error)
    report = verify_checkpoint(local_backend.url)
    assert [p.url for p in report.problems] == [url] and "'w'" in report.problems[0].what
    for argv in (
        ["verify", local_backend.url],
        ["inspect", local_backend.url],
        ["to-torch", local_backend.url, str(tmp_path / "o.pt")],
    ):
        assert cli.main(argv) == 1, argv  # damage, not a storage failure
        assert "'w'" in "".join(capsys.readouterr())


@pytest.mark.parametrize(
    "damage",
    [
        lambda md: setattr(md.state_dict_metadata["w"], "properties", None),
        lambda md: setattr(md.state_dict_metadata["w"], "chunks", "garbage"),
        lambda md: setattr(md.state_dict_metadata["w"], "size", torch.Size([2])),  # chunk outside the shape
        lambda md: md.state_dict_metadata.__setitem__("w", 42),
        lambda md: setattr(md, "storage_meta", "garbage"),
        lambda md: setattr(storage_entry(md, "w"), "transform_descriptors", 7),
    ],
    ids=["no-properties", "chunks", "shape", "entry", "storage_meta", "transforms"],
)
def test_a_malformed_metadata_is_corrupt_not_a_mismatch(memory_backend: Backend, damage: Any) -> None:
    with Checkpointer(memory_backend.url) as ckpt:
        ckpt.save(1, model={"w": torch.arange(4.0)})
    url = edit_metadata(memory_backend, memory_backend.sub("iter_000000001", "model"), damage)
    with Checkpointer(memory_backend.url) as ckpt, pytest.raises(CorruptCheckpointError) as info:
        ckpt.load(model={"w": torch.zeros(4)})
    assert not isinstance(info.value, CheckpointMismatchError) and url in str(info.value)


# -- the pointer and the commit record --------------------------------------------------------------


def test_a_pointer_of_thousands_of_digits_is_corrupt_not_a_value_error(
    memory_backend: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    with Checkpointer(memory_backend.url) as ckpt:
        ckpt.save(1, model={"w": torch.ones(2)})
    fs, path = fs_path(memory_backend, memory_backend.sub("latest_checkpoint.txt"))
    fs.pipe_file(path, ("iter_" + "9" * 5000).encode())
    with Checkpointer(memory_backend.url) as ckpt:
        with pytest.raises(CorruptCheckpointError, match="latest_checkpoint.txt"):
            ckpt.load(model={"w": torch.zeros(2)})
        with pytest.raises(CorruptCheckpointError, match="latest_checkpoint.txt"):
            ckpt.latest_checkpoint()
    assert cli.main(["verify", memory_backend.url]) == 1
    assert "latest_checkpoint.txt" in capsys.readouterr().out


def test_a_folder_named_with_thousands_of_digits_is_not_an_iteration(memory_backend: Backend) -> None:
    with Checkpointer(memory_backend.url) as ckpt:
        ckpt.save(1, model={"w": torch.ones(2)})
        fs, path = fs_path(memory_backend, memory_backend.sub("iter_" + "1" * 5000, "model", ".metadata"))
        fs.pipe_file(path, b"")
        assert ckpt.committed_iterations() == [1]


@pytest.mark.parametrize(
    "record",
    [b"[" * 100_000 + b"]" * 100_000, b'{"keys": [' + b'"m",' * 600_000 + b'"m"]}'],
    ids=["nested", "huge"],
)
def test_a_deeply_nested_or_huge_commit_record_is_corrupt(memory_backend: Backend, record: bytes) -> None:
    with Checkpointer(memory_backend.url) as ckpt:
        ckpt.save(1, model={"w": torch.ones(2)})
    fs, path = fs_path(memory_backend, memory_backend.sub("iter_000000001", ".commit.json"))
    fs.pipe_file(path, record)
    with Checkpointer(memory_backend.url) as ckpt, pytest.raises(CorruptCheckpointError) as info:
        ckpt.load(model={"w": torch.zeros(2)})
    assert memory_backend.sub("iter_000000001", ".commit.json") in str(info.value)


# -- records whose data.pkl is crafted -------------------------------------------------------------


def _opcode_pickle(body: bytes, length: int) -> bytes:
    """A protocol-2 pickle of ``body`` (opcodes, without PROTO and STOP), padded to ``length`` bytes."""
    core = b"\x80\x02" + body + b"."
    pad = length - len(core) - 6  # BINUNICODE (1 + 4 + n bytes) then POP (1 byte)
    assert pad >= 0
    return b"\x80\x02" + b"X" + struct.pack("<I", pad) + b"x" * pad + b"0" + body + b"."


_REBUILD_FROM_A_STRING = (  # torch._utils._rebuild_tensor_v2("x", 0, (), ())
    b"ctorch._utils\n_rebuild_tensor_v2\n(X\x01\x00\x00\x00xK\x00))tR"
)
_ALLOCATE_A_TERABYTE = b"ctorch\nUntypedStorage\n(\x8a\x06\x00\x00\x00\x00\x00\x01tR"  # UntypedStorage(2**40)
_OPEN_A_FILE = b"cbuiltins\nopen\n(X\x05\x00\x00\x00/nullX\x01\x00\x00\x00rtR"


def _replace_data_pkl(data: bytearray, body: bytes) -> None:
    """Overwrite the first record's ``data.pkl`` in a data file with ``body``, at the same length."""
    at = data.index(b"PK\x03\x04")
    name_len, extra_len = struct.unpack_from("<HH", data, at + 26)
    assert bytes(data[at + 30 : at + 30 + name_len]).endswith(b"/data.pkl")
    start = at + 30 + name_len + extra_len
    length = next(pos for op, _arg, pos in pickletools.genops(bytes(data[start:])) if op.name == "STOP") + 1
    data[start : start + length] = _opcode_pickle(body, length)


@pytest.mark.parametrize(
    "body", [_REBUILD_FROM_A_STRING, _ALLOCATE_A_TERABYTE, _OPEN_A_FILE], ids=["args", "allocate", "open"]
)
def test_a_record_with_a_crafted_data_pkl_is_corrupt_and_never_a_record_format_error(
    memory_backend: Backend, body: bytes
) -> None:
    save({"w": torch.arange(4.0)}, memory_backend)
    fs, path = fs_path(memory_backend, memory_backend.sub("__0_0.distcp"))
    data = bytearray(fs.cat_file(path))
    _replace_data_pkl(data, body)
    fs.pipe_file(path, bytes(data))
    error = load_failure({"w": torch.zeros(4)}, memory_backend)
    assert isinstance(error, CorruptCheckpointError) and not isinstance(error, RecordFormatError), repr(error)
    assert memory_backend.sub("__0_0.distcp") in str(error) and "'w'" in str(error)
    report = verify_checkpoint(memory_backend.url)
    assert [(p.url, p.item) for p in report.problems] == [(memory_backend.sub("__0_0.distcp"), "w")]


# -- sizes a conversion would allocate -----------------------------------------------------------

TiB = 1024**4


def _claim(numel: int, stored: int | None = None) -> Any:
    """An edit making entry ``w`` a float32 tensor of ``numel`` elements (its records' length:
    ``stored``, or as saved)."""

    def edit(md: Any) -> None:
        md.state_dict_metadata["w"].size = torch.Size([numel])
        md.state_dict_metadata["w"].chunks[0].sizes = torch.Size([numel])
        if stored is not None:
            storage_entry(md, "w").length = stored

    return edit


@pytest.mark.parametrize("command", ["to-torch", "to-safetensors"])
def test_a_metadata_claiming_a_10_tib_tensor_fails_a_conversion_before_allocating_naming_the_entry(
    local_backend: Backend, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    save({"w": torch.arange(4.0), "other": torch.ones(2)}, local_backend)
    edit_metadata(local_backend, local_backend.url, _claim(10 * TiB // 4))
    assert cli.main([command, local_backend.url, str(tmp_path / "out")]) == 1  # damage
    err = capsys.readouterr().err
    assert "'w'" in err and "10.0 TiB" in err and local_backend.url in err, err
    assert not (tmp_path / "out").exists()


def test_a_10_tib_claim_its_records_also_claim_is_stopped_by_the_memory_limit(local_backend: Backend) -> None:
    save({"w": torch.arange(4.0), "other": torch.ones(2)}, local_backend)
    edit_metadata(local_backend, local_backend.url, _claim(10 * TiB // 4, stored=10 * TiB + 1024))
    with pytest.raises(UsageError) as raised:
        load_state_dict(local_backend.url)
    assert "'w'" in str(raised.value) and "--max-bytes" in str(raised.value)


def test_max_bytes_limits_what_a_conversion_holds_and_a_larger_one_lets_it_through(
    local_backend: Backend, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save({"w": torch.arange(1024.0), "other": torch.ones(2)}, local_backend)
    out = str(tmp_path / "out.pt")
    assert cli.main(["to-torch", local_backend.url, out, "--max-bytes", "4000"]) == 2
    err = capsys.readouterr().err
    assert "'w'" in err and "--max-bytes" in err and local_backend.url in err, err
    assert cli.main(["to-torch", local_backend.url, out, "--max-bytes", "5000"]) == 0
    assert torch.equal(torch.load(out)["w"], torch.arange(1024.0))
