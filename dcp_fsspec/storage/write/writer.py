"""``FsspecStorageWriter``: a DCP StorageWriter for any fsspec URL, in torch's on-storage format.

A checkpoint is a folder of ``__{rank}_{n}.distcp`` data files and one ``.metadata`` file, the
same bytes torch's ``FileSystemWriter`` produces, so torch's readers load it. What differs is how
the bytes get there: each rank writes several files at once, each file streams straight from
tensor memory (no ``torch.save`` copy), object-store files go up as concurrent multipart parts
within a bounded memory budget, and local files are fsynced and renamed into place.
``.metadata`` is written last, by the coordinator alone: a folder without it is never a
checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_fsspec.errors import CheckpointExistsError, DcpFsspecError, StorageError, UsageError
from dcp_fsspec.storage.backends import Versioned
from dcp_fsspec.storage.backends.uploads import MIN_PART_SIZE, ByteBudget, FileUpload
from dcp_fsspec.storage.format import names
from dcp_fsspec.storage.format.content_hashes import (
    BaseRecord,
    BaseRecords,
    Hashed,
    IncrementalPrefix,
    base_of,
    content_digest,
    encode_hashes,
    read_base,
    unhashed,
)
from dcp_fsspec.storage.format.tensor_records import FramedTensor, encode_framed
from dcp_fsspec.storage.format.transforms import compression_extensions, write_transformed, writer_transforms
from dcp_fsspec.storage.settings import WriterSettings, split_keywords
from dcp_fsspec.storage.transport.error_wrapping import storage_errors
from dcp_fsspec.storage.transport.gc_pause import collector_paused
from dcp_fsspec.storage.transport.retry import DEFAULT_RETRY, RetryPolicy
from dcp_fsspec.storage.transport.urls import UrlBound
from dcp_fsspec.storage.write.file_plan import (
    TORCH_WRITER_DEFAULTS,
    WriteContext,
    check_context,
    frame_item,
    split_into_files,
    with_torch_keywords,
    write_tensor_record,
)

# torch writes this version into .metadata; keep in step so its readers see the same thing.
DCP_VERSION = "1.0.0"


class FsspecStorageWriter(UrlBound, StorageWriter, BlockingAsyncStager):
    """Write a DCP checkpoint to any fsspec URL.

    Use it wherever DCP takes a storage writer::

        dcp.save(state_dict, storage_writer=FsspecStorageWriter("s3://bucket/ckpt", storage_options=opts))

    DCP calls, in order: :meth:`reset` → :meth:`set_up_storage_writer` →
    :meth:`prepare_local_plan` (every rank) → :meth:`prepare_global_plan` (coordinator) →
    :meth:`write_data` (every rank) → :meth:`finish` (coordinator). Only the coordinator asks
    storage anything before the data: the folder, the overwrite check, the base's records.

    Guarantees: data files are complete or absent (local: temp file, fsync, rename — with
    ``file_syncs``, rename and then fsync, before the caller's commit; object stores: one PUT or
    one multipart upload, published whole); ``.metadata`` is written only in
    :meth:`finish`, after every rank's data is written, and atomically; when ``overwrite`` is
    true an existing ``.metadata`` is removed *before* new data is written, so a save that dies
    half-way leaves no checkpoint rather than a mixed one. ``.metadata`` is only ever created,
    never replaced, in :meth:`finish` (a conditional write): of two saves racing into one folder,
    the second to finish raises :class:`CheckpointExistsError` and the first's checkpoint stays.

    torch's own keywords (``overwrite``, ``sync_files``, ``thread_count``,
    ``single_file_per_rank``, ``per_thread_copy_ahead``, ``cache_staged_state_dict``,
    ``serialization_format``, ``_extensions``) keep torch's meaning and defaults, so torch code
    runs with the class swapped. Like torch's ``FsspecWriter``, any other keyword is a storage
    option. Like ``FileSystemWriter``, it is its own ``AsyncStager`` for ``dcp.async_save``.

    Args:
        path: the checkpoint folder: any fsspec URL (``s3://bucket/ckpt``, ``memory://x``) or a
            local path (``~`` and relative paths are resolved in this process).
        storage_options: options for the fsspec filesystem (credentials, ``client_kwargs``…).
        settings: how files are written: their number per rank, part sizes, the memory in
            flight, checksums, compression (:class:`~dcp_fsspec.WriterSettings`).
        retry: how storage requests are retried on throttling, 5xx and dropped connections,
            and the deadline of each (see :class:`~dcp_fsspec.RetryPolicy`); ``None``: only
            the driver's own retries.
        incremental: digest every record (xxh3-128) and store the digests beside ``.metadata``
            (``.content_hashes.json``), so that a later save can name this one as its ``base``.
        base: an earlier checkpoint of the same run to save incrementally against (implies
            ``incremental``): a record whose entry and digest are the base's is not written
            again, and ``.metadata`` refers to the base's bytes instead (``../step-10/…``). It must
            be a sibling folder (``run/step-10`` for ``run/step-20``), or the same key of another
            iteration of a :class:`~dcp_fsspec.Checkpointer` run; keep it as long as this one.
        **keywords: torch's keywords, with torch's meaning:

            * ``overwrite`` (default ``True``) replaces a committed checkpoint at the URL;
              ``False`` raises :class:`CheckpointExistsError` ("Checkpoint already exists …").
            * ``sync_files`` overrides ``settings.sync_files``.
            * ``thread_count`` is torch's name for ``settings.files_per_rank``; give one of the two.
            * ``single_file_per_rank=False`` writes one file per tensor or object instead of
              up to ``files_per_rank`` per rank (still ``files_per_rank`` at a time).
            * ``per_thread_copy_ahead`` is kept as an attribute and changes nothing: each file
              thread copies a device tensor to the CPU right before streaming it.
            * ``cache_staged_state_dict``: when ``dcp.async_save`` stages through this writer,
              keep the CPU copy and refill it on the next stage (reuse the writer).
            * ``serialization_format``: only ``SerializationFormat.TORCH_SAVE``. For safetensors
              use torch's ``HuggingFaceStorageWriter``.
            * ``_extensions``: torch's experimental stream transforms, applied to every record
              in torch's order, after ``settings.compression`` (compress, then encrypt).

            Any other keyword is a storage option (``anon=True``), as in torch's ``FsspecWriter``.
            Prefer ``storage_options``: there a misspelt name is not mistaken for an option.

    Raises:
        ValueError: ``thread_count`` below 1 or different from ``settings.files_per_rank``, an
            unknown ``serialization_format``, a ``base`` that is not a sibling checkpoint.
        TypeError: a setting given as a keyword (it goes in ``settings``), a misspelt keyword,
            an ``_extensions`` entry that is not a ``StreamTransformExtension``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        *,
        settings: WriterSettings | None = None,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        incremental: bool = False,
        base: str | os.PathLike[str] | None = None,
        _context: WriteContext | None = None,
        **keywords: Any,
    ) -> None:
        torch_keywords, options = split_keywords(
            type(self).__name__, WriterSettings, TORCH_WRITER_DEFAULTS, storage_options, keywords
        )
        settings = with_torch_keywords(settings or WriterSettings(), torch_keywords)
        context = _context or WriteContext()
        check_context(context, torch_keywords["serialization_format"])
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=torch_keywords["cache_staged_state_dict"])
        extensions = [
            *(torch_keywords["_extensions"] or ()),
            *compression_extensions(settings.compression, settings.compression_level),
        ]
        self.transforms = writer_transforms(extensions)
        self._bind(path, options, context.fs, retry)
        self.settings = settings
        self.incremental = incremental or base is not None
        self.base = None if base is None else base_of(self.location, base, options, context.fs, retry)
        self.overwrite = torch_keywords["overwrite"]
        self.single_file_per_rank = torch_keywords["single_file_per_rank"]
        self.per_thread_copy_ahead = torch_keywords["per_thread_copy_ahead"]
        self.serialization_format = torch_keywords["serialization_format"]
        self.metadata_commits = context.metadata_commits
        self.file_syncs = context.file_syncs
        self.unique_file_names = context.unique_file_names
        self._given_save_id, self.save_id = context.save_id, context.save_id or uuid.uuid4().hex
        self.is_coordinator = False
        self.rank: int | None = None
        self.use_collectives = True

    @property
    def thread_count(self) -> int:
        """torch's name for ``settings.files_per_rank``."""
        return self.settings.files_per_rank

    @property
    def sync_files(self) -> bool:
        """torch's attribute: ``settings.sync_files``."""
        return self.settings.sync_files

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A CPU copy of ``state_dict`` for ``dcp.async_save`` (torch's ``BlockingAsyncStager``).

        With ``cache_staged_state_dict`` the copy is kept and refilled on the next call, as in
        torch, but pinned only where there is an accelerator to pin it for: torch's own stager
        fails on a CPU-only machine ("Cannot access accelerator device").
        """
        if not self.cache_staged_state_dict:
            return super().stage(state_dict)
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(
                state_dict, pin_memory=torch.accelerator.is_available()
            )
        return _copy_state_dict(state_dict, self.state_dict_cache, type_check=self.type_check)

    # --- DCP protocol -----------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save, at ``checkpoint_id`` when given (so ``dcp.save(checkpoint_id=…)`` works)."""
        self._rebind(checkpoint_id)
        self.save_id = self._given_save_id or uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Every rank: nothing to ask storage; without collectives, name this rank's files.

        The folder and the overwrite check are :meth:`prepare_global_plan`'s: asked once by the
        coordinator, not once per rank, so a save's requests before any data do not grow with
        the ranks.
        """
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(
                plan, storage_data=self._storage_prefix(self.rank, plan, self._base_records())
            )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator: create the folder where needed, refuse to clobber a checkpoint unless
        ``overwrite`` (else un-commit the old one), and name each rank's files.

        It runs after every rank's local plan is gathered and before any rank writes. A refusal
        here fails every rank's ``dcp.save``. Without collectives each rank runs it for itself,
        on its own ``.metadata``.
        """
        self._refuse_cached_plans(plans)
        self._prepare_folder()
        if all(plan.storage_data is not None for plan in plans):
            return plans  # named in prepare_local_plan (without collectives)
        base = self._base_records()
        return [
            plan
            if plan.storage_data is not None
            else dataclasses.replace(plan, storage_data=self._storage_prefix(i, plan, base))
            for i, plan in enumerate(plans)
        ]

    def _refuse_cached_plans(self, plans: list[SavePlan]) -> None:
        """Refuse torch's plan caching in an incremental save.

        A cached plan (``usable=False``) makes each rank reuse its plan of an earlier save,
        base records included: a save would refer to that save's base, not its own.
        """
        if self.incremental and not all(plan.usable for plan in plans):
            raise UsageError(
                f"cannot save {self.location.url!r} incrementally with a cached plan: the cached "
                "plan holds an earlier save's base records. Pass a planner without "
                "enable_plan_caching, or save without base and incremental"
            )

    def _prepare_folder(self) -> None:
        """Create the folder where needed; refuse an existing ``.metadata``, or remove it with
        ``overwrite``."""
        backend, metadata_path = self.location.backend, self._metadata_path()
        with storage_errors("prepare checkpoint folder", self.location.url, also=(Exception,)):
            # Drivers raise their own types (asyncssh's SFTPFailure), hence also=Exception.
            backend.make_folder(self.location.path)
            # Without overwrite, one read: on S3 one GET, where "exists" of a missing file is a
            # HEAD and a LIST.
            exists = not self.overwrite and backend.read_versioned(metadata_path).data is not None
        if exists:
            # "Checkpoint already exists": torch's words, which code written for torch matches.
            raise CheckpointExistsError(
                f"Checkpoint already exists at {self.location.url!r} and overwrite=False; pass "
                "overwrite=True to replace it or choose another URL"
            )
        if self.overwrite:
            # Drivers raise their own types here too (azure-core's HttpResponseError on a 403).
            with storage_errors("remove the old", self.location.url_of(metadata_path), also=(Exception,)):
                if backend.call("exists", metadata_path):
                    backend.call("rm_file", metadata_path)

    @collector_paused()
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into up to ``files_per_rank`` files, concurrently (or one file
        per item, ``files_per_rank`` at a time, without ``single_file_per_rank``)."""
        prefix: _StoragePrefix = plan.storage_data
        if self.single_file_per_rank:
            bins = split_into_files(plan.items, self.settings.files_per_rank)
        else:
            bins = [[item] for item in plan.items]
        budget = ByteBudget(self.settings.max_inflight_bytes)
        backend = self.location.backend
        base = prefix.base if isinstance(prefix, IncrementalPrefix) else {}
        jobs = [(names.data_file_name(prefix.prefix, n), items, base) for n, items in enumerate(bins)]
        results: list[WriteResult] = []
        # A rank may have nothing to write (DCP gives each replicated item to one rank only).
        workers = max(1, min(len(jobs), self.settings.files_per_rank))
        if workers == 1:  # one file at a time (a small key's one file): no thread to start
            for name, items, base in jobs:
                results.extend(self._write_file(budget, name, items, planner, base))
        else:
            results = self._write_files_at_once(workers, budget, jobs, planner)
        if self.settings.sync_files and self.metadata_commits:
            backend.sync_folder(self.location.path)  # the data files' names, before .metadata's
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _write_files_at_once(
        self,
        workers: int,
        budget: ByteBudget,
        jobs: list[tuple[str, list[WriteItem], BaseRecords]],
        planner: SavePlanner,
    ) -> list[WriteResult]:
        """Write each job's file on ``workers`` threads; raise the first failure once all finished."""
        results: list[WriteResult] = []
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dcp-fsspec-write") as pool:
            futures = [
                pool.submit(self._write_file, budget, name, items, planner, base)
                for name, items, base in jobs
            ]
            errors = []
            for f in futures:
                try:
                    results.extend(f.result())
                except BaseException as e:  # noqa: BLE001 - collected, the first is re-raised
                    errors.append(e)
            if errors:
                raise errors[0]
        return results

    @collector_paused()
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``.metadata`` (the commit point): every rank's data is already written."""
        metadata.version = DCP_VERSION
        metadata.storage_data = {
            wr.index: unhashed(wr.storage_data) for rank_results in results for wr in rank_results
        }
        metadata.storage_meta = self.storage_meta()
        if self.incremental:
            self._write_content_hashes(
                {wr.index: wr.storage_data.digest for rank_results in results for wr in rank_results}
            )
        path = self._metadata_path()
        with storage_errors("write", self.location.url_of(path), also=(ValueError,)):
            with self.location.backend.exclusive(self.location.path):
                created = self._create_metadata(path, metadata)
        if not created:
            raise CheckpointExistsError(
                f"another process finished a checkpoint at {self.location.url!r} while this save was "
                "writing it (two processes saving the same checkpoint?); this save is not committed. "
                "Give each run its own folder"
            )

    # --- internals --------------------------------------------------------------------------

    def _create_metadata(self, path: str, metadata: Metadata) -> bool:
        """Create ``.metadata`` at ``path``, never replacing one: whether this save's is there now.

        The caller holds the backend's ``exclusive``. ``.metadata`` was absent (or removed, with
        overwrite) before any data was written, so one that is here now is another save's,
        finished first, or ours: a write that landed although its answer was lost, then retried.
        """
        backend = self.location.backend
        if backend.conditional_writes:
            data = pickle.dumps(metadata)
            if backend.replace_if_unchanged(path, data, Versioned(None)):
                return True
            return backend.read_versioned(path).data == data
        existing = backend.read_versioned(path).data
        if existing is not None:
            return existing == pickle.dumps(metadata)
        if backend.answers_locally:
            self._stream_metadata(path, metadata)
        else:
            backend.write_small_atomic(
                path,
                pickle.dumps(metadata),
                fsync=self.settings.sync_files,
                sync_folder=self.metadata_commits,
                syncs=self.file_syncs,
            )
        return True

    def _stream_metadata(self, path: str, metadata: Metadata) -> None:
        """Pickle ``metadata`` into an upload of ``path``, published whole on commit.

        On a store that answers on this machine, a stream costs no extra request, and the
        coordinator holds no copy of the bytes, which grow with the ranks. Elsewhere one
        request of the whole bytes is cheaper.
        """
        backend, fsync = self.location.backend, self.settings.sync_files
        backend.make_folder(self.location.path)
        upload = backend.new_upload(
            path,
            part_size=MIN_PART_SIZE,
            budget=ByteBudget(MIN_PART_SIZE),
            fsync=fsync,
            syncs=self.file_syncs,
        )
        try:
            pickle.dump(metadata, UploadFile(upload))
            upload.commit()
        except BaseException:
            upload.abort()
            raise
        if fsync and self.metadata_commits:
            backend.sync_folder(self.location.path)

    def _prefix(self, rank: int) -> str:
        """DCP's storage prefix of ``rank``'s data files (what :func:`names.data_file_name` extends)."""
        return f"__{rank}_{self.save_id}_" if self.unique_file_names else f"__{rank}_"

    def _metadata_path(self) -> str:
        rank = self.rank if (not self.use_collectives and self.rank is not None) else None
        return self.location.join(names.metadata_name(rank))

    def _write_file(
        self,
        budget: ByteBudget,
        name: str,
        items: list[WriteItem],
        planner: SavePlanner,
        base: BaseRecords,
    ) -> list[WriteResult]:
        """Write ``items`` into the data file ``name``, but not those ``base`` holds already.

        The file is created at the first record to write: one whose records all stay in the
        base is never created.
        """
        path = self.location.join(name)
        upload: FileUpload | None = None
        results = []
        try:
            for item in items:
                data = planner.resolve_data(item)
                framed = frame_item(item, data)
                digest = content_digest(data, framed) if self.incremental else None
                known = base.get(item.index)
                if known is not None and known.digest == digest:
                    results.append(
                        WriteResult(
                            index=item.index, size_in_bytes=0, storage_data=Hashed(known.info, known.digest)
                        )
                    )
                    continue
                if upload is None:
                    upload = self._new_upload(path, budget)
                offset = upload.size
                descriptors = self._write_record(upload, item, data, framed)
                length = upload.size - offset
                info = _StorageInfo(name, offset, length, transform_descriptors=descriptors)
                stored = info if digest is None else Hashed(info, digest)
                results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=stored))
            if upload is not None:
                upload.commit()
        except BaseException as e:
            if upload is not None:
                upload.abort()
            if isinstance(e, OSError) and not isinstance(e, DcpFsspecError):
                raise StorageError(f"cannot write {self.location.url_of(path)!r}: {e}") from e
            raise
        return results

    def _new_upload(self, path: str, budget: ByteBudget) -> FileUpload:
        with storage_errors("create", self.location.url_of(path)):
            return self.location.backend.new_upload(
                path,
                part_size=self.settings.part_size,
                budget=budget,
                fsync=self.settings.sync_files,
                multipart_threshold=self.settings.multipart_threshold,
                syncs=self.file_syncs,
            )

    def _write_record(
        self, upload: FileUpload, item: WriteItem, data: Any, framed: FramedTensor | None
    ) -> list[str] | None:
        """Append one item's record to ``upload``, through the transforms if there are any.

        ``framed``: the tensor's record as :func:`~dcp_fsspec.storage.write.file_plan.frame_item` made it; ``None`` for an object's bytes.
        Returns the record's transform descriptors, ``None`` without transforms (as torch stores
        them: older readers never see the field).
        """
        if framed is None:
            buffers: list[bytes | memoryview] = [data.getbuffer()]
        elif not self.transforms.extensions:
            write_tensor_record(upload, framed, checksum=self.settings.checksums)
            return None
        else:
            buffers = encode_framed(framed, checksum=self.settings.checksums).buffers()
        if not self.transforms.extensions:
            upload.write(buffers)
            return None
        return write_transformed(self.transforms, item, buffers, upload.write)

    # --- incremental saves ----------------------------------------------------------------

    def _base_records(self) -> dict[MetadataIndex, BaseRecord]:
        """The coordinator: the base's records this save may refer to (none without a base)."""
        if self.base is None:
            return {}
        with storage_errors("read the base", self.base.url):
            return read_base(self.base, self.location.path, self._transform_names)

    def _storage_prefix(
        self, rank: int, plan: SavePlan, base: dict[MetadataIndex, BaseRecord]
    ) -> _StoragePrefix:
        """Rank ``rank``'s file prefix, with the base's records of the items it writes."""
        prefix = self._prefix(rank)
        if not self.incremental:
            return _StoragePrefix(prefix)
        return IncrementalPrefix(
            prefix, {item.index: base[item.index] for item in plan.items if item.index in base}
        )

    def _write_content_hashes(self, digests: dict[MetadataIndex, bytes]) -> None:
        """The coordinator, just before ``.metadata``: every entry's digest, bound to this save."""
        path = self.location.join(names.CONTENT_HASHES_NAME)
        data = encode_hashes(digests, self._transform_names, self.save_id)
        with storage_errors("write", self.location.url_of(path), also=(ValueError,)):
            # Its folder is synced with .metadata's, which is written next.
            self.location.backend.write_small_atomic(
                path, data, fsync=self.settings.sync_files, sync_folder=False, syncs=self.file_syncs
            )

    @property
    def _transform_names(self) -> list[str]:
        return [ext.get_descriptor() for ext in self.transforms.extensions]


class UploadFile:
    """A write-only file object over an upload, for ``pickle.dump``: each piece the pickler
    writes goes into the upload as it comes."""

    def __init__(self, upload: FileUpload) -> None:
        self.upload = upload

    def write(self, data: bytes | memoryview) -> int:
        self.upload.write([data])
        return len(data)
