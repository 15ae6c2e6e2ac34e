"""torch's stream transform extensions (compression, …) applied to one record at a time.

torch's ``FileSystemWriter(_extensions=[…])`` passes every record through a chain of
:class:`~torch.distributed.checkpoint._extension.StreamTransformExtension` writers and lists
their descriptors (``"stream.zstd/1"``) in the record's ``_StorageInfo.transform_descriptors``;
its reader looks each descriptor up in an ``ExtensionRegistry`` and undoes them in turn. We
build the same chain with torch's own ``_StorageWriterTransforms`` / ``_StorageReaderTransforms``
so the descriptors and bytes are exactly torch's, and differ only in where it runs: the writer's
file threads push a record through the chain straight into the file's upload
(:func:`write_transformed`), and the reader undoes it once the whole transformed record is in
memory (:func:`untransform`). A transformed record is stored, fetched and checksummed as one
unit: its CRC-32 (inside the record) is checked after the transforms are undone.

``compression="zstd"`` is :class:`LeveledZStandard`: torch's ``ZStandard`` format and descriptor
(torch's readers load it) with a compression level and zstd's own frame checksum.
"""

from __future__ import annotations

import io
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension, ZStandard
from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms, _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem, WriteItem

from dcp_fsspec.errors import CorruptCheckpointError, MissingDriverError
from dcp_fsspec.storage.format import metadata_standins

COMPRESSIONS = ("zstd",)
# zstd's own default; torch's ZStandard compresses at it too.
DEFAULT_ZSTD_LEVEL = 3
# zstd's fastest ("negative") level, ZSTD_minCLevel(); zstandard exports only the maximum.
_ZSTD_MIN_LEVEL = -(1 << 17)


class LeveledZStandard(ZStandard):
    """torch's ``ZStandard`` extension at a chosen level, with zstd's frame checksum.

    Its descriptor is torch's (``stream.zstd/1``) and its output an ordinary zstd frame, so
    torch's ``ZStandard`` (and any zstd decoder) reads it back; the frame checksum makes the
    decompressor itself reject a damaged frame. Needs the ``zstandard`` package (the ``zstd``
    extra), not torch's other option ``pyzstd``: only ``zstandard``'s writer takes a level here.
    """

    def __init__(self, level: int = DEFAULT_ZSTD_LEVEL) -> None:
        try:
            import zstandard
        except ImportError as e:
            raise MissingDriverError(
                "compression='zstd' needs the zstandard package: pip install 'dcp-fsspec[zstd]'"
            ) from e
        super().__init__()
        lo, hi = _ZSTD_MIN_LEVEL, zstandard.MAX_COMPRESSION_LEVEL
        if isinstance(level, bool) or not isinstance(level, int) or not lo <= level <= hi:
            raise ValueError(f"compression_level must be an int from {lo} to {hi} for zstd, got {level!r}")
        self.level = level

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        import zstandard

        # One compressor per record: a ZstdCompressor must not be used by two threads at once,
        # and the writer's file threads compress concurrently.
        compressor = zstandard.ZstdCompressor(level=self.level, write_checksum=True)
        return compressor.stream_writer(output)  # type: ignore[no-any-return]


def compression_extensions(compression: str | None, level: int | None) -> list[StreamTransformExtension]:
    """The extensions that ``compression`` (and ``level``) mean for the writer: none, or zstd.

    Raises:
        ValueError: an unknown ``compression``, or a ``level`` without one.
        MissingDriverError: ``"zstd"`` without the ``zstandard`` package.
    """
    if compression is None:
        if level is not None:
            raise ValueError(f"compression_level={level!r} needs compression='zstd'")
        return []
    if compression not in COMPRESSIONS:
        raise ValueError(
            f"compression={compression!r} is not supported; choose one of {list(COMPRESSIONS)} or None"
        )
    return [LeveledZStandard(DEFAULT_ZSTD_LEVEL if level is None else level)]


def writer_transforms(extensions: Sequence[Any]) -> _StorageWriterTransforms:
    """torch's chain of write transforms for ``extensions`` (applied in torch's order).

    Raises:
        TypeError: an extension that is not a ``StreamTransformExtension`` (the only kind a
            storage writer applies, in torch as here).
    """
    for ext in extensions:
        if not isinstance(ext, StreamTransformExtension):
            raise TypeError(
                f"_extensions: {type(ext).__name__} is not a torch StreamTransformExtension "
                "(e.g. torch.distributed.checkpoint._extension.ZStandard())"
            )
    return _StorageWriterTransforms(list(extensions))


class _Forward(io.RawIOBase):
    """The end of a transform chain: each piece it receives goes on to ``emit`` as bytes."""

    def __init__(self, emit: Callable[[list[bytes]], None]) -> None:
        self._emit = emit

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        # A transform may reuse its buffer after write() returns; the upload may keep ours.
        data = b if isinstance(b, bytes) else bytes(b)
        if data:
            self._emit([data])
        return len(data)


def write_transformed(
    transforms: _StorageWriterTransforms,
    item: WriteItem,
    buffers: Iterable[bytes | memoryview],
    emit: Callable[[list[bytes]], None],
) -> list[str] | None:
    """Push one record's ``buffers`` through ``transforms``, handing the output to ``emit`` as
    it is produced (on the caller's thread: a writer's file thread).

    Returns:
        The record's ``transform_descriptors`` as torch stores them: ``None`` without transforms.
    """
    stream, descriptors = transforms.transform_save_stream(item, _Forward(emit))
    for buf in buffers:
        stream.write(buf)
    stream.close()  # flushes each transform's tail (a zstd frame's end) into ``emit``
    return list(descriptors) or None


def reader_transforms(registry: ExtensionRegistry | None) -> _StorageReaderTransforms:
    """torch's read-side chain, resolving descriptors with ``registry`` (default: torch's, ZStandard)."""
    return _StorageReaderTransforms(registry)


def missing_package(transforms: _StorageReaderTransforms, descriptors: Sequence[str]) -> str | None:
    """The package to install before ``descriptors`` can be undone here, if one is missing.

    torch's ``ZStandard`` reports a missing ``zstandard`` as a ``ValueError`` like any other
    failure; a reader must say "install this" rather than "the record is damaged".
    """
    for descriptor in descriptors:
        name = descriptor.partition("/")[0]
        if transforms.extension_registry.extensions.get(name) is ZStandard and not ZStandard.is_available():
            return "zstandard"
    return None


_ZSTD_DESCRIPTOR = f"{ZStandard.registry_name()}/1"
# A tensor record is torch.save's archive (or, in safetensors format, the bare bytes): the
# tensor's bytes plus a few KiB of zip headers and pickle. Anything larger than this over the
# tensor's size is not a record DCP wrote.
_ARCHIVE_SLACK = 64 * 1024
# .metadata says nothing of a pickled object's size; a transformed one may grow to this much.
MAX_UNTRANSFORMED_OBJECT = 1024**3


def untransformed_limit(entry: object, index: MetadataIndex | metadata_standins.MetadataIndex) -> int:
    """The most bytes the record of ``index`` may take once its transforms are undone.

    Transformed bytes come from storage and are untrusted: a few KiB of zstd can claim to
    expand to terabytes. ``.metadata`` says how big a tensor chunk is, so a tensor record may
    expand to its chunk's bytes plus the archive around them; a pickled object (no size in
    ``.metadata``) to :data:`MAX_UNTRANSFORMED_OBJECT`. ``entry`` is torch's metadata class or
    its stand-in (:mod:`~dcp_fsspec.storage.format.metadata_standins`).
    """
    if not isinstance(entry, (TensorStorageMetadata, metadata_standins.TensorStorageMetadata)):
        return MAX_UNTRANSFORMED_OBJECT
    offsets = tuple(index.offset or ())
    sizes = next((c.sizes for c in entry.chunks if tuple(c.offsets) == offsets), entry.size)
    return math.prod(sizes) * entry.properties.dtype.itemsize + _ARCHIVE_SLACK


def _too_big(descriptors: Sequence[str], limit: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"undoing {list(descriptors)} gives more than the {limit} bytes .metadata allows this record"
    )


def _one_zstd_frame(data: memoryview, limit: int) -> bytearray | None:
    """``data`` decompressed in one call, if ``zstandard`` is here (``None``: it is not).

    What torch's ``ZStandard`` reader does (its first frame), without its stream wrappers and
    their copies (about half the time of a record); never more than ``limit`` bytes are made.
    """
    try:
        import zstandard
    except ImportError:
        return None
    try:
        declared = zstandard.get_frame_parameters(data).content_size
        if declared != zstandard.CONTENTSIZE_UNKNOWN and declared > limit:
            raise _too_big([_ZSTD_DESCRIPTOR], limit)  # before zstandard allocates what it declares
        # Past max_output_size zstandard stops with "did not decompress full frame", as for a
        # truncated frame: both mean the record is not what DCP wrote.
        return bytearray(zstandard.ZstdDecompressor().decompress(data, max_output_size=limit))
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"not a complete zstd frame of at most {limit} bytes ({e})") from e


def untransform(
    transforms: _StorageReaderTransforms,
    item: ReadItem,
    descriptors: Sequence[str],
    data: memoryview,
    limit: int,
) -> bytearray:
    """The record a transformed record (all of it, in memory) was made from, at most ``limit``
    bytes (:func:`untransformed_limit`): a record that expands further is damage, and memory
    never holds more than ``limit`` of it.

    Raises whatever the registry or an extension raises for an unknown descriptor or bytes it
    cannot undo (:class:`CorruptCheckpointError` for a record too big); the caller reports that
    as damage to the record.
    """
    if (
        list(descriptors) == [_ZSTD_DESCRIPTOR]
        and transforms.extension_registry.extensions.get(ZStandard.registry_name()) is ZStandard
    ):
        whole = _one_zstd_frame(data, limit)
        if whole is not None:
            return whole
    stream = transforms.transform_load_stream(item, descriptors, io.BytesIO(data))
    out = bytearray()  # writable: the decoder hands its bytes to torch.frombuffer
    while chunk := stream.read(min(4 * 1024 * 1024, limit + 1 - len(out))):
        out += chunk
        if len(out) > limit:
            raise _too_big(descriptors, limit)
    return out


class UndoQueue:
    """Transformed records undone on a pool of threads, each delivered on the loading thread.

    zstd decompresses without the GIL, so several records are undone at once while the loading
    thread keeps fetching and decoding the rest; the planner, which is not ours to call from
    several threads, still receives every record on the loading thread (as an older one
    completes, and all of them by :meth:`drain`). At most ``2 * threads`` records wait, which
    bounds the memory they hold. Extensions must undo independent streams concurrently (torch's
    ``ZStandard`` does: a decompressor per stream).
    """

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dcp-fsspec-undo")
        self._waiting: deque[tuple[Future[bytearray], Callable[[bytearray], None]]] = deque()
        self._limit = 2 * threads

    def submit(self, undo: Callable[[], bytearray], deliver: Callable[[bytearray], None]) -> None:
        """Run ``undo`` on the pool; ``deliver`` its result on this thread, later."""
        self._waiting.append((self._pool.submit(undo), deliver))
        while len(self._waiting) > self._limit:
            self._deliver_oldest()

    def drain(self) -> None:
        """Deliver every record still waiting (re-raises the first failure of any)."""
        while self._waiting:
            self._deliver_oldest()

    def close(self) -> None:
        self._waiting.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _deliver_oldest(self) -> None:
        future, deliver = self._waiting.popleft()
        deliver(future.result())
