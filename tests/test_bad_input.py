"""Bad input, the cases not already in test_storage_errors.py and test_checkpointer.py.

Each case ends in a clear error naming what is wrong (and the URL), or in correct behaviour.
Already covered elsewhere: an unknown scheme or a missing driver for the storage classes, a
missing bucket on load, bad credentials (test_faults.py), relative paths and ``~`` for the
storage classes, every pointer case (empty, garbage, whitespace, naming a missing or
uncommitted folder), a missing ``.metadata``, a truncated ``.metadata``, a missing or truncated
data file, a missing key, shape and dtype mismatches of plain tensors.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from torch import nn

from dcp_fsspec import (
    Checkpointer,
    CheckpointMismatchError,
    CorruptCheckpointError,
    DcpFsspecError,
    FsspecStorageReader,
    InvalidURLError,
    MissingDriverError,
    ResumeOptions,
    StorageError,
)
from tests.conftest import Backend
from tests.helpers import load, raises_through_dcp, save
from tests.states import DTYPES, assert_state_equal, empty_like_state, random_tensor

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

GiB = 1024**3
# dtypes torch.save stores beyond those of tests.states.DTYPES (which sample_state covers).
MORE_DTYPES = [
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.float4_e2m1fn_x2,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.complex32,
]
OBJECT_STORES = (
    "s3",
    "s3_obstore",
    "gcs",
    "azure",
    "azure_obstore",
    "seaweedfs",
    "ceph",
)  # no folders: a key and a "folder" of the same name coexist


def _fs_path(backend: Backend, *names: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(backend.sub(*names), **backend.storage_options)
    fs.invalidate_cache()
    return fs, path


# -- URLs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["save_dirname", "load_path"])
def test_the_checkpointer_refuses_an_unknown_scheme_naming_the_url(where: str) -> None:
    url = "nosuchscheme://bucket/run"
    with pytest.raises(InvalidURLError, match=url):
        Checkpointer(url) if where == "save_dirname" else Checkpointer(
            "memory://run", resume=ResumeOptions(load_path=url)
        )


def test_the_checkpointer_names_the_package_of_a_missing_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "adlfs", None)  # unimportable, installed or not
    registered = sys.modules["fsspec.registry"]._registry
    for scheme in ("az", "abfs"):
        monkeypatch.delitem(registered, scheme, raising=False)
    with pytest.raises(MissingDriverError, match="pip install adlfs") as info:
        Checkpointer("az://container/run")
    assert "az://container/run" in str(info.value)


def test_a_checkpointer_on_a_missing_bucket_fails_naming_it_rather_than_starting_from_scratch(
    s3_backend: Backend,
) -> None:
    url = "s3://no-such-bucket-dcp-fsspec/run"
    with Checkpointer(url, s3_backend.storage_options) as ckpt:
        for attempt in (lambda: ckpt.load(trainer={"step": 0}), lambda: ckpt.save(1, trainer={"step": 1})):
            with pytest.raises(StorageError) as info:
                attempt()
            assert url in str(info.value) and "bucket does not exist" in str(info.value)


def test_a_file_where_the_save_folder_should_be_is_an_error_naming_it(backend: Backend) -> None:
    fs, path = _fs_path(backend, "afile")
    fs.makedirs(backend.fs._strip_protocol(backend.url), exist_ok=True)
    fs.pipe_file(path, b"not a folder")
    url = backend.sub("afile")
    if backend.name in OBJECT_STORES:
        # Not an error there: "afile" and "afile/..." are unrelated keys. It must then just work.
        with Checkpointer(url, backend.storage_options) as ckpt:
            ckpt.save(1, trainer={"w": torch.arange(4.0)})
            target = {"w": torch.zeros(4)}
            assert ckpt.load(trainer=target) == 1 and torch.equal(target["w"], torch.arange(4.0))
        return
    with Checkpointer(url, backend.storage_options) as ckpt, pytest.raises(DcpFsspecError) as info:
        ckpt.save(1, trainer={"w": torch.arange(4.0)})
    assert url in str(info.value)
    with raises_through_dcp(StorageError) as raised:  # the driver's own errors (sftp's) are wrapped too
        save({"w": torch.ones(2)}, backend, url=url)
    assert url in str(raised.value)


def test_the_checkpointer_resolves_relative_and_home_paths_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert Checkpointer("~/run").url == str(tmp_path / "home" / "run")
    ckpt = Checkpointer("rel/run")
    assert ckpt.url == str(tmp_path / "a" / "rel" / "run")
    ckpt.save(1, trainer={"w": torch.arange(3.0)})
    monkeypatch.chdir(tmp_path / "b")  # a later working directory does not move the checkpoints
    target = {"w": torch.zeros(3)}
    assert ckpt.load(trainer=target) == 1 and torch.equal(target["w"], torch.arange(3.0))
    assert not (tmp_path / "b" / "rel").exists()


# -- checkpoints -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content", [os.urandom(64), pickle.dumps({"not": "DCP metadata"})], ids=["garbage", "another-pickle"]
)
def test_a_corrupted_metadata_file_is_reported_naming_it(backend: Backend, content: bytes) -> None:
    save({"w": torch.randn(10)}, backend)
    fs, path = _fs_path(backend, ".metadata")
    fs.pipe_file(path, content)
    with pytest.raises(CorruptCheckpointError) as info:
        FsspecStorageReader(backend.url, storage_options=backend.storage_options).read_metadata()
    assert backend.sub(".metadata") in str(info.value)


def _model(layers: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(layers)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)]).to(dtype)


def test_a_model_with_parameters_the_checkpoint_lacks_is_a_mismatch_naming_them_and_the_url(
    memory_backend: Backend,
) -> None:
    with Checkpointer(memory_backend.url) as ckpt:
        ckpt.save(1, model=_model(2))
    with Checkpointer(memory_backend.url) as ckpt, pytest.raises(CheckpointMismatchError) as info:
        ckpt.load(model=_model(3))
    message = str(info.value)
    assert memory_backend.sub("iter_000000001", "model") in message and (
        "2.weight" in message or "2.bias" in message
    )


def test_a_model_with_fewer_parameters_than_the_checkpoint_loads_those_it_has(
    memory_backend: Backend,
) -> None:
    # DCP loads what the state dict asks for: a checkpoint may hold more (e.g. a head dropped).
    saved = _model(3)
    with Checkpointer(memory_backend.url) as ckpt:
        ckpt.save(1, model=saved)
    smaller = _model(2)
    with Checkpointer(memory_backend.url) as ckpt:
        assert ckpt.load(model=smaller) == 1
    assert_state_equal(
        smaller.state_dict(), {k: v for k, v in saved.state_dict().items() if not k.startswith("2.")}
    )


def test_a_model_in_another_dtype_loads_converted_as_torch_converts(memory_backend: Backend) -> None:
    saved = _model(2)
    with Checkpointer(memory_backend.url) as ckpt:
        ckpt.save(1, model=saved)
    half = _model(2, torch.bfloat16)
    with Checkpointer(memory_backend.url) as ckpt:
        ckpt.load(model=half)
    assert_state_equal(half.state_dict(), {k: v.to(torch.bfloat16) for k, v in saved.state_dict().items()})


# -- state dicts -----------------------------------------------------------------------------------


def test_an_empty_state_dict_saves_and_loads(backend: Backend) -> None:
    save({}, backend)
    metadata = FsspecStorageReader(backend.url, storage_options=backend.storage_options).read_metadata()
    assert metadata.state_dict_metadata == {}  # a real, committed checkpoint of nothing
    assert load({}, backend) == {}
    with Checkpointer(backend.sub("run"), backend.storage_options) as ckpt:
        ckpt.save(1, trainer={})
        assert ckpt.load(trainer={}) == 1


def test_unusual_values_and_tensor_layouts_round_trip_bit_exact(backend: Backend) -> None:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(8, 8, generator=gen)
    state: dict[str, Any] = {
        "none": None,
        "bytes": b"\x00\xffraw",
        "tuple": (1, "two", 3.0),
        "nan": float("nan"),
        "big_int": 2**80,
        "nested_empty": {"inner": {}},
        "expanded": torch.randn(3, 1, generator=gen).expand(3, 5),  # stride 0
        "channels_last": torch.randn(2, 3, 4, 5, generator=gen).to(memory_format=torch.channels_last),
        "overlapping_a": base[1:6],
        "overlapping_b": base[4:8, ::3],  # shares rows with overlapping_a
        "tail_view": base.view(-1)[-5:],  # at the very end of its storage
        "empty_middle": torch.empty(3, 0, 2),
        "zero_dim_bool": torch.tensor(True),
        "negative_zero": torch.tensor([-0.0, 0.0]),
    }
    save(state, backend)
    loaded = load(empty_like_state(state) | {"none": 0, "bytes": b"", "tuple": (), "nan": 0.0}, backend)
    assert loaded["nan"] != loaded["nan"]  # NaN, compared apart
    assert_state_equal(
        {k: v for k, v in loaded.items() if k != "nan"}, {k: v for k, v in state.items() if k != "nan"}
    )


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
def test_every_dtype_torch_saves_round_trips_bit_exact(backend: Backend) -> None:
    gen = torch.Generator().manual_seed(5)
    state = {str(d).removeprefix("torch."): random_tensor((7, 3), d, gen) for d in DTYPES}
    for dtype in MORE_DTYPES:  # no arithmetic on these in torch: random bytes, viewed
        raw = torch.randint(0, 256, (7, 3 * dtype.itemsize), dtype=torch.uint8, generator=gen)
        state[str(dtype).removeprefix("torch.")] = raw.view(dtype)
    save(state, backend)
    assert_state_equal(load(empty_like_state(state), backend), state)


def test_ten_thousand_small_tensors_round_trip(local_backend: Backend) -> None:
    state = {f"layer{i // 100}.t{i % 100}": torch.full((i % 7 + 1,), float(i)) for i in range(10_000)}
    save(state, local_backend)
    assert_state_equal(load(empty_like_state(state), local_backend), state)


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


# ~10 s and 4 GiB of memory: CI only (`make test SLOW=1`); nothing faster crosses 2**31.
@pytest.mark.slow
@pytest.mark.skipif(
    _available_memory() < 8 * GiB, reason="needs 8 GiB free: two 2 GiB tensors and the page cache"
)
def test_a_tensor_over_2_gib_round_trips_bit_exact(local_backend: Backend) -> None:
    n = 2 * GiB + 3  # past every 31-bit offset and length
    block = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    big = torch.empty(n, dtype=torch.uint8)
    whole = n // block.numel() * block.numel()
    big[:whole].view(-1, block.numel()).copy_(block)
    big[whole:] = block[: n - whole]
    big[2**31 - 2 : 2**31 + 2] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)  # marks around 2**31
    save({"big": big}, local_backend, sync_files=False)
    target = {"big": torch.empty(n, dtype=torch.uint8)}
    load(target, local_backend)
    assert torch.equal(target["big"], big)
