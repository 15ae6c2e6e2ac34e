"""The streamed, sharded safetensors export (``dcp-fsspec to-safetensors SRC DST``) on real storage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_fsspec import cli
from dcp_fsspec.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    UsageError,
)
from dcp_fsspec.storage.read.reader import FsspecStorageReader
from dcp_fsspec.storage.read.safetensors_reader import SafetensorsStorageReader
from dcp_fsspec.storage.write.writer import FsspecStorageWriter
from dcp_fsspec.tools.safetensors.export import INDEX_NAME, export_safetensors
from tests.conftest import Backend
from tests.test_verify import _run

safetensors_torch = pytest.importorskip("safetensors.torch")


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "embed.weight": torch.randn(64, 32),
        "layers.0.attn.weight": torch.randn(32, 32),
        "layers.0.mlp.weight": torch.randn(128, 32, dtype=torch.bfloat16),
        "layers.0.mlp.bias": torch.randn(128, dtype=torch.bfloat16),
        "steps": torch.arange(7),
        "mask": torch.tensor([True, False, True]),
        "norm.weight": torch.ones(32, dtype=torch.float16),
    }


def _save(url: str, state: dict[str, torch.Tensor], storage_options: dict[str, Any] | None = None) -> str:
    dcp.save(state, storage_writer=FsspecStorageWriter(url, storage_options=storage_options))
    return url


def _read_export(backend: Backend, out: str) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    fs = backend.fs
    index = json.loads(fs.cat_file(f"{out}/{INDEX_NAME}"))
    shards = {
        name: safetensors_torch.load(fs.cat_file(f"{out}/{name}"))
        for name in sorted(set(index["weight_map"].values()))
    }
    return index, shards


def test_an_export_to_s3_loads_back_equal_with_every_key_once_and_shards_under_the_max(
    tmp_path: Path, s3_backend: Backend
) -> None:
    state = _state()
    src = _save(str(tmp_path / "ckpt"), state)
    out = s3_backend.sub("hf")
    max_shard = 9000
    result = export_safetensors(
        src, out, out_storage_options=s3_backend.storage_options, max_shard_size=max_shard, buffer_bytes=4096
    )
    index, shards = _read_export(s3_backend, out)
    assert sorted(index["weight_map"]) == sorted(state) and len(shards) == len(result.shards) > 2
    assert list(shards) == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    loaded = {k: v for shard in shards.values() for k, v in shard.items()}
    assert len(loaded) == sum(len(s) for s in shards.values()) == len(state)
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
        assert name in shards[index["weight_map"][name]]
    for shard in shards.values():
        assert len(shard) == 1 or sum(t.numel() * t.element_size() for t in shard.values()) <= max_shard
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())


def test_an_export_from_s3_to_s3_casts_floats_to_bf16_renames_keys_and_copies_the_config(
    tmp_path: Path, s3_backend: Backend
) -> None:
    state = _state()
    opts = s3_backend.storage_options
    src = _save(s3_backend.sub("ckpt"), state, opts)
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "tiny"}')
    out = s3_backend.sub("hf")
    export_safetensors(
        src,
        out,
        opts,
        opts,
        dtype=torch.bfloat16,
        config=config,
        key_map=lambda n: None if n == "steps" else f"model.{n}",
    )
    _, shards = _read_export(s3_backend, out)
    loaded = {k: v for shard in shards.values() for k, v in shard.items()}
    assert sorted(loaded) == sorted(f"model.{n}" for n in state if n != "steps")
    for name, tensor in state.items():
        if name != "steps":
            want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
            assert torch.equal(loaded[f"model.{name}"], want), name
    assert json.loads(s3_backend.fs.cat_file(f"{out}/config.json")) == {"model_type": "tiny"}


def test_the_cli_exports_a_checkpointer_run_s_model_key_to_a_folder(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend, tmp_path: Path
) -> None:
    training = _run(memory_backend, [1])
    out = tmp_path / "hf"
    code = cli.main(["to-safetensors", memory_backend.url, str(out), "--max-shard-size", "200", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and len(doc["shards"]) > 1
    loaded: dict[str, torch.Tensor] = {}
    for name in doc["shards"]:
        loaded.update(safetensors_torch.load_file(str(out / name)))
    model = training.model.state_dict()
    assert sorted(loaded) == sorted(model)
    assert all(torch.equal(loaded[k], v) for k, v in model.items())


def test_an_existing_destination_without_overwrite_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    src = _save(str(tmp_path / "ckpt"), _state())
    out = tmp_path / "hf"
    out.mkdir()
    with pytest.raises(CheckpointExistsError, match=str(out)):
        export_safetensors(src, out)
    assert cli.main(["to-safetensors", src, str(out)]) == 2
    assert str(out) in capsys.readouterr().err
    assert cli.main(["to-safetensors", src, str(out), "--overwrite"]) == 0
    assert (out / INDEX_NAME).exists()


def test_a_key_map_that_gives_two_tensors_one_name_exits_2_naming_both_and_writes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    src = _save(str(tmp_path / "ckpt"), _state())
    key_map = tmp_path / "keys.json"
    key_map.write_text(json.dumps({"embed.weight": "w", "norm.weight": "w"}))
    out = tmp_path / "hf"
    with pytest.raises(UsageError, match=str(out)) as raised:
        export_safetensors(src, out, key_map=lambda n: "w" if n in ("embed.weight", "norm.weight") else n)
    assert "'embed.weight'" in str(raised.value) and "'norm.weight'" in str(raised.value)
    assert cli.main(["to-safetensors", src, str(out), "--key-map", str(key_map), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "'w'" in err
    assert not (out / INDEX_NAME).exists() and not list(out.glob("*.safetensors"))


def test_a_value_float16_cannot_hold_exits_2_naming_the_tensor_and_leaves_nothing_written(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    state = _state()
    state["layers.0.attn.weight"][3, 4] = 1e6  # in the second shard: the first is written by then
    src = _save(str(tmp_path / "ckpt"), state)
    out = tmp_path / "hf"
    with pytest.raises(UsageError, match="layers.0.attn.weight") as raised:
        export_safetensors(src, out, dtype=torch.float16, max_shard_size=1)
    assert str(out) in str(raised.value) and not out.exists()
    assert cli.main(["to-safetensors", src, str(out), "--dtype", "fp16", "--max-shard-size", "1"]) == 2
    assert str(out) in capsys.readouterr().err and not out.exists()


def test_a_single_safetensors_file_is_still_written_whole_and_refuses_folder_options(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    state = _state()
    src = _save(str(tmp_path / "ckpt"), state)
    out = tmp_path / "one.safetensors"
    assert cli.main(["to-safetensors", src, str(out)]) == 0
    loaded = safetensors_torch.load_file(str(out))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert cli.main(["to-safetensors", src, str(tmp_path / "two.safetensors"), "--dtype", "bf16"]) == 2
    assert "two.safetensors" in capsys.readouterr().err


_MEASURE = """
import sys
import torch
from dcp_fsspec.tools.safetensors.export import export_safetensors

def kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))

with open("/proc/self/clear_refs", "w") as refs:  # the peak (VmHWM) restarts from the resident size now
    refs.write("5")
before = kib("VmRSS:")
export_safetensors(sys.argv[1], sys.argv[2], max_shard_size=100 * 2**20, dtype=torch.bfloat16)
print((kib("VmHWM:") - before) * 1024)
"""


def test_a_256_mib_export_with_a_tensor_five_times_the_buffer_holds_a_fixed_buffer_not_a_shard_or_the_tensor(
    tmp_path: Path,
) -> None:
    state = {f"layer.{i}.weight": torch.full((1024, 1024), float(i)) for i in range(24)}  # 4 MiB each
    torch.manual_seed(0)
    huge = torch.randn(40 * 1024, 1024)  # 160 MiB: five batches of 32 MiB
    state["huge.weight"] = huge
    src = _save(str(tmp_path / "ckpt"), state)
    del state
    out = tmp_path / "hf"
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, src, str(out)], capture_output=True, text=True, check=True
    )
    grew = int(done.stdout.split()[-1])
    assert grew < 96 * 2**20, f"the export of {src} grew the peak RSS by {grew / 2**20:.0f} MiB"
    index = json.loads((out / INDEX_NAME).read_text())
    assert len(index["weight_map"]) == 25 and len(set(index["weight_map"].values())) == 2
    for name, want in (("huge.weight", huge), ("layer.7.weight", torch.full((1024, 1024), 7.0))):
        with safetensors_torch.safe_open(str(out / index["weight_map"][name]), "pt") as shard:
            assert torch.equal(shard.get_tensor(name), want.to(torch.bfloat16)), name


def test_a_tiny_gpt2_exported_with_a_key_map_and_its_config_loads_with_from_pretrained(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    trained = {
        f"decoder.{k}": v.clone() for k, v in model.state_dict().items()
    }  # a training framework's names
    src = _save(str(tmp_path / "ckpt"), trained)
    key_map = tmp_path / "keys.json"
    key_map.write_text(json.dumps({name: name.removeprefix("decoder.") for name in trained}))
    config.to_json_file(str(tmp_path / "config.json"))
    out = tmp_path / "hf"
    argv = [
        "to-safetensors",
        src,
        str(out),
        "--key-map",
        str(key_map),
        "--config",
        str(tmp_path / "config.json"),
        "--max-shard-size",
        "20KB",
    ]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert len(list(out.glob("model-*.safetensors"))) > 1
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    tokens = torch.tensor([[1, 5, 7, 3]])
    assert torch.equal(loaded(tokens).logits, model(tokens).logits)


def test_an_iteration_that_is_not_committed_exits_3_naming_it_and_writes_nothing(
    capsys: pytest.CaptureFixture[str], memory_backend: Backend, tmp_path: Path
) -> None:
    _run(memory_backend, [1])
    folder = memory_backend.sub("iter_000000001")
    memory_backend.fs.rm_file(f"{folder}/.commit.json")
    out = tmp_path / "hf"
    with pytest.raises(CheckpointNotFoundError, match=folder):
        export_safetensors(folder, out)
    assert cli.main(["to-safetensors", folder, str(out)]) == 3
    assert folder in capsys.readouterr().err and not out.exists()


# -- the import: a safetensors folder on any URL, loaded with dcp.load ----------------------------


def test_dcp_load_reads_an_exported_folder_on_s3_back_bit_exact(tmp_path: Path, s3_backend: Backend) -> None:
    state = _state()
    out = s3_backend.sub("hf")
    export_safetensors(
        _save(str(tmp_path / "ckpt"), state), out, None, s3_backend.storage_options, max_shard_size=9000
    )
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, storage_reader=SafetensorsStorageReader(out, s3_backend.storage_options))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_a_header_claiming_more_bytes_than_its_tensor_is_refused_naming_the_shard(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    export_safetensors(_save(str(tmp_path / "ckpt"), {"w": torch.ones(4)}), out)
    shard = out / "model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes().replace(b"[4]", b"[9]"))
    with pytest.raises(CorruptCheckpointError, match=str(shard)):  # what dcp.load reports, unwrapped
        SafetensorsStorageReader(str(out)).read_metadata()


def test_a_folder_without_safetensors_is_not_found_naming_it(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=str(tmp_path)):
        SafetensorsStorageReader(str(tmp_path)).read_metadata()


def _load_sharded(rank: int, world_size: int, folder: str, expected: dict[str, torch.Tensor]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    placements = {"embed.weight": [Shard(0)], "layers.0.attn.weight": [Shard(1)]}  # rows, then columns
    state = {k: distribute_tensor(torch.zeros_like(expected[k]), mesh, placements[k]) for k in placements}
    dcp.load(state, storage_reader=SafetensorsStorageReader(folder))
    for name, tensor in state.items():
        assert torch.equal(tensor.full_tensor(), expected[name]), name


def test_two_ranks_load_dtensor_shards_of_an_exported_folder_bit_exact(tmp_path: Path) -> None:
    from tests.distributed import run_ranks

    state = _state()
    out = str(tmp_path / "hf")
    export_safetensors(_save(str(tmp_path / "ckpt"), state), out)
    run_ranks(_load_sharded, 2, tmp_path, out, state)


def test_a_key_map_that_is_not_json_and_a_shard_size_that_is_not_a_size_exit_2_naming_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    src = _save(str(tmp_path / "ckpt"), _state())
    key_map = tmp_path / "keys.json"
    key_map.write_text("{not json")
    out = str(tmp_path / "hf")
    assert cli.main(["to-safetensors", src, out, "--key-map", str(key_map)]) == 2
    err = capsys.readouterr().err
    assert f"{key_map} is not JSON" in err
    assert cli.main(["to-safetensors", src, out, "--max-shard-size", "5 parsecs"]) == 2
    assert "--max-shard-size '5 parsecs'" in capsys.readouterr().err and not Path(out).exists()


def test_a_flipped_byte_in_a_tensor_streamed_in_pieces_is_a_checksum_mismatch_naming_its_file_and_nothing_is_left(
    tmp_path: Path,
) -> None:
    src = _save(str(tmp_path / "ckpt"), {"w": torch.randn(256, 64)})  # 64 KiB, sixteen 4 KiB pieces
    reader = FsspecStorageReader(src)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    (info,) = reader.storage_data.values()
    data_file = tmp_path / "ckpt" / info.relative_path
    raw = bytearray(data_file.read_bytes())
    raw[info.offset + info.length // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    out = tmp_path / "hf"
    with pytest.raises(ChecksumMismatchError, match=str(data_file)):
        export_safetensors(src, out, buffer_bytes=4096)
    assert not out.exists()


@pytest.mark.parametrize("sizes", [[2, 4], [4, 9]], ids=["short-of-the-shape", "past-the-shape"])
def test_chunks_that_do_not_tile_their_tensor_are_refused_naming_it_and_nothing_is_written(
    tmp_path: Path, sizes: list[int]
) -> None:
    """A crafted .metadata must never export what a gap leaves in memory."""
    import pickle

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    source = _save(str(tmp_path / "ckpt"), {"w": torch.ones(4, 4)})
    path = tmp_path / "ckpt" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    chunk = metadata.state_dict_metadata["w"].chunks[0]
    metadata.state_dict_metadata["w"].chunks[0] = ChunkStorageMetadata(
        offsets=chunk.offsets, sizes=torch.Size(sizes)
    )
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CorruptCheckpointError) as info:
        export_safetensors(source, tmp_path / "hf")
    assert "'w'" in str(info.value) and source in str(info.value) and "tile" in str(info.value)
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())
