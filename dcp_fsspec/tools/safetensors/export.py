"""A streamed export of a DCP checkpoint to Hugging Face's sharded safetensors layout, on any URL.

Every tensor's name, shape and dtype are in ``.metadata``, so the shards are planned before a
byte is read. Each shard's header is written first; its tensors then stream behind it, a batch
at a time, read with our ranged reader and written through our atomic uploads (multipart on
S3). The next batch is read on a thread while this one is written; on local disk, each batch
written is handed to the disk at once, so the closing fsync has little left to wait for.
``model.safetensors.index.json`` is written last, so a failed export leaves no index that names
a missing shard.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from dcp_fsspec.checkpoint.collectives import Collectives
from dcp_fsspec.checkpoint.commit import layout, run_listing
from dcp_fsspec.errors import CheckpointExistsError, CheckpointNotFoundError, UsageError
from dcp_fsspec.storage.backends.uploads import ByteBudget, FileUpload, publish_whole
from dcp_fsspec.storage.format.tensor_records import tensor_bytes
from dcp_fsspec.storage.read.reader import FsspecStorageReader
from dcp_fsspec.storage.settings import ReaderSettings
from dcp_fsspec.storage.transport.error_wrapping import storage_errors
from dcp_fsspec.storage.transport.urls import Location, resolve
from dcp_fsspec.storage.transport.workers import Workers
from dcp_fsspec.tools import targets
from dcp_fsspec.tools.convert import check_claimed_sizes
from dcp_fsspec.tools.progress import Progress, human_bytes
from dcp_fsspec.tools.results import WrittenFiles
from dcp_fsspec.tools.safetensors.batches import DTYPE_NAMES, Entry, batches, header, read_batch
from dcp_fsspec.tools.safetensors.pieces import check_tiling, open_pieces

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # Hugging Face's "5GB"
DEFAULT_BUFFER_BYTES = 32 * MiB
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
MODEL_KEY = "model"  # the key of a Checkpointer iteration that is exported

_PART_SIZE = 8 * MiB
_UPLOAD_BUDGET = 32 * MiB
_READ_AHEAD_ROLE = "export-read-ahead"  # its own pool: its task waits for the readers' tasks

# Output dtypes ``dtype=`` accepts, by the names the CLI takes.
OUTPUT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}

KeyMap = Callable[[str], "str | None"]
T = TypeVar("T")


@dataclass
class ExportResult(WrittenFiles):
    """What an export read and wrote, and the ``shards`` (file names) it wrote."""

    shards: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """Each entry left out, then what was written."""
        return self._lines(f"{self.out}: {len(self.shards)} shards, ", "tensors")


# The library face of to-safetensors: one keyword per flag of the command.
def export_safetensors(  # noqa: PLR0913
    url: str | os.PathLike[str],
    out: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    out_storage_options: dict[str, Any] | None = None,
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    key_map: KeyMap | None = None,
    config: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    progress: Progress | None = None,
    trust_checkpoint: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> ExportResult:
    """Write the tensors at ``url`` as a sharded safetensors folder at ``out`` (both any URL).

    A DCP checkpoint exports its tensors; an iteration folder or a save_dirname (its latest
    iteration) exports its ``model`` key. The tensors stream a buffer at a time, and the next
    buffer is read while this one is written. Memory held is about ``buffer_bytes``: two
    buffers of half of it each, plus the uploads in flight, at every tensor size: a larger
    tensor streams in pieces.

    Args:
        max_shard_size: the most tensor bytes in one shard; a larger tensor gets a shard of its own.
        dtype: cast floating-point tensors to it (float32, float16 or bfloat16); others keep theirs.
        key_map: the output name of each checkpoint name, or None to leave that tensor out.
        config: a local ``config.json`` (or any URL) copied into ``out``.
        overwrite: replace an existing ``out``.
        trust_checkpoint: unpickle ``.metadata`` in full (runs any code it holds); by default
            only DCP metadata's classes load.
        process_group: export together with every rank of this group, each calling with the
            same arguments. Rank r writes shards r, r + W, ... and reads only their tensors;
            rank 0 writes the index once every rank is done. A failure on any rank removes
            every shard and raises on every rank. ``None``: this process alone.

    Raises:
        CheckpointExistsError: ``out`` exists and ``overwrite`` is False.
        UsageError: two names map to one, a bad ``dtype``, or a value ``dtype`` cannot hold.
        CheckpointNotFoundError, CorruptCheckpointError, StorageError: as the reader raises them.
    """
    start = time.perf_counter()
    ranks = Collectives(process_group, alone=process_group is None)
    plan = _agreed(
        ranks,
        partial(
            _plan,
            url,
            out,
            storage_options,
            out_storage_options,
            max_shard_size=max_shard_size,
            dtype=dtype,
            key_map=key_map,
            trust_checkpoint=trust_checkpoint,
        ),
    )
    # Nothing is written before here: every check above leaves ``out`` as it was.
    existed, config_bytes = ranks.run_on_rank0(partial(_prepare_output, plan.target, overwrite, config))
    extra = [CONFIG_NAME] if config_bytes is not None else []

    def remove(names: Sequence[str]) -> None:
        _remove_partial(plan.target, [*names, *extra], remove_folder=not existed)

    _write_agreed(plan, ranks, buffer_bytes, progress, remove)
    ranks.run_on_rank0(partial(_write_index, plan, config_bytes, remove))
    plan.result.tensors = len(plan.entries)
    plan.result.seconds = time.perf_counter() - start
    logger.info(
        "exported %s to %s (%s)", plan.result.src, plan.target.url, human_bytes(plan.result.bytes_written)
    )
    return plan.result


@dataclass
class _Plan:
    """What every rank knows before a byte is written: the tensors, their shards, the reader."""

    target: Location
    reader: FsspecStorageReader
    metadata: Metadata
    entries: list[Entry]
    shards: list[list[Entry]]
    result: ExportResult

    def file_name(self, number: int) -> str:
        """The file name of shard ``number`` (from 0)."""
        return f"model-{number + 1:05d}-of-{len(self.shards):05d}.safetensors"


def _plan(
    url: str | os.PathLike[str],
    out: str | os.PathLike[str],
    storage_options: dict[str, Any] | None,
    out_storage_options: dict[str, Any] | None,
    *,
    max_shard_size: int,
    dtype: torch.dtype | None,
    key_map: KeyMap | None,
    trust_checkpoint: bool,
) -> _Plan:
    """Every check that needs no write: the options, the source, its ``.metadata``, the names."""
    _check_options(out, dtype, max_shard_size)
    source = _source(resolve(url, storage_options))
    target = resolve(out, out_storage_options)
    reader = FsspecStorageReader(
        source.url, settings=ReaderSettings(trust_checkpoint=trust_checkpoint), _fs=source.fs
    )
    metadata = reader.read_metadata()
    check_claimed_sizes(metadata, source.url, None)
    reader.set_up_storage_reader(metadata, True)
    result = ExportResult(source.url, target.url)
    entries = _entries(metadata, dtype, key_map or _same, target.url, result.left_out)
    for entry in entries:
        meta = metadata.state_dict_metadata[entry.fqn]
        assert isinstance(meta, TensorStorageMetadata)  # _entries keeps tensors only
        check_tiling(entry, [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks], source.url)
    return _Plan(target, reader, metadata, entries, _plan_shards(entries, max_shard_size), result)


def _agreed(ranks: Collectives, make: Callable[[], T]) -> T:
    """``make()`` on every rank; if it fails on any, every rank raises."""
    value: T | None = None
    error: Exception | None = None
    try:
        value = make()
    except Exception as e:  # noqa: BLE001 - raised below, on every rank
        error = e
    ranks.raise_if_any_failed(error)
    assert value is not None
    return value


def _prepare_output(
    target: Location, overwrite: bool, config: str | os.PathLike[str] | None
) -> tuple[bool, bytes | None]:
    """On rank 0: refuse or clear an existing ``out``, read the config, make the folder.

    Returns whether ``out`` existed, and the config's bytes.
    """
    existed = _check_output(target, overwrite)
    config_bytes = _read_config(config) if config is not None else None
    if existed:
        _remove_export(target)
    with storage_errors("create", target.url):
        target.backend.make_folder(target.path)
    return existed, config_bytes


def _write_agreed(
    plan: _Plan,
    ranks: Collectives,
    buffer_bytes: int,
    progress: Progress | None,
    remove: Callable[[list[str]], None],
) -> None:
    """Write this rank's shards (r, r + W, ...); if any rank failed, rank 0 removes every shard and all raise.

    Counts every rank's shards into ``plan.result``.
    """
    mine = range(ranks.rank, len(plan.shards), ranks.world_size)
    if progress is not None:
        progress.add_total(sum(e.source_bytes for n in mine for e in plan.shards[n]))
    names: list[str] = []
    nbytes = 0
    error: BaseException | None = None
    try:
        for number in mine:
            name = plan.file_name(number)
            nbytes += _write_shard(
                plan.reader, plan.metadata, plan.shards[number], plan.target, name, buffer_bytes, progress
            )
            names.append(name)
    except BaseException as e:  # noqa: BLE001 - raised below, once what was written is removed
        error = e
    everyone = ranks.all_gather((names, nbytes, error is not None))
    plan.result.shards = sorted(name for names_of_rank, _, _ in everyone for name in names_of_rank)
    plan.result.bytes_written = sum(n for _, n, _ in everyone)
    if ranks.rank == 0 and any(failed for _, _, failed in everyone):
        remove(plan.result.shards)
    if error is not None and not isinstance(error, Exception):
        raise error  # an interrupt: this process stops here
    ranks.raise_if_any_failed(error)


def _check_options(out: str | os.PathLike[str], dtype: torch.dtype | None, max_shard_size: int) -> None:
    if dtype is not None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise UsageError(f"exporting to {os.fspath(out)}: dtype {dtype} is not float32, float16 or bfloat16")
    if max_shard_size <= 0:
        raise UsageError(
            f"exporting to {os.fspath(out)}: the max shard size must be positive, not {max_shard_size}"
        )


def _write_index(plan: _Plan, config_bytes: bytes | None, remove: Callable[[list[str]], None]) -> None:
    """On rank 0, after every shard: ``config.json`` if given, then the index, which marks the export complete."""
    weight_map = {e.name: plan.file_name(n) for n, shard in enumerate(plan.shards) for e in shard}
    index = {
        "metadata": {"total_size": sum(e.nbytes for e in plan.entries)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    try:
        if config_bytes is not None:
            _write_small(plan.target, CONFIG_NAME, config_bytes)
        _write_small(plan.target, INDEX_NAME, json.dumps(index, indent=2).encode())
    except BaseException:
        remove(plan.result.shards)
        raise


def _same(name: str) -> str:
    return name


def _source(location: Location) -> Location:
    """The DCP checkpoint to read: ``location`` itself, or an iteration's ``model`` key."""
    target = targets.classify(location)
    if target.kind == "checkpoint":
        return target.location
    run, iteration = targets.iteration_to_read(target, "export")
    record, why_not = run_listing.inspect_iteration(run, iteration)
    if record is None:
        raise CheckpointNotFoundError(
            f"{run.url_of(layout.iteration_path(run, iteration))} {why_not}, so it is not committed and not "
            f"exported; export a committed iteration (see `dcp-fsspec ls {run.url}`)"
        )
    keys = list(record.keys)
    if MODEL_KEY not in keys:
        raise UsageError(
            f"{location.url} has no {MODEL_KEY!r} key (keys: {', '.join(keys) or 'none'}); "
            "export one key's folder instead"
        )
    return targets.key_location(run, iteration, MODEL_KEY)


def _check_output(target: Location, overwrite: bool) -> bool:
    """Whether ``target`` exists; refused unless ``overwrite``."""
    with storage_errors("check", target.url):
        exists: bool = target.fs.exists(target.path)
    if exists and not overwrite:
        raise CheckpointExistsError(
            f"{target.url} exists; choose another output or pass --overwrite (overwrite=True)"
        )
    return exists


def _remove_export(target: Location) -> None:
    """Remove a previous export's index first, then its shards, so no index names a missing shard."""
    with storage_errors("replace", target.url):
        index = posixpath.join(target.path, INDEX_NAME)
        if target.fs.exists(index):
            target.fs.rm(index)
        for path in target.fs.glob(posixpath.join(target.path, "model-*-of-*.safetensors")):
            target.fs.rm(path)


def _remove_partial(target: Location, names: list[str], *, remove_folder: bool) -> None:
    """Remove what a failed export wrote; a failure here is logged, the export's error is raised."""
    try:
        for name in names:
            path = posixpath.join(target.path, name)
            if target.fs.exists(path):
                target.fs.rm(path)
        if remove_folder and target.backend.real_folders and not target.fs.ls(target.path):
            target.fs.rmdir(target.path)
    except OSError as e:
        logger.warning("could not remove the partial export at %s: %s", target.url, e)


def _read_config(config: str | os.PathLike[str]) -> bytes:
    location = resolve(config, None)
    with storage_errors("read", location.url):
        data: bytes = location.fs.cat_file(location.path)
    try:
        json.loads(data)
    except ValueError as e:
        raise UsageError(f"{location.url} is not JSON ({e}); give a model's config.json") from e
    return data


def _entries(
    metadata: Metadata, dtype: torch.dtype | None, key_map: KeyMap, url: str, left_out: list[str]
) -> list[Entry]:
    """The tensors to export, in checkpoint order, with their output names and dtypes."""
    entries: list[Entry] = []
    by_name: dict[str, str] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            left_out.append(fqn)
            continue
        name = key_map(fqn)
        if name is None:
            continue
        if name in by_name:
            raise UsageError(
                f"exporting to {url}: the key map gives {by_name[name]!r} and {fqn!r} the same name {name!r}; "
                "map each tensor to its own name"
            )
        by_name[name] = fqn
        source_dtype = meta.properties.dtype
        if source_dtype not in DTYPE_NAMES:
            raise UsageError(
                f"exporting to {url}: {fqn!r} is {source_dtype}, which safetensors does not hold"
            )
        out_dtype = dtype if dtype is not None and source_dtype.is_floating_point else source_dtype
        entries.append(Entry(fqn, name, tuple(meta.size), source_dtype, out_dtype))
    return entries


def _plan_shards(entries: list[Entry], max_shard_size: int) -> list[list[Entry]]:
    """Hugging Face's rule: fill a shard in order until the next tensor would pass the max."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _write_shard(
    reader: FsspecStorageReader,
    metadata: Metadata,
    shard: list[Entry],
    target: Location,
    file_name: str,
    buffer_bytes: int,
    progress: Progress | None,
) -> int:
    """Write one shard: its header, then its tensors a buffer at a time. Returns its size.

    The next buffer is read on a thread while this one is written.
    """
    path = posixpath.join(target.path, file_name)
    url = target.url_of(path)
    with storage_errors("create", url):
        upload = target.backend.new_upload(path, part_size=_PART_SIZE, budget=ByteBudget(_UPLOAD_BUDGET))
    try:
        with storage_errors("write", url):
            upload.write([header(shard)])
        # Half the budget each: the buffer being written, and the next one being read.
        loaded_buffers = _loaded(reader, metadata, shard, max(1, buffer_bytes // 2), url)
        with closing(_read_ahead(loaded_buffers)) as buffers:
            for loaded in buffers:
                _send(upload, url, progress, loaded)
                del loaded  # freed before the buffer after the next one is read
                with storage_errors("write", url):
                    upload.start_writeback()  # the disk writes it while the next one is read
        with storage_errors("write", url):
            upload.commit()
    except BaseException:
        upload.abort()
        raise
    return upload.size


def _loaded(
    reader: FsspecStorageReader, metadata: Metadata, shard: list[Entry], buffer_bytes: int, url: str
) -> Generator[list[tuple[Entry, torch.Tensor]], None, None]:
    """``shard``'s tensors in order, one buffer at a time: a batch, or a piece of a tensor bigger than the buffer.

    Each buffer is read when the next is asked for; the generator keeps none once handed out.
    """
    for batch in batches(shard, buffer_bytes):
        pieces = (
            open_pieces(reader, metadata, batch[0], url) if batch[0].source_bytes > buffer_bytes else None
        )
        if pieces is None:
            yield list(zip(batch, read_batch(reader, metadata, batch, url)))
            continue
        with closing(pieces):
            yield from pieces.loaded(buffer_bytes)


def _read_ahead(buffers: Generator[T, None, None]) -> Generator[T, None, None]:
    """``buffers`` in order, the next one read on a thread while the caller writes this one.

    Close it when done: that waits for the read in flight, then closes ``buffers``.
    """
    workers = Workers(_READ_AHEAD_ROLE, 1)
    try:
        pending = workers.submit(next, buffers, None)
        while (item := pending.result()) is not None:
            pending = workers.submit(next, buffers, None)
            yield item
            del item  # written by now: only the buffer being read is held
    finally:
        workers.close()
        buffers.close()


def _send(
    upload: FileUpload, url: str, progress: Progress | None, loaded: list[tuple[Entry, torch.Tensor]]
) -> None:
    """Write one buffer's tensors, in order."""
    for entry, data in loaded:
        with storage_errors("write", url):
            upload.write([tensor_bytes(data)])
        if progress is not None:
            progress.advance(data.numel() * entry.source_dtype.itemsize)


def _write_small(target: Location, name: str, data: bytes) -> None:
    path = posixpath.join(target.path, name)
    with storage_errors("write", target.url_of(path)):
        publish_whole(
            target.backend.new_upload(path, part_size=_PART_SIZE, budget=ByteBudget(_UPLOAD_BUDGET)), [data]
        )


def load_key_map(url: str | os.PathLike[str]) -> KeyMap:
    """A key map from a JSON file (any URL) of ``{checkpoint name: output name or null}``.

    Names the file does not list keep their own.

    Raises:
        UsageError: the file is not a JSON object of strings (or nulls).
    """
    location = resolve(url, None)
    with storage_errors("read", location.url):
        data = location.fs.cat_file(location.path)
    try:
        mapping = json.loads(data)
    except ValueError as e:
        raise UsageError(
            f'{location.url} is not JSON ({e}); give {{"checkpoint name": "output name"}}'
        ) from e
    if not isinstance(mapping, dict) or not all(v is None or isinstance(v, str) for v in mapping.values()):
        raise UsageError(
            f'{location.url} is not a JSON object of names; give {{"checkpoint name": "output name"}}'
        )
    return lambda name: mapping.get(name, name)
