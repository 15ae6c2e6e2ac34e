"""The backend contract (:mod:`dcp_fsspec.storage.backends.base`), against every backend.

Each core method's guarantee, and those of the defaults built on the core, run on every
``backend`` fixture (each backend's own implementation or the default). The memory backend
implements the core and nothing else; a Checkpointer's save, commit and load run on it.
"""

from __future__ import annotations

import posixpath
import threading

import pytest
import torch

from dcp_fsspec import Checkpointer
from dcp_fsspec.storage.backends import Backend as StoreBackend
from dcp_fsspec.storage.backends import Versioned
from dcp_fsspec.storage.backends.memory import MemoryBackend
from dcp_fsspec.storage.backends.uploads import MIN_PART_SIZE, ByteBudget, FileUpload, publish_whole
from dcp_fsspec.storage.transport.urls import Location, resolve
from tests.conftest import Backend

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CORE = {"read_range", "read_versioned", "new_upload", "find", "remove_files", "replace_if_unchanged"}
FLAGS = {
    "real_folders",
    "shared_across_processes",
    "answers_locally",
    "conditional_writes",
    "exclusive_across_processes",
}


def _where(backend: Backend) -> Location:
    return resolve(backend.url, backend.storage_options)


def _upload(where: Location, name: str) -> FileUpload:
    path = where.join(*name.split("/"))
    where.backend.make_folder(posixpath.dirname(path))
    return where.backend.new_upload(path, part_size=MIN_PART_SIZE, budget=ByteBudget(MIN_PART_SIZE))


def _put(where: Location, name: str, data: bytes) -> str:
    upload = _upload(where, name)
    publish_whole(upload, [data])
    return upload.path


def _files(where: Location, path: str) -> dict[str, int]:
    return {name: info["size"] for name, info in where.backend.find(path).items()}


# -- the core ------------------------------------------------------------------------------------


def test_backend_requires_exactly_the_core_and_the_memory_backend_implements_nothing_else() -> None:
    assert StoreBackend.__abstractmethods__ == CORE
    own = {name for name in vars(MemoryBackend) if not name.startswith("_")}
    assert own == CORE | {"shared_across_processes", "answers_locally", "exclusive_across_processes"}
    assert own <= CORE | FLAGS


def test_read_range_returns_the_bytes_asked_for_and_fewer_only_where_the_file_ends(backend: Backend) -> None:
    where = _where(backend)
    data = bytes(range(256)) * 40
    path = _put(where, "d/file", data)
    assert where.backend.read_range(path, 0, 10) == data[:10]
    assert where.backend.read_range(path, 1000, 3000) == data[1000:3000]
    assert where.backend.read_range(path, len(data) - 5, len(data) + 100) == data[-5:]
    reader = where.backend.range_reader()
    try:
        assert reader.read(path, 7, 300) == data[300:307]
    finally:
        reader.close()


def test_read_range_of_a_missing_file_raises_file_not_found(backend: Backend) -> None:
    where = _where(backend)
    _put(where, "d/other", b"x")
    with pytest.raises(FileNotFoundError):
        where.backend.read_range(where.join("d", "absent"), 0, 1)


def test_read_versioned_reads_a_small_file_whole_and_none_where_it_is_absent(backend: Backend) -> None:
    where = _where(backend)
    path = _put(where, "d/small", b"v1")
    assert where.backend.read_versioned(path).data == b"v1"
    assert where.backend.read_versioned(where.join("d", "absent")) == Versioned(None)
    assert where.backend.read_versioned(where.join("nowhere", "absent")).data is None


def test_an_upload_is_invisible_until_it_commits_and_an_aborted_one_leaves_nothing(backend: Backend) -> None:
    where = _where(backend)
    folder = where.join("d")
    upload = _upload(where, "d/data")
    upload.write([b"a" * 1000, memoryview(b"b" * 1000)])
    assert upload.path not in where.backend.find(folder)
    assert where.backend.read_versioned(upload.path).data is None
    upload.abort()
    assert _files(where, folder) == {}

    publish_whole(_upload(where, "d/data"), [b"a" * 1000, b"b" * 1000])
    assert _files(where, folder) == {upload.path: 2000}
    assert where.backend.read_versioned(upload.path).data == b"a" * 1000 + b"b" * 1000


def test_an_upload_replaces_an_existing_file_whole_on_commit(backend: Backend) -> None:
    where = _where(backend)
    path = _put(where, "d/data", b"old" * 100)
    upload = _upload(where, "d/data")
    upload.write([b"new" * 50])
    assert where.backend.read_versioned(path).data == b"old" * 100
    upload.commit()
    assert where.backend.read_versioned(path).data == b"new" * 50


def test_find_lists_every_file_with_its_size_folders_with_withdirs_and_nothing_for_a_missing_path(
    backend: Backend,
) -> None:
    where = _where(backend)
    paths = {_put(where, name, b"x" * size): size for name, size in [("a/1", 1), ("a/b/2", 20), ("c/3", 300)]}
    assert _files(where, where.path) == paths
    assert _files(where, where.join("a")) == {p: s for p, s in paths.items() if "/a/" in p}
    folders = where.backend.find(where.join("a"), withdirs=True)
    assert where.join("a", "b") in folders and folders[where.join("a", "b", "2")]["size"] == 20
    assert set(paths) - {where.join("c", "3")} < set(folders)
    assert where.backend.find(where.join("nothing")) == {}
    assert where.backend.find(where.join("a", "nothing"), withdirs=True) == {}


def test_remove_files_deletes_those_named_and_nothing_else_and_absent_ones_are_fine(backend: Backend) -> None:
    where = _where(backend)
    kept = _put(where, "d/kept", b"k")
    gone = [_put(where, f"d/gone{i}", b"g") for i in range(3)]
    where.backend.remove_files([*gone, where.join("d", "never_there")], within=where.path)
    assert _files(where, where.path) == {kept: 1}
    for path in gone:
        assert where.backend.read_versioned(path).data is None
    where.backend.remove_files(gone, within=where.path)  # all absent now


def test_replace_if_unchanged_under_exclusive_never_loses_an_update(backend: Backend) -> None:
    """Threads incrementing one counter the way the pointer moves: read, then replace if unchanged."""
    where = _where(backend)
    where.backend.make_folder(where.path)
    path, threads, rounds = where.join("counter"), 4, 5
    errors: list[BaseException] = []

    def increment() -> None:
        try:
            for _ in range(rounds):
                while True:
                    with where.backend.exclusive(where.path):
                        read = where.backend.read_versioned(path)
                        value = int(read.data or b"0") + 1
                        if where.backend.replace_if_unchanged(path, str(value).encode(), read):
                            break
        except BaseException as e:  # noqa: BLE001 - re-raised by the test's thread below
            errors.append(e)

    workers = [threading.Thread(target=increment) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=240)
    assert not errors, errors
    assert where.backend.read_versioned(path).data == str(threads * rounds).encode()


def test_replace_if_unchanged_refuses_a_stale_expectation_where_the_store_compares(backend: Backend) -> None:
    where = _where(backend)
    if not (where.backend.conditional_writes or isinstance(where.backend, MemoryBackend)):
        pytest.skip(f"{backend.name}: replace_if_unchanged relies on exclusive(), a lock, not a comparison")
    where.backend.make_folder(where.path)
    path = where.join("pointer")
    assert where.backend.replace_if_unchanged(path, b"1", Versioned(None))
    assert not where.backend.replace_if_unchanged(path, b"2", Versioned(None))  # created only if absent
    first = where.backend.read_versioned(path)
    assert where.backend.replace_if_unchanged(path, b"2", first)
    assert not where.backend.replace_if_unchanged(path, b"3", first)
    assert where.backend.read_versioned(path).data == b"2"


# -- the optional members' defaults (or each backend's own) --------------------------------------


def test_write_small_atomic_creates_and_replaces_a_small_file(backend: Backend) -> None:
    where = _where(backend)
    path = where.join("d", "small")
    where.backend.make_folder(posixpath.dirname(path))
    where.backend.write_small_atomic(path, b"one")
    where.backend.write_small_atomic(path, b"two!")
    assert where.backend.read_versioned(path).data == b"two!"
    assert _files(where, where.path) == {path: 4}


def test_folder_exists_while_a_file_is_under_it(backend: Backend) -> None:
    where = _where(backend)
    _put(where, "a/b/file", b"x")
    assert where.backend.folder_exists(where.join("a"))
    assert where.backend.folder_exists(where.join("a", "b"))
    assert not where.backend.folder_exists(where.join("z"))


def test_remove_trees_deletes_everything_under_each_path_and_nothing_beside(backend: Backend) -> None:
    where = _where(backend)
    for name in ("iter_1/m/a", "iter_1/m/b", "iter_1/c", "iter_2/m/a", "iter_10/m/a", "solo"):
        _put(where, name, b"x")
    where.backend.remove_trees(
        [where.join("iter_1"), where.join("solo"), where.join("absent")], within=where.path
    )
    assert sorted(_files(where, where.path)) == [
        where.join("iter_10", "m", "a"),
        where.join("iter_2", "m", "a"),
    ]
    assert not where.backend.folder_exists(where.join("iter_1"))


# -- a backend of only the core, through the whole stack -----------------------------------------


def test_a_backend_of_only_the_core_saves_commits_and_loads_through_the_checkpointer(
    memory_backend: Backend,
) -> None:
    assert isinstance(_where(memory_backend).backend, MemoryBackend)
    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 3)}
    with Checkpointer(memory_backend.url, memory_backend.storage_options, keep_last_n=2) as ckpt:
        for iteration in (1, 2, 3):
            ckpt.save(iteration, model={name: t * iteration for name, t in state.items()})
        assert ckpt.committed_iterations() == [2, 3]
    target = {"model": {name: torch.zeros_like(t) for name, t in state.items()}}
    with Checkpointer(memory_backend.url, memory_backend.storage_options) as ckpt:
        assert ckpt.load(**target) == 3
    for name, t in state.items():
        assert torch.equal(target["model"][name], t * 3)


@pytest.mark.parametrize("name", ["memory", "local"])
def test_removes_nothing_outside_the_folder_it_is_given(request: pytest.FixtureRequest, name: str) -> None:
    backend: Backend = request.getfixturevalue(f"{name}_backend")
    location = resolve(backend.url, backend.storage_options)
    inside, outside = location.join("run", "a"), location.join("elsewhere", "b")
    for path in (inside, outside):
        location.backend.write_small_atomic(path, b"x")
    with pytest.raises(ValueError, match="elsewhere/b"):
        location.backend.remove_files([inside, outside], within=location.join("run"))
    assert location.backend.read_versioned(inside).data == b"x"  # refused before anything went
