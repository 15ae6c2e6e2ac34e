"""Incremental checkpoints: a record that did not change since the base is not written again.

A LoRA-shaped state (a frozen base, a small adapter, AdamW on the adapter) saved twice: the
second save uploads only what changed (counted at the server) and loads bit-exact. A state where
everything changes writes the same data as a full save. References are one hop, of two shapes
only, and refused when tampered with. Retention and the tools have their own modules.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import posixpath
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from dcp_fsspec import (
    Checkpointer,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FsspecStorageReader,
    FsspecStorageWriter,
    WriterSettings,
)
from dcp_fsspec.local_s3 import LocalS3Server
from dcp_fsspec.storage.format.names import CONTENT_HASHES_NAME, METADATA_NAME
from tests.conftest import Backend
from tests.distributed import run_ranks
from tests.helpers import raises_through_dcp
from tests.security.crafted import edit_metadata
from tests.servers.counting import CountingProxy

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(300),
]

BASE_DIM = 1024  # the frozen base: 4 MiB of float32
RANK = 4  # the adapter's rank


class Lora(nn.Module):
    """A frozen base Linear and a trainable low-rank adapter beside it."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.base = nn.Linear(BASE_DIM, BASE_DIM)
        self.down = nn.Linear(BASE_DIM, RANK, bias=False)
        self.up = nn.Linear(RANK, BASE_DIM, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class LoraTraining:
    """The model, AdamW on the adapter alone, and a step counter."""

    def __init__(self, seed: int = 0) -> None:
        self.model = Lora(seed)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-2)
        self.batches = torch.Generator().manual_seed(seed + 100)

    def step(self) -> None:
        loss = self.model(torch.randn(4, BASE_DIM, generator=self.batches)).pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def keys(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.optimizer}


def _assert_same(a: LoraTraining, b: LoraTraining) -> None:
    for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(x, y), name
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for field, value in sa[k].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb[k][field])), (k, field)


def _data_files(fs: fsspec.AbstractFileSystem, folder: str) -> dict[str, int]:
    fs.invalidate_cache()
    return {
        posixpath.basename(p): int(info["size"])
        for p, info in fs.find(folder, detail=True).items()
        if p.endswith(".distcp")
    }


def _relative_paths(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, str]:
    metadata = FsspecStorageReader(url, storage_options, references=True).read_metadata()
    return {index.fqn: info.relative_path for index, info in metadata.storage_data.items()}


@pytest.fixture
def counted_s3(s3_backend: Backend, s3_server: LocalS3Server) -> Iterator[tuple[Backend, CountingProxy]]:
    """``s3_backend`` reached through a proxy that counts what clients send."""
    proxy = CountingProxy(s3_server.endpoint_url).start()
    options = dict(s3_backend.storage_options)
    options["client_kwargs"] = {**options.get("client_kwargs", {}), "endpoint_url": proxy.endpoint_url}
    try:
        yield Backend("s3", s3_backend.url, options), proxy
    finally:
        proxy.stop()


# -- what a second save writes ---------------------------------------------------------------------


def test_a_second_incremental_save_of_a_lora_state_uploads_only_what_changed_and_loads_bit_exact(
    counted_s3: tuple[Backend, CountingProxy],
) -> None:
    backend, proxy = counted_s3
    training = LoraTraining()
    with Checkpointer(backend.url, backend.storage_options, incremental=True) as ckpt:
        training.step()
        ckpt.save(1, **training.keys())
        first = proxy.received
        training.step()
        proxy.reset()
        ckpt.save(2, **training.keys())
        second = proxy.received
    base_bytes = sum(t.numel() * t.element_size() for t in training.model.base.state_dict().values())
    assert first > base_bytes
    # The adapter (2 × 16 KiB), its two AdamW moments, .metadata, hashes, record and pointer.
    assert second < 0.05 * first, (first, second)
    paths = _relative_paths(f"{backend.url}/iter_000000002/model", backend.storage_options)
    assert paths["base.weight"] == "../../iter_000000001/model/__0_0.distcp"
    assert not paths["down.weight"].startswith("../")

    resumed = LoraTraining(seed=5)
    with Checkpointer(backend.url, backend.storage_options) as ckpt:
        assert ckpt.load(**resumed.keys()) == 2
    _assert_same(resumed, training)


@pytest.mark.parametrize("async_mode", ["disabled", "async_with_pinned_mem"])
def test_an_incremental_save_end_reports_the_bytes_it_wrote_and_those_it_referenced(
    local_backend: Backend, caplog: pytest.LogCaptureFixture, async_mode: str
) -> None:
    from dcp_fsspec import CheckpointEvent

    ends: list[CheckpointEvent] = []
    training = LoraTraining()
    with (
        caplog.at_level(logging.INFO, logger="dcp_fsspec.checkpoint"),
        Checkpointer(
            local_backend.url,
            incremental=True,
            async_mode=async_mode,
            on_event=lambda e: ends.append(e) if e.kind == "save_end" else None,
        ) as ckpt,
    ):
        for iteration in (1, 2):
            training.step()
            ckpt.save(iteration, **training.keys())
            ckpt.wait()
    base_bytes = sum(t.numel() * t.element_size() for t in training.model.base.state_dict().values())
    first, second = ends
    assert (
        first.written_bytes is not None and first.written_bytes > base_bytes and first.referenced_bytes == 0
    )
    assert second.written_bytes is not None and second.written_bytes < 0.05 * base_bytes
    assert (
        second.referenced_bytes >= base_bytes and second.nbytes == first.nbytes
    )  # the state's bytes, as before
    line = next(
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("saved ") and "iter_000000002" in r.getMessage()
    )
    assert " written, " in line and " referenced)" in line, line


def test_a_state_where_every_tensor_changes_writes_every_tensor_as_a_full_save_does(tmp_path: Path) -> None:
    fs = fsspec.filesystem("file")
    sizes, optim_references = {}, {}
    for incremental in (False, True):
        url = str(tmp_path / f"incremental-{incremental}")
        training = LoraTraining()
        training.model.base.requires_grad_(True)
        training.optimizer = torch.optim.AdamW(training.model.parameters(), lr=1e-2)
        with Checkpointer(url, incremental=incremental) as ckpt:
            for iteration in (1, 2):
                training.step()
                ckpt.save(iteration, **training.keys())
        sizes[incremental] = {
            key: _data_files(fs, f"{url}/iter_000000002/{key}") for key in ("model", "optim")
        }
        hashes = fs.exists(f"{url}/iter_000000002/model/{CONTENT_HASHES_NAME}")
        assert hashes == incremental
        assert not any(p.startswith("../") for p in _relative_paths(f"{url}/iter_000000002/model").values())
        optim = _relative_paths(f"{url}/iter_000000002/optim")
        optim_references[incremental] = sorted(fqn for fqn, p in optim.items() if p.startswith("../"))
    assert sizes[True]["model"] == sizes[False]["model"]
    # AdamW's settings (param_groups: lr, betas, …) did not change: those records alone are referred to.
    assert optim_references[False] == [] and optim_references[True]
    assert all(fqn.startswith("param_groups.") for fqn in optim_references[True]), optim_references[True]
    assert sizes[True]["optim"]["__0_0.distcp"] < sizes[False]["optim"]["__0_0.distcp"]


def test_references_lead_straight_to_the_bytes_never_through_another_reference(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    training = LoraTraining()
    with Checkpointer(url, incremental=True) as ckpt:
        for iteration in (1, 2, 3):
            training.step()
            ckpt.save(iteration, **training.keys())
    paths = _relative_paths(f"{url}/iter_000000003/model")
    assert paths["base.weight"] == paths["base.bias"] == "../../iter_000000001/model/__0_0.distcp"
    # Iteration 3's model has no data file of the base, and iteration 2 wrote none of the base either.
    assert _data_files(fsspec.filesystem("file"), f"{url}/iter_000000002/model")["__0_0.distcp"] < 200_000


def test_a_new_key_and_a_checkpointer_without_incremental_write_everything(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    training = LoraTraining()
    with Checkpointer(url, incremental=True) as ckpt:
        ckpt.save(1, model=training.model)
        ckpt.save(2, **training.keys())  # optim is new: nothing to refer to
    with Checkpointer(url) as ckpt:
        ckpt.save(3, **training.keys())  # not incremental: whole, and no hashes
    assert not any(p.startswith("../") for p in _relative_paths(f"{url}/iter_000000002/optim").values())
    assert not any(p.startswith("../") for p in _relative_paths(f"{url}/iter_000000003/model").values())
    assert not os.path.exists(f"{url}/iter_000000003/model/{CONTENT_HASHES_NAME}")


def test_compressed_incremental_saves_refer_to_compressed_records_and_load(tmp_path: Path) -> None:
    pytest.importorskip("zstandard")
    url = str(tmp_path / "run")
    training = LoraTraining()
    with Checkpointer(url, incremental=True, writer_settings=WriterSettings(compression="zstd")) as ckpt:
        for iteration in (1, 2):
            training.step()
            ckpt.save(iteration, **training.keys())
    assert _relative_paths(f"{url}/iter_000000002/model")["base.weight"].startswith("../../iter_000000001/")
    resumed = LoraTraining(seed=3)
    with Checkpointer(url) as ckpt:
        assert ckpt.load(**resumed.keys()) == 2
    _assert_same(resumed, training)


# -- the writer on its own: dcp.save with a base --------------------------------------------------


def _plain_states() -> tuple[dict[str, Any], dict[str, Any]]:
    gen = torch.Generator().manual_seed(1)
    first = {
        "frozen": torch.randn(256, 256, generator=gen),
        "adapter": torch.randn(64, generator=gen),
        "step": 1,
    }
    second = {**first, "adapter": torch.randn(64, generator=gen), "step": 2}
    return first, second


def _zeros() -> dict[str, Any]:
    return {"frozen": torch.zeros(256, 256), "adapter": torch.zeros(64), "step": 0}


def test_dcp_save_with_a_sibling_base_loads_with_references_true_and_with_torchs_own_reader(
    tmp_path: Path,
) -> None:
    first, second = _plain_states()
    dcp.save(first, storage_writer=FsspecStorageWriter(tmp_path / "step-1", incremental=True))
    dcp.save(second, storage_writer=FsspecStorageWriter(tmp_path / "step-2", base=tmp_path / "step-1"))
    assert _relative_paths(str(tmp_path / "step-2"))["frozen"] == "../step-1/__0_0.distcp"

    ours = _zeros()
    dcp.load(ours, storage_reader=FsspecStorageReader(tmp_path / "step-2", references=True))
    theirs = _zeros()
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(tmp_path / "step-2"))
    for got in (ours, theirs):
        assert torch.equal(got["frozen"], second["frozen"]) and torch.equal(got["adapter"], second["adapter"])
        assert got["step"] == 2


def test_a_plain_reader_refuses_a_sibling_reference_unless_told_to_follow_it(tmp_path: Path) -> None:
    first, second = _plain_states()
    dcp.save(first, storage_writer=FsspecStorageWriter(tmp_path / "step-1", incremental=True))
    dcp.save(second, storage_writer=FsspecStorageWriter(tmp_path / "step-2", base=tmp_path / "step-1"))
    # torch >= 2.9 reports a failed .metadata read as an AssertionError of its own, with our message.
    with pytest.raises(CheckpointException) as info:
        dcp.load(_zeros(), storage_reader=FsspecStorageReader(tmp_path / "step-2"))
    message = str(info.value)
    assert "references=True" in message and str(tmp_path / "step-2") in message


def test_a_base_that_is_not_a_sibling_is_refused_when_the_writer_is_made(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        FsspecStorageWriter(tmp_path / "run" / "step-2", base=tmp_path / "elsewhere" / "deeper" / "step-1")
    assert "elsewhere" in str(info.value) and "sibling" in str(info.value)


def test_a_missing_base_is_said_naming_it(tmp_path: Path) -> None:
    first, _ = _plain_states()
    with raises_through_dcp(CheckpointNotFoundError) as info:
        dcp.save(first, storage_writer=FsspecStorageWriter(tmp_path / "step-2", base=tmp_path / "step-1"))
    assert str(tmp_path / "step-1") in str(info.value) and "no checkpoint" in str(info.value)


def test_a_base_without_content_hashes_gets_a_full_save_and_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = _plain_states()
    dcp.save(first, storage_writer=FsspecStorageWriter(tmp_path / "step-1"))
    with caplog.at_level(logging.WARNING):
        dcp.save(second, storage_writer=FsspecStorageWriter(tmp_path / "step-2", base=tmp_path / "step-1"))
    assert not any(p.startswith("../") for p in _relative_paths(str(tmp_path / "step-2")).values())
    assert any("no content hashes" in r.getMessage() and "step-1" in r.getMessage() for r in caplog.records)


def test_content_hashes_left_by_another_save_are_not_trusted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A non-incremental save over a folder whose hashes describe other records: a later save
    must not refer to the new records on the strength of the old digests."""
    first, second = _plain_states()
    dcp.save(first, storage_writer=FsspecStorageWriter(tmp_path / "step-1", incremental=True))
    hashes = (tmp_path / "step-1" / CONTENT_HASHES_NAME).read_bytes()
    changed = {**first, "frozen": torch.ones(256, 256)}
    dcp.save(changed, storage_writer=FsspecStorageWriter(tmp_path / "step-1"))  # overwrites, no hashes
    (tmp_path / "step-1" / CONTENT_HASHES_NAME).write_bytes(hashes)  # the old digests, still there
    with caplog.at_level(logging.WARNING):
        dcp.save(second, storage_writer=FsspecStorageWriter(tmp_path / "step-2", base=tmp_path / "step-1"))
    got = _zeros()
    dcp.load(got, storage_reader=FsspecStorageReader(tmp_path / "step-2", references=True))
    assert torch.equal(got["frozen"], second["frozen"])
    assert any("another save" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "damage",
    [b'{"format": 1, "algorithm": "xxh3-128", "entries": [[1]]}', b"[" * 100_000, b"\xff" * 64],
    ids=["bad-entry", "deep-nesting", "not-json"],
)
def test_damaged_content_hashes_of_the_base_cost_a_full_save_and_a_warning_naming_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: bytes
) -> None:
    first, second = _plain_states()
    dcp.save(first, storage_writer=FsspecStorageWriter(tmp_path / "step-1", incremental=True))
    (tmp_path / "step-1" / CONTENT_HASHES_NAME).write_bytes(damage)
    with caplog.at_level(logging.WARNING):
        dcp.save(second, storage_writer=FsspecStorageWriter(tmp_path / "step-2", base=tmp_path / "step-1"))
    assert not any(p.startswith("../") for p in _relative_paths(str(tmp_path / "step-2")).values())
    assert any(
        CONTENT_HASHES_NAME in r.getMessage() and "every record" in r.getMessage() for r in caplog.records
    )


# -- tampered references ---------------------------------------------------------------------------


def _incremental_run(backend: Backend) -> LoraTraining:
    training = LoraTraining()
    with Checkpointer(backend.url, backend.storage_options, incremental=True) as ckpt:
        for iteration in (1, 2):
            training.step()
            ckpt.save(iteration, **training.keys())
    return training


def _point_base_at(path: str) -> Any:
    def edit(metadata: Any) -> None:
        for index, info in metadata.storage_data.items():
            if index.fqn == "base.weight":
                info.relative_path = path

    return edit


def _load_failure(backend: Backend) -> BaseException:
    with (
        Checkpointer(backend.url, backend.storage_options) as ckpt,
        pytest.raises(CorruptCheckpointError) as info,
    ):
        ckpt.load(**LoraTraining(seed=4).keys(), iteration=2)
    return info.value


@pytest.mark.parametrize(
    "path",
    [
        "../../../elsewhere/iter_000000001/model/__0_0.distcp",  # up past the run
        "../../iter_000000001/optim/__0_0.distcp",  # another key
        "../../iter_000000001/model/../../../x/__0_0.distcp",  # back out again
        "../../iter_000000002/model/__0_0.distcp",  # its own folder, from outside
    ],
    ids=["past-the-run", "another-key", "dot-dot-inside", "itself"],
)
def test_a_reference_of_another_shape_is_refused_before_reading(local_backend: Backend, path: str) -> None:
    _incremental_run(local_backend)
    url = edit_metadata(local_backend, f"{local_backend.url}/iter_000000002/model", _point_base_at(path))
    message = str(_load_failure(local_backend))
    assert url in message and repr(path) in message and "outside" in message


def test_a_reference_into_an_uncommitted_iteration_is_refused_naming_both(local_backend: Backend) -> None:
    _incremental_run(local_backend)
    fs = fsspec.filesystem("file")
    fs.copy(
        f"{local_backend.url}/iter_000000001/model",
        f"{local_backend.url}/iter_000000007/model",
        recursive=True,
    )
    edit_metadata(
        local_backend,
        f"{local_backend.url}/iter_000000002/model",
        _point_base_at("../../iter_000000007/model/__0_0.distcp"),
    )
    message = str(_load_failure(local_backend))
    assert "iter_000000002" in message and "iteration 7" in message and "not committed" in message


def test_a_reference_to_a_missing_file_is_refused_naming_both(s3_backend: Backend) -> None:
    _incremental_run(s3_backend)
    fs = fsspec.core.url_to_fs(s3_backend.url, **s3_backend.storage_options)[0]
    fs.rm(
        fsspec.core.url_to_fs(
            f"{s3_backend.url}/iter_000000001/model/__0_0.distcp", **s3_backend.storage_options
        )[1]
    )
    message = str(_load_failure(s3_backend))
    assert (
        "iter_000000001/model/__0_0.distcp" in message
        and "iter_000000002/model" in message
        and "missing" in message
    )


def test_a_reference_into_a_deleted_iteration_is_refused_naming_both(local_backend: Backend) -> None:
    _incremental_run(local_backend)
    fsspec.filesystem("file").rm(f"{local_backend.url}/iter_000000001", recursive=True)
    message = str(_load_failure(local_backend))
    assert "iter_000000002" in message and "iteration 1" in message


# -- a save killed half-way ------------------------------------------------------------------------


def _save_and_die(url: str, target: str) -> None:
    torch.set_num_threads(1)
    module, name = target.rsplit(".", 1)
    owner: Any = (
        FsspecStorageWriter if module.endswith("FsspecStorageWriter") else __import__(module, fromlist=["x"])
    )

    def die(*args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(owner, name, die)
    training = LoraTraining()
    for _ in range(3):
        training.step()
    with Checkpointer(url, incremental=True) as ckpt:
        ckpt.save(3, **training.keys())
    os._exit(0)


@pytest.mark.parametrize(
    "target",
    [
        "dcp_fsspec.storage.write.writer.FsspecStorageWriter._write_content_hashes",
        "dcp_fsspec.storage.write.writer.FsspecStorageWriter.finish",
        "dcp_fsspec.checkpoint.commit.pointer.replace_pointer",
    ],
    ids=["before-the-hashes", "before-metadata", "before-the-pointer"],
)
def test_an_incremental_save_killed_half_way_leaves_the_last_one_loadable_and_the_next_one_refers_right(
    tmp_path: Path, target: str
) -> None:
    url = str(tmp_path / "run")
    training = LoraTraining()
    with Checkpointer(url, incremental=True) as ckpt:
        for iteration in (1, 2):
            training.step()
            ckpt.save(iteration, **training.keys())
    child = multiprocessing.get_context("fork").Process(target=_save_and_die, args=(url, target))
    child.start()
    child.join(timeout=240)
    assert child.exitcode == -signal.SIGKILL

    resumed = LoraTraining(seed=8)
    with Checkpointer(url, incremental=True) as ckpt:
        assert ckpt.load(**resumed.keys()) == 2
        _assert_same(resumed, training)
        resumed.step()
        ckpt.save(3, **resumed.keys())
    training.step()
    final = LoraTraining(seed=9)
    with Checkpointer(url) as ckpt:
        assert ckpt.load(**final.keys()) == 3
    _assert_same(final, resumed)
    assert (
        _relative_paths(f"{url}/iter_000000003/model")["base.weight"]
        == "../../iter_000000001/model/__0_0.distcp"
    )


# -- FSDP2 on two ranks ----------------------------------------------------------------------------


def _fsdp_rank(rank: int, world_size: int, url: str, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    training = LoraTraining()
    fully_shard(training.model, mesh=mesh)
    training.optimizer = torch.optim.AdamW(
        [p for p in training.model.parameters() if p.requires_grad], lr=1e-2
    )
    with Checkpointer(url, incremental=True) as ckpt:
        for iteration in (1, 2):
            training.step()
            ckpt.save(iteration, **training.keys())
    full = get_model_state_dict(
        training.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    resumed = LoraTraining(seed=6)
    fully_shard(resumed.model, mesh=mesh)
    resumed.optimizer = torch.optim.AdamW([p for p in resumed.model.parameters() if p.requires_grad], lr=1e-2)
    with Checkpointer(url) as ckpt:
        assert ckpt.load(**resumed.keys()) == 2
    again = get_model_state_dict(
        resumed.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        assert full.keys() == again.keys()
        for name in full:
            assert torch.equal(full[name], again[name]), name
        torch.save(full, out)


@pytest.mark.slow
def test_fsdp2_on_two_ranks_saves_incrementally_and_loads_bit_exact_on_two_and_on_one(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    out = str(tmp_path / "full.pt")
    run_ranks(_fsdp_rank, 2, tmp_path, url, out)
    metadata = pickle.loads((tmp_path / "run" / "iter_000000002" / "model" / METADATA_NAME).read_bytes())
    base = {
        info.relative_path for index, info in metadata.storage_data.items() if index.fqn.startswith("base.")
    }
    # Each rank's shard of the frozen base is in that rank's file of iteration 1.
    assert base == {"../../iter_000000001/model/__0_0.distcp", "../../iter_000000001/model/__1_0.distcp"}
    full = torch.load(out)
    single = Lora(seed=7)
    with Checkpointer(url) as ckpt:  # one rank: resharded
        assert ckpt.load(model=single) == 2
    for name, value in single.state_dict().items():
        assert torch.equal(value, full[name]), name


def test_a_base_that_is_not_committed_is_refused_by_name(tmp_path: Path) -> None:
    """The writer's base must hold a checkpoint: a folder without .metadata is not one."""
    (tmp_path / "step-1").mkdir()
    with raises_through_dcp(CheckpointNotFoundError) as info:
        dcp.save(
            _plain_states()[0],
            storage_writer=FsspecStorageWriter(tmp_path / "step-2", base=tmp_path / "step-1"),
        )
    assert str(tmp_path / "step-1") in str(info.value)
