"""``FsspecStorageReader``: a DCP StorageReader for any fsspec URL.

It loads checkpoints in torch's format (ours, or ``FileSystemWriter``'s / ``FsspecWriter``'s).
Instead of reading each file front to back and running ``torch.load`` per tensor, it collects
every byte range the load plan needs, sorts and coalesces them, downloads them concurrently in a
bounded window (:mod:`~dcp_fsspec.storage.read.fetch`), and decodes each record as its bytes arrive with the decoder
verification uses too (:mod:`~dcp_fsspec.storage.read.record_stream`): a tensor's storage bytes are copied straight into the
destination tensor and checked against the CRC-32 stored with them. Records of 1 MiB and more
(from remote stores: those at least one request long) skip the window: their bytes are read into the destination tensor itself (local files with
``preadv``, S3 with the response body's ``readinto``), on a thread pool that also checksums
them, while the small records stream.
"""

from __future__ import annotations

import json
import os
import posixpath
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future as ThreadFuture
from functools import partial
from typing import Any

import fsspec
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import STORAGE_TYPES, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_fsspec.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DcpFsspecError,
    RecordFormatError,
    StorageError,
)
from dcp_fsspec.storage.backends.base import InPlaceFiles
from dcp_fsspec.storage.format.metadata_file import extent_error, metadata_url, parse_metadata, read_metadata
from dcp_fsspec.storage.format.names import METADATA_NAME
from dcp_fsspec.storage.format.references import referenced_folders
from dcp_fsspec.storage.format.transforms import UndoQueue, reader_transforms
from dcp_fsspec.storage.read.cooperative import (
    Group,
    SharedReads,
    plan_shared_reads,
    read_shared,
    share_metadata,
)
from dcp_fsspec.storage.read.delivery import LoadDecoder, LoadRecord
from dcp_fsspec.storage.read.fetch import Span, fetch_in_order, plan_spans
from dcp_fsspec.storage.read.record_stream import feed_records
from dcp_fsspec.storage.settings import ReaderSettings, split_keywords
from dcp_fsspec.storage.transport.gc_pause import collector_paused
from dcp_fsspec.storage.transport.retry import DEFAULT_RETRY, RetryPolicy
from dcp_fsspec.storage.transport.urls import UrlBound
from dcp_fsspec.storage.transport.workers import Workers

MiB = 1024 * 1024
# Records at least this big are read straight into their tensors (below it, the
# extra read of the header costs more than the copy it saves); the header is in the first bytes.
_IN_PLACE_MIN = 1 * MiB
_HEAD_BYTES = 64 * 1024
_CHECKSUM_THREADS = 4  # the CRC-32 (zlib's or ISA-L's) runs without the GIL
# A read of at most this many bytes from a store that answers on this machine (local disk,
# memory://) runs on the calling thread: a small local load spent more on handing records to
# threads and back than on reading them.
_ON_THIS_THREAD_MAX = 16 * MiB
_UNDO_THREADS = 4  # zstd decompresses without the GIL
# torch's FileSystemReader keywords, with torch's defaults.
TORCH_READER_DEFAULTS: dict[str, Any] = {"_extension_registry": None}


class FsspecStorageReader(UrlBound, StorageReader):
    """Load a DCP checkpoint from any fsspec URL.

    Use it wherever DCP takes a storage reader::

        dcp.load(state_dict, storage_reader=FsspecStorageReader("s3://bucket/ckpt", storage_options=opts))

    DCP calls, in order: :meth:`reset` → :meth:`read_metadata` → :meth:`set_up_storage_reader`
    → :meth:`prepare_local_plan` → :meth:`prepare_global_plan` → :meth:`read_data`.

    Args:
        path: the checkpoint folder: any fsspec URL or a local path.
        storage_options: options for the fsspec filesystem.
        settings: how records are read and checked: checksums, memory, request sizes,
            threads, cooperation, trust (:class:`~dcp_fsspec.ReaderSettings`).
        retry: how reads are retried on throttling, 5xx and dropped connections, and the
            deadline of each (see :class:`~dcp_fsspec.RetryPolicy`); ``None``: only the
            driver's own retries.
        process_group: the group of a cooperative load (``settings.cooperative``); ``None``: the
            default group. Every rank of the group must load together, with the group
            ``dcp.load`` is given.
        references: follow references into sibling checkpoints (``../step-10/…``), which a save
            with ``FsspecStorageWriter(base=…)`` writes beside its base; each must be a committed
            checkpoint. References into another iteration of a :class:`~dcp_fsspec.Checkpointer`
            run are followed either way. ``False``: no data file outside the folder is read.
        **keywords: torch's ``_extension_registry`` (``FileSystemReader``): where the
            ``transform_descriptors`` of transformed records (``stream.zstd/1``…) are looked up;
            default torch's registry, which knows ``ZStandard``. A transformed record is fetched
            whole and its transforms undone on the loading thread before it is decoded and
            checksummed. Any other keyword is a storage option (``anon=True``), as in torch's
            ``FsspecReader``; prefer ``storage_options``.

    Attributes:
        metadata_failure: why ``.metadata`` could not be used, once a read of it failed (not
            for a missing one). ``dcp.load`` in torch >= 2.9 turns that error into an
            ``AssertionError`` of its own; pass this to :func:`~dcp_fsspec.storage.transport.error_wrapping.unwrap_dcp` to raise ours.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        *,
        settings: ReaderSettings | None = None,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        process_group: dist.ProcessGroup | None = None,
        references: bool = False,
        _fs: fsspec.AbstractFileSystem | None = None,
        **keywords: Any,
    ) -> None:
        super().__init__()
        torch_keywords, options = split_keywords(
            type(self).__name__, ReaderSettings, TORCH_READER_DEFAULTS, storage_options, keywords
        )
        settings = settings or ReaderSettings()
        self._bind(path, options, _fs, retry)
        self.transforms = reader_transforms(torch_keywords["_extension_registry"])
        self.settings = settings
        self.cooperative = bool(settings.cooperative)
        self.process_group = process_group
        self.references = references
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}
        self.state_dict_metadata: dict[str, STORAGE_TYPES] = {}  # bounds what a transformed record expands to
        self.load_id = uuid.uuid4().hex
        self.metadata_failure: DcpFsspecError | None = None
        self._bad_extent: CorruptCheckpointError | None = None  # raised by set_up_storage_reader
        self._undo_queue: UndoQueue | None = None  # during read_data, when records are transformed

    # --- DCP protocol -----------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        self.state_dict_metadata = {}
        self._rebind(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self.metadata_failure = None
        self._bad_extent = None

    @collector_paused()
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read ``.metadata``; a missing one means there is no committed checkpoint here.

        A record at a negative offset or of no length is not raised here:
        :meth:`set_up_storage_reader` raises it. torch >= 2.9 swallows any error of this step and
        reports an ``AssertionError`` of its own, while the next step's errors reach the caller.

        Raises:
            CheckpointNotFoundError: there is no ``.metadata``.
            CorruptCheckpointError: it is damaged, names a data file outside the folder, or
                (unless ``trust_checkpoint``) names a class DCP metadata does not consist of;
                nothing it names was run.
        """
        if isinstance(self.metadata_failure, CorruptCheckpointError):
            # DCP retries a failed read with the rank's own ``__{rank}.metadata``; a .metadata that
            # is there but damaged or refused is not a reason to read another file instead.
            raise self.metadata_failure
        rank = kwargs.get("rank")
        read = partial(
            read_metadata,
            self.location,
            rank,
            trust_checkpoint=self.settings.trust_checkpoint,
            extents=False,
            references=self.references,
        )
        group = self._group() if rank is None else None
        try:
            if group is None:
                metadata = read()
            else:
                url = metadata_url(self.location)
                parse = partial(
                    parse_metadata,
                    url=url,
                    trust_checkpoint=self.settings.trust_checkpoint,
                    extents=False,
                    references=self.references,
                )
                metadata = share_metadata(read, parse, group)
        except CheckpointNotFoundError:
            raise
        except DcpFsspecError as e:
            self.metadata_failure = self.metadata_failure or e
            raise
        self._bad_extent = extent_error(metadata, metadata_url(self.location, rank))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Take the records ``metadata`` lists.

        Raises:
            CorruptCheckpointError: ``metadata`` lists no records, or :meth:`read_metadata` found
                one at a negative offset or of no length; the message names the entry and the file.
        """
        if self._bad_extent is not None:
            raise self._bad_extent
        if metadata.storage_data is None:
            raise CorruptCheckpointError(f"the .metadata of {self.location.url!r} lists no storage data")
        self.storage_data = metadata.storage_data
        self.state_dict_metadata = metadata.state_dict_metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Check, before any byte lands in a target, that every data file the plan reads is there
        and long enough for every record it needs (one listing per folder of data files, no
        request per file).

        DCP calls it on every rank before the ranks exchange their plans, so a failure here
        reaches every rank before any of them reads: the state dict is left untouched. What it
        cannot see — a record damaged inside a file of the right size — still fails mid-way, in
        :meth:`read_data`.

        Raises:
            CorruptCheckpointError: ``.metadata`` has no entry for an item, or a data file it
                names is missing or shorter than the records in it; the message names the file.
            StorageError: the listing failed.
        """
        needed = self._needed_ends(plan)
        group = self._group()
        sizes: dict[str, int] = {}
        if group is not None:  # a collective: every rank enters it, whatever it needs
            sizes = self._shared_sizes(group)
        elif needed:
            sizes = self._listed_sizes({posixpath.dirname(rel) for rel in needed})
        if needed:
            self._check_references(referenced_folders(needed), sizes)
            self._check_sizes(needed, sizes)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Cooperative: give each record several ranks need to one of them (see ``cooperative``)."""
        group = self._group()
        if group is None or len(plans) != group.size:
            return plans  # DCP runs over another group, or none: each rank reads alone
        round_bytes = max(self.settings.max_request_bytes, self.settings.window_bytes // group.size)
        return plan_shared_reads(
            plans,
            self.storage_data,
            piece_bytes=self.settings.max_request_bytes,
            round_bytes=round_bytes,
            max_gap=self.settings.max_gap_bytes,
        )

    @collector_paused()
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fetch every record the plan needs, concurrently and in file order, into the targets.

        A cooperative plan's shared records come through the exchange first; every rank enters it.
        """
        if isinstance(plan.storage_data, SharedReads):
            group = self._group()
            assert group is not None  # prepare_global_plan shared reads over it
            records = read_shared(
                plan.storage_data,
                group,
                self.location,
                partial(self._records_for, plan),
                lambda r: LoadDecoder(r, planner, self),
                self._load_error,
                window_bytes=self.settings.window_bytes // group.size,
                threads=self.settings.threads,
            )
        else:
            records = self._records_for(plan)
        undo = self._undo_queue = UndoQueue(_UNDO_THREADS) if any(r.transforms for r in records) else None
        files = self.location.backend.in_place_files()
        small_here = self.location.answers_locally and sum(r.length for r in records) <= _ON_THIS_THREAD_MAX
        threads = 0 if small_here else self.settings.threads
        pools = (
            (Workers("read", threads), Workers("crc", threads and _CHECKSUM_THREADS))
            if files is not None
            else ()
        )
        try:
            in_place: list[ThreadFuture[Callable[[], None]]] = []
            if files is not None:
                records, in_place = self._start_in_place(records, planner, files, pools)
            self._stream_records(records, planner, threads)  # the small ones, while the big ones are read
            for deliver in in_place:
                deliver.result()()
            if undo is not None:
                undo.drain()
        except Exception as e:
            error = self._load_error(e)
            if error is e:
                raise
            raise error from e
        finally:
            for pool in pools:  # the reads first: a checksum task may be waiting for one
                pool.close()
            if files is not None:
                files.close()
            if undo is not None:
                undo.close()
            self._undo_queue = None
        done: Future[None] = Future()
        done.set_result(None)
        return done

    # --- internals --------------------------------------------------------------------------

    def _group(self) -> Group | None:
        """The group of a cooperative load, when it has several ranks."""
        if not (self.cooperative and dist.is_available() and dist.is_initialized()):
            return None
        group = Group(self.process_group)
        return group if group.size > 1 else None

    def _load_error(self, e: Exception) -> Exception:
        """The error of ours a failure of :meth:`read_data` is raised as (``e`` itself if none)."""
        if isinstance(e, FileNotFoundError) and not isinstance(e, DcpFsspecError):
            error: Exception = CorruptCheckpointError(
                f"a data file of checkpoint {self.location.url!r} is missing: {e}"
            )
        elif isinstance(e, RecordFormatError):  # the decoder's own; never the user's to see
            error = CorruptCheckpointError(
                f"a record of checkpoint {self.location.url!r} cannot be decoded: {e}"
            )
        elif isinstance(e, OSError) and not isinstance(e, DcpFsspecError):
            error = StorageError(f"cannot read checkpoint data from {self.location.url!r}: {e}")
        else:
            return e
        error.__cause__ = e
        return error

    def _needed_ends(self, plan: LoadPlan) -> dict[str, tuple[int, str]]:
        """Per data file (relative path) the plan reads: where its last needed record ends, and
        the entry that record belongs to (for the message)."""
        needed: dict[str, tuple[int, str]] = {}
        for item in plan.items:
            info = self._storage_info(item)
            end = info.offset + info.length
            if end > needed.get(info.relative_path, (-1, ""))[0]:
                needed[info.relative_path] = (end, item.storage_index.fqn)
        return needed

    def _shared_sizes(self, group: Group) -> dict[str, int]:
        """The sizes of every data file ``.metadata`` names, listed by rank 0 and broadcast: a
        cooperative load lists each folder once, not once per rank.

        Raises: on every rank, what the listing raised on rank 0.
        """
        sizes: dict[str, int] = {}
        error: BaseException | None = None
        if group.rank == 0:
            folders = {posixpath.dirname(info.relative_path) for info in self.storage_data.values()}
            try:
                sizes = self._listed_sizes(folders)
            except DcpFsspecError as e:
                error = e
        group.agree(error)
        shared = group.broadcast_bytes(json.dumps(sizes).encode() if group.rank == 0 else b"", 0)
        return sizes if group.rank == 0 else json.loads(bytes(shared))

    def _listed_sizes(self, folders: set[str]) -> dict[str, int]:
        """The size of every file in ``folders`` (relative to the checkpoint), by relative path:
        one listing each — almost always the checkpoint folder alone."""
        sizes: dict[str, int] = {}
        for folder in folders:
            path = self.location.join(folder) if folder else self.location.path
            self.location.backend.invalidate(path)  # s3fs caches listings; the files may be new
            try:
                entries = self.location.backend.call("ls", path, detail=True)
            except (FileNotFoundError, NotADirectoryError):
                continue  # every file named there is reported missing
            for entry in entries:
                if entry.get("type") != "directory":
                    name = posixpath.basename(str(entry["name"]).rstrip("/"))
                    sizes[posixpath.join(folder, name)] = int(entry.get("size") or 0)
        return sizes

    def _check_references(self, folders: set[str], sizes: dict[str, int]) -> None:
        """Every checkpoint this one refers to (an incremental save's base) is committed."""
        for folder in sorted(folders):
            if posixpath.join(folder, METADATA_NAME) not in sizes:
                raise CorruptCheckpointError(
                    f"the checkpoint {self.location.url!r} refers to records of "
                    f"{self.location.url_of(self.location.join(folder))!r}, which is not a committed checkpoint "
                    "(no .metadata): it was deleted or never finished; nothing was loaded. Load another checkpoint"
                )

    def _check_sizes(self, needed: dict[str, tuple[int, str]], sizes: dict[str, int]) -> None:
        for rel, (end, fqn) in sorted(needed.items()):
            url = self.location.url_of(self.location.join(rel))
            size = sizes.get(rel)
            if size is None:
                raise CorruptCheckpointError(
                    f"data file {url!r} is missing (the .metadata of {self.location.url!r} names it for "
                    f"{fqn!r}); nothing was loaded. Restore it or load another checkpoint"
                )
            if size < end:
                raise CorruptCheckpointError(
                    f"data file {url!r} is truncated: {size} bytes, but {fqn!r} is stored up to byte {end}; "
                    "nothing was loaded. Restore it or load another checkpoint"
                )

    def _start_in_place(
        self, records: list[LoadRecord], planner: LoadPlanner, files: InPlaceFiles, pools: tuple[Workers, ...]
    ) -> tuple[list[LoadRecord], list[ThreadFuture[Callable[[], None]]]]:
        """Start reading big records' tensor bytes straight into their targets,
        several at once and checksummed on pool threads (no window, no copy).

        Returns the records left to stream, and per started record a future of the step that
        delivers it (on the caller's thread: the planner is not ours to call concurrently). Each
        header is read first, so the decoder picks the target as it does when streaming; a record
        it must buffer (a resharded read, say) is read whole into its buffer instead.
        """
        reads, checks = pools
        at_least = (
            _IN_PLACE_MIN
            if self.location.answers_locally
            else max(_IN_PLACE_MIN, self.settings.max_request_bytes)
        )
        big = [r for r in records if r.length >= at_least]
        heads = [reads.submit(files.read, r.path, min(r.length, _HEAD_BYTES), r.offset) for r in big]
        started = []
        for rec, head_read in zip(big, heads):
            head = head_read.result()
            # Before a buffer is sized by what .metadata claims, the bytes must be there.
            self._check_read(rec, min(files.size(rec.path) - rec.offset, rec.length), rec.length)
            self._check_read(rec, len(head), min(rec.length, _HEAD_BYTES))
            decoder = LoadDecoder(rec, planner, self)
            decoder.feed(memoryview(head))
            dest, start = decoder.rest_in_place()
            pieces = [
                (
                    p,
                    reads.submit(
                        files.read_into,
                        rec.path,
                        rec.offset + start + p,
                        dest[p : p + self.settings.max_request_bytes],
                    ),
                )
                for p in range(0, len(dest), self.settings.max_request_bytes)
            ]
            started.append(checks.submit(self._checksum_when_read, decoder, pieces, files))
        return [r for r in records if r.length < at_least], started

    def _checksum_when_read(
        self, decoder: LoadDecoder, pieces: list[tuple[int, ThreadFuture[int]]], files: InPlaceFiles
    ) -> Callable[[], None]:
        dest, _ = decoder.rest_in_place()
        for piece, read in pieces:
            self._check_read(
                decoder.record, read.result(), min(self.settings.max_request_bytes, len(dest) - piece)
            )
        return decoder.checksum_in_place(files)

    def _check_read(self, rec: LoadRecord, got: int, wanted: int) -> None:
        if got != wanted:
            raise CorruptCheckpointError(
                f"{rec.url!r} is truncated: needed bytes [{rec.offset}, {rec.end}) but the file ends "
                "before; restore it or load another checkpoint"
            )

    def _stream_records(self, records: list[LoadRecord], planner: LoadPlanner, threads: int) -> None:
        """Fetch records concurrently and in file order, decoding each as its bytes arrive."""
        spans = plan_spans(
            [(r.path, r.offset, r.end) for r in records],
            max_gap=self.settings.max_gap_bytes,
            max_span=self.settings.max_request_bytes,
        )
        records.sort(key=lambda r: (r.path, r.offset))
        fetched = fetch_in_order(
            self.location.fs,
            spans,
            window_bytes=self.settings.window_bytes,
            threads=threads,
            retry=self.location.retry,
        )
        feed_records(records, self._whole_spans(fetched), lambda i: LoadDecoder(records[i], planner, self))

    def _whole_spans(
        self, fetched: Iterator[tuple[Span, bytes | bytearray]]
    ) -> Iterator[tuple[Span, bytes | bytearray]]:
        for span, data in fetched:
            if len(data) != span.size:
                raise CorruptCheckpointError(
                    f"{self.location.url_of(span.path)!r} is truncated: needed bytes "
                    f"[{span.start}, {span.end}) but got {len(data)}; restore it or load another checkpoint"
                )
            yield span, data

    def _records_for(self, plan: LoadPlan) -> list[LoadRecord]:
        """One entry per distinct stored record, with every read item that needs it."""
        by_location: dict[tuple[str, int, int], LoadRecord] = {}
        files: dict[str, tuple[str, str]] = {}  # relative path → (path, URL), a few per rank
        for item in plan.items:
            info = self._storage_info(item)
            key = (info.relative_path, info.offset, info.length)
            rec = by_location.get(key)
            if rec is None:
                file = files.get(info.relative_path)
                if file is None:
                    path = self.location.join(info.relative_path)
                    file = files[info.relative_path] = (path, self.location.url_of(path))
                rec = by_location[key] = LoadRecord(
                    path=file[0],
                    url=file[1],
                    offset=info.offset,
                    length=info.length,
                    transforms=tuple(info.transform_descriptors or ()),
                )
            rec.items.append(item)
        return list(by_location.values())

    def _storage_info(self, item: ReadItem) -> _StorageInfo:
        info = self.storage_data.get(item.storage_index)
        if info is None:
            raise CorruptCheckpointError(
                f"the .metadata of {self.location.url!r} has no storage entry for {item.storage_index.fqn!r}"
            )
        return info
