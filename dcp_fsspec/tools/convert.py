"""``to-torch`` and ``to-safetensors``: one file from a DCP checkpoint on any URL.

The checkpoint is read with our :class:`~dcp_fsspec.storage.read.reader.FsspecStorageReader` and
DCP's ``_EmptyStateDictLoadPlanner`` (what torch's ``dcp_to_torch_save`` does with its local-only
reader), so any URL works; non-tensor entries load as :class:`~dcp_fsspec.storage.format.safe_entries.SafeLoadPlanner`
loads them (no code from the checkpoint runs) unless ``trust_checkpoint``. The whole state dict is held in memory once. A single checkpoint
becomes its state dict; an iteration folder (or a save_dirname's latest) becomes
``{key: state_dict}``. The output is written through the storage layer's atomic uploads, so it
is complete or absent, on any URL too. The subcommands' options are in :mod:`~dcp_fsspec.tools.convert_options`.

safetensors holds only a flat mapping of names to tensors: nested keys are joined with ``.``,
plain values (numbers, strings, booleans, None) go into the file's metadata as JSON, and
anything else is left out and listed. The safetensors library builds the file in memory, so that
conversion needs about twice the state dict's size.
"""

from __future__ import annotations

import io
import json
import logging
import os
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import IO, Any, Literal, cast

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from dcp_fsspec.errors import CheckpointExistsError, CorruptCheckpointError, MissingDriverError, UsageError
from dcp_fsspec.storage.backends.uploads import ByteBudget
from dcp_fsspec.storage.format.safe_entries import SafeLoadPlanner
from dcp_fsspec.storage.read.reader import FsspecStorageReader
from dcp_fsspec.storage.settings import ReaderSettings
from dcp_fsspec.storage.transport.error_wrapping import storage_errors, unwrap_dcp
from dcp_fsspec.storage.transport.urls import Location, resolve
from dcp_fsspec.tools import targets
from dcp_fsspec.tools.progress import Progress, human_bytes
from dcp_fsspec.tools.results import WrittenFiles

logger = logging.getLogger(__name__)

MiB = 1024 * 1024


@dataclass
class ConvertResult(WrittenFiles):
    """What a conversion read and wrote, and in which ``format``."""

    format: str = field(kw_only=True)

    def lines(self) -> list[str]:
        """Each entry safetensors could not hold, then what was written."""
        return self._lines(f"{self.out} ({self.format}): ", "tensors and plain values")


# ``max_bytes``' default: this machine's memory (:func:`memory_size`).
MACHINE_MEMORY = -1


def memory_size() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say): the default
    limit of what a conversion may hold, since it holds the whole state dict at once."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_claimed_sizes(metadata: Metadata, url: str, max_bytes: int | None) -> int:
    """The bytes the tensors ``metadata`` lists take in memory, checked before any is allocated.

    Those sizes are read from storage: a crafted ``.metadata`` may claim any shape. A tensor
    stored without transforms takes at least its own bytes in its records, so claiming more is
    damage; and the whole state dict must fit in ``max_bytes``.

    Raises:
        CorruptCheckpointError: an entry claims a negative dimension, or more bytes than its
            records hold; the message names the entry.
        UsageError: the tensors take more than ``max_bytes``; the message names the largest.
    """
    stored: dict[str, int] = {}
    transformed: set[str] = set()
    for index, info in (metadata.storage_data or {}).items():
        stored[index.fqn] = stored.get(index.fqn, 0) + max(info.length, 0)
        if info.transform_descriptors:
            transformed.add(index.fqn)
    sizes: dict[str, int] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        claim = f"the .metadata of {url} claims {fqn!r} is a {list(meta.size)} {meta.properties.dtype} tensor"
        if any(d < 0 for d in meta.size):
            raise CorruptCheckpointError(f"{claim}, with a negative dimension; nothing was allocated")
        sizes[fqn] = meta.size.numel() * meta.properties.dtype.itemsize
        if fqn not in transformed and sizes[fqn] > stored.get(fqn, 0):
            raise CorruptCheckpointError(
                f"{claim} ({human_bytes(sizes[fqn])}) but its records hold {stored.get(fqn, 0)} bytes: the "
                "checkpoint is damaged or crafted; nothing was allocated"
            )
    total = sum(sizes.values())
    if max_bytes is not None and total > max_bytes:
        largest = max(sizes, key=lambda fqn: sizes[fqn])
        raise UsageError(
            f"converting {url} would hold {human_bytes(total)} of tensors in memory (the largest, {largest!r}: "
            f"{human_bytes(sizes[largest])}), more than the limit of {human_bytes(max_bytes)}; nothing was "
            "allocated. If the checkpoint is yours and the memory is there, pass a larger --max-bytes (max_bytes=)"
        )
    return total


class _CountingPlanner(SafeLoadPlanner, _EmptyStateDictLoadPlanner):
    """DCP's planner that rebuilds the state dict from ``.metadata``, advancing a progress bar,
    once the sizes it is about to allocate are checked (:func:`check_claimed_sizes`);
    non-tensor entries are loaded as :class:`SafeLoadPlanner` loads them."""

    def __init__(
        self, progress: Progress | None, url: str, max_bytes: int | None, *, trust_checkpoint: bool = False
    ) -> None:
        super().__init__(trust_checkpoint=trust_checkpoint)
        self.progress = progress
        self.url = url
        self.max_bytes = max_bytes

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        if metadata is not None:
            check_claimed_sizes(metadata, self.url, self.max_bytes)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if self.progress is not None and metadata is not None:
            for meta in metadata.state_dict_metadata.values():
                if isinstance(meta, TensorStorageMetadata):
                    self.progress.add_total(meta.size.numel() * meta.properties.dtype.itemsize)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        if self.progress is not None:
            self.progress.advance(tensor.numel() * tensor.element_size())


def load_state_dict(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    *,
    progress: Progress | None = None,
    trust_checkpoint: bool = False,
    max_bytes: int | None = MACHINE_MEMORY,
) -> dict[str, Any]:
    """The whole state dict at ``url``, without a model to load into.

    A DCP checkpoint gives its state dict; an iteration folder or a save_dirname (its latest
    iteration) gives ``{key: state_dict}`` for every key.

    Args:
        trust_checkpoint: unpickle ``.metadata`` and non-tensor entries in full (runs any code
            they hold); by default only DCP metadata's classes and ``weights_only`` values load.
        max_bytes: the most tensor bytes each key's ``.metadata`` may make it allocate; the
            default (:data:`MACHINE_MEMORY`) is this machine's memory (:func:`memory_size`), ``None`` is no limit.

    Raises:
        CheckpointNotFoundError: nothing there, or a save_dirname without a pointer.
        CorruptCheckpointError: damaged data (a checksum mismatch, an unreadable record, a size
            its records cannot hold), or a class refused because the checkpoint is not trusted.
        UsageError: the tensors would take more than ``max_bytes``.
        StorageError: the backend failed.
    """
    limit = memory_size() if max_bytes == MACHINE_MEMORY else max_bytes
    target = targets.classify(resolve(url, storage_options))
    if target.kind == "checkpoint":
        return _load_one(target.location, progress, trust_checkpoint, limit)
    run, iteration = targets.iteration_to_read(target, "convert")
    _, keys = targets.iteration_keys(run, iteration)
    return {
        key: _load_one(targets.key_location(run, iteration, key), progress, trust_checkpoint, limit)
        for key in keys
    }


def _load_one(
    location: Location, progress: Progress | None, trust_checkpoint: bool, max_bytes: int | None
) -> dict[str, Any]:
    start = time.perf_counter()
    state_dict: dict[str, Any] = {}
    reader = FsspecStorageReader(
        location.url, settings=ReaderSettings(trust_checkpoint=trust_checkpoint), _fs=location.fs
    )
    try:
        _load_state_dict(
            state_dict,
            storage_reader=reader,
            planner=_CountingPlanner(progress, location.url, max_bytes, trust_checkpoint=trust_checkpoint),
            no_dist=True,
        )
    except CheckpointException as e:
        # DCP wraps what the reader raised; ours already name the file and what to do.
        raise unwrap_dcp(
            e, f"loading {location.url}", mismatch=False, metadata_failure=reader.metadata_failure
        ) from e
    logger.info("loaded %s (%.2f s)", location.url, time.perf_counter() - start)
    return state_dict


Format = Literal["torch", "safetensors"]


def convert(
    url: str | os.PathLike[str],
    out: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    out_storage_options: dict[str, Any] | None = None,
    *,
    fmt: Format,
    overwrite: bool = False,
    progress: Progress | None = None,
    trust_checkpoint: bool = False,
    max_bytes: int | None = MACHINE_MEMORY,
) -> ConvertResult:
    """Write the state dict at ``url`` as one file at ``out`` (any URL), in format ``fmt``.

    ``"torch"``: one ``torch.save`` file of the state dict. ``"safetensors"``: its tensors,
    with plain values as metadata and anything else left out (listed in the result).
    ``trust_checkpoint``, ``max_bytes``: see :func:`load_state_dict`.

    Raises:
        MissingDriverError: the ``safetensors`` package is not installed (``"safetensors"``).
        CheckpointExistsError: ``out`` exists and ``overwrite`` is False.
        and what :func:`load_state_dict` raises.
    """
    encode = _encoder(fmt, out)
    start = time.perf_counter()
    target = _output(out, out_storage_options, overwrite)
    state_dict = load_state_dict(
        url, storage_options, progress=progress, trust_checkpoint=trust_checkpoint, max_bytes=max_bytes
    )
    result = ConvertResult(resolve(url, storage_options).url, target.url, format=fmt)
    with _Output(target) as stream:
        encode(state_dict, stream, result)
    result.bytes_written, result.seconds = stream.size, time.perf_counter() - start
    logger.info("wrote %s (%s)", target.url, human_bytes(result.bytes_written))
    return result


to_torch = partial(convert, fmt="torch")
to_safetensors = partial(convert, fmt="safetensors")

# Writes a state dict to the output stream, counting into the result what it wrote.
_Encode = Callable[[dict[str, Any], "_Output", ConvertResult], None]


def _encoder(fmt: Format, out: str | os.PathLike[str]) -> _Encode:
    if fmt == "torch":
        return _encode_torch
    try:
        from safetensors.torch import save as safetensors_save
    except ImportError as e:
        raise MissingDriverError(
            f"writing {os.fspath(out)!r} as safetensors needs the safetensors package: "
            "run `pip install safetensors` (or `pip install 'dcp-fsspec[safetensors]'`)"
        ) from e
    return partial(_encode_safetensors, safetensors_save)


def _encode_torch(state_dict: dict[str, Any], stream: _Output, result: ConvertResult) -> None:
    torch.save(state_dict, cast(IO[bytes], stream))
    result.tensors = _count_tensors(state_dict)


def _encode_safetensors(
    save: Callable[..., bytes], state_dict: dict[str, Any], stream: _Output, result: ConvertResult
) -> None:
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for name, value in _flatten(state_dict):
        if isinstance(value, torch.Tensor):
            tensors[name] = value.contiguous()
        elif value is None or isinstance(value, (bool, int, float, str)):
            metadata[name] = json.dumps(value)
        else:
            result.left_out.append(f"{name} ({type(value).__name__})")
    stream.write(save(tensors, metadata=metadata or None))
    result.tensors = len(tensors)


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        return [item for k, v in value.items() for item in _flatten(v, f"{prefix}{k}.")]
    if isinstance(value, (list, tuple)) and value:
        return [item for i, v in enumerate(value) for item in _flatten(v, f"{prefix}{i}.")]
    return [(prefix[:-1], value)]


def _count_tensors(value: Any) -> int:
    return sum(isinstance(v, torch.Tensor) for _, v in _flatten(value))


def _output(out: str | os.PathLike[str], storage_options: dict[str, Any] | None, overwrite: bool) -> Location:
    target = resolve(out, storage_options)
    with storage_errors("check", target.url):
        exists = target.fs.exists(target.path)
    if exists and not overwrite:
        raise CheckpointExistsError(
            f"{target.url} exists; choose another output or pass --overwrite (overwrite=True)"
        )
    return target


class _Output(io.RawIOBase):
    """A write-only stream into an atomic upload: the file appears whole on close, or not at all."""

    def __init__(self, target: Location) -> None:
        super().__init__()
        self.target = target
        self.size = 0
        with storage_errors("create", target.url):
            target.backend.make_folder(posixpath.dirname(target.path))
            self._upload = target.backend.new_upload(
                target.path, part_size=16 * MiB, budget=ByteBudget(64 * MiB)
            )

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)  # the caller may reuse its buffer once write returns
        with storage_errors("write", self.target.url):
            self._upload.write([data])
        self.size += len(data)
        return len(data)

    def __enter__(self) -> _Output:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self._upload.abort()
            return
        try:
            with storage_errors("write", self.target.url):
                self._upload.commit()
        except BaseException:
            self._upload.abort()
            raise
