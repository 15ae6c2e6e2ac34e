"""Lightning (Trainer) checkpoints on any fsspec URL, written and read by dcp_fsspec.

Two pieces, used together or apart:

- :class:`FsspecCheckpointIO`, a ``CheckpointIO`` for Lightning's single-file ``.ckpt`` (single
  device, DDP): the file is uploaded complete-or-absent with your ``storage_options`` and read
  back the same way. Wrap it in Lightning's ``AsyncCheckpointIO`` to save in the background.
- :class:`FsspecModelParallelStrategy`, Lightning's ``ModelParallelStrategy`` (FSDP2/TP) whose
  sharded checkpoints go through :class:`~dcp_fsspec.FsspecStorageWriter` and
  :class:`~dcp_fsspec.FsspecStorageReader`, synchronously or with ``dcp.async_save``. The folder
  keeps Lightning's layout (DCP files plus ``meta.pt``), so Lightning's own strategy reads it too.

``ModelCheckpoint(dirpath="s3://…", save_top_k=k)`` keeps its meaning: Lightning decides what to
keep and calls ``remove_checkpoint``, which deletes through the same storage options.
``ModelCheckpoint`` lists ``dirpath`` with fsspec's default options, so give the store's
endpoint and credentials to it through the environment (``AWS_ENDPOINT_URL``, …) as well.
"""

from __future__ import annotations

import io
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ._files import child, is_dcp_checkpoint, locate, read_file, remove, require, unwrapped, write_file

require("lightning.pytorch", "lightning", "dcp_fsspec.integrations.lightning")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from lightning.pytorch.plugins.io import CheckpointIO  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from ..checkpoint.checkpointer import ASYNC_DISABLED  # noqa: E402
from ..errors import CheckpointNotFoundError  # noqa: E402
from ..storage.reader import FsspecStorageReader  # noqa: E402
from ..storage.retry import DEFAULT_RETRY, RetryPolicy  # noqa: E402
from ..storage.settings import ReaderSettings, WriterSettings  # noqa: E402
from ..storage.trust import SafeLoadPlanner  # noqa: E402
from ..storage.writer import FsspecStorageWriter  # noqa: E402

__all__ = ["FsspecCheckpointIO", "FsspecModelParallelStrategy"]

# Lightning's name for the non-tensor part of a sharded checkpoint (loops, callbacks, hparams):
# the same name keeps our folders and Lightning's interchangeable.
META_FILE = "meta.pt"
# Saves that write in a thread of the training process (Lightning has no process to hand them to).
ASYNC_THREAD = "async"


def _torch_bytes(obj: Any) -> memoryview:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getbuffer()


def _torch_load(data: bytes, weights_only: bool, map_location: Any = None) -> Any:
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)


class FsspecCheckpointIO(CheckpointIO):
    """Lightning's single-file checkpoints (``.ckpt``) on any fsspec URL.

    ``Trainer(plugins=[FsspecCheckpointIO(opts)])``. With ``async_mode="async"`` a save
    serializes the checkpoint in the training thread (the snapshot) and uploads it in a
    background thread; a removal of that file waits for its upload first, so
    ``ModelCheckpoint(save_top_k=k)`` never deletes a file before it lands and leaves it behind.
    (Wrapping it in Lightning's ``AsyncCheckpointIO`` works too, but Lightning then removes
    files without waiting for their saves.)

    Args:
        storage_options: fsspec options for every URL this saves to, loads or removes.
        async_mode: ``"disabled"``: a save returns once the file is written. ``"async"``: as
            above; an upload's error is raised by the next save, load, removal or teardown.
        retry: how storage calls are retried; ``None``: only the driver's own retries.
        trust_checkpoint: unpickle loaded checkpoints in full (runs any code they hold): only for
            checkpoints you wrote. By default they load with ``torch.load(weights_only=True)``,
            unless Lightning asks for ``weights_only=False`` itself (``fit(weights_only=False)``).
    """

    def __init__(
        self,
        storage_options: dict[str, Any] | None = None,
        *,
        async_mode: str = ASYNC_DISABLED,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        trust_checkpoint: bool = False,
    ) -> None:
        super().__init__()
        _check_async_mode(async_mode)
        self.storage_options = dict(storage_options or {})
        self.async_mode = async_mode
        self.retry = retry
        self.trust_checkpoint = trust_checkpoint
        self._uploader: ThreadPoolExecutor | None = None
        self._uploads: dict[str, Future[None]] = {}  # URL → its latest upload, until waited for

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        """Upload ``checkpoint`` (``torch.save`` bytes) as the file ``path``, complete or absent.

        ``storage_options`` given here (``trainer.save_checkpoint(…, storage_options=…)``) are
        added to the plugin's own.
        """
        self._wait()  # one upload at a time: bounds memory, and raises the last one's error
        where = locate(path, {**self.storage_options, **(storage_options or {})}, self.retry)
        data = _torch_bytes(checkpoint)
        if self.async_mode == ASYNC_DISABLED:
            write_file(where, data)
            return
        if self._uploader is None:
            self._uploader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp-fsspec-ckpt-upload")
        self._uploads[os.fspath(path)] = self._uploader.submit(write_file, where, data)

    def load_checkpoint(
        self, path: str | os.PathLike[str], map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint saved at ``path``, loaded safely unless it is trusted (see the class)."""
        self._wait()
        data = read_file(locate(path, self.storage_options, self.retry))
        safe = not self.trust_checkpoint if weights_only is None else weights_only
        loaded: dict[str, Any] = _torch_load(data, safe, map_location)
        return loaded

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the checkpoint at ``path`` (a file, or a sharded checkpoint's folder), after
        its upload if one is in flight."""
        self._wait()
        remove(locate(path, self.storage_options, self.retry))

    def teardown(self) -> None:
        """Wait for the upload in flight and raise its error (Lightning calls this at the end)."""
        self._wait()
        if self._uploader is not None:
            self._uploader.shutdown(wait=True)
            self._uploader = None

    def _wait(self) -> None:
        uploads, self._uploads = self._uploads, {}
        for upload in uploads.values():
            upload.result()


class FsspecModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with sharded checkpoints on any fsspec URL.

    Every rank writes its shards with :class:`~dcp_fsspec.FsspecStorageWriter` and reads them with
    :class:`~dcp_fsspec.FsspecStorageReader`; rank 0 writes Lightning's ``meta.pt`` (loops,
    callbacks, hyperparameters) beside them, before the data, so the folder's ``.metadata``,
    written last, marks a complete checkpoint. Single-file checkpoints
    (``save_distributed_checkpoint=False``) and deletions go through its ``checkpoint_io``, a
    :class:`FsspecCheckpointIO` with the same options unless you set another.

    Args:
        *args, **kwargs: ``ModelParallelStrategy``'s own (``data_parallel_size``, …).
        storage_options: fsspec options for every checkpoint URL.
        async_mode: ``"disabled"``: a save returns once the checkpoint is written.
            ``"async"``: a save copies the shards to CPU memory and writes them in a background
            thread (``dcp.async_save``); the next save, a load and teardown wait for it first
            and raise its error.
        writer_settings, reader_settings: the tuning of our writer and reader.
        retry: how storage calls are retried.
        trust_checkpoint: load non-tensor entries and ``meta.pt`` in full (runs any code they
            hold): only for checkpoints you wrote. Default: ``weights_only`` loading.
    """

    def __init__(
        self,
        *args: Any,
        storage_options: dict[str, Any] | None = None,
        async_mode: str = ASYNC_DISABLED,
        writer_settings: WriterSettings | None = None,
        reader_settings: ReaderSettings | None = None,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        trust_checkpoint: bool = False,
        **kwargs: Any,
    ) -> None:
        _check_async_mode(async_mode)
        super().__init__(*args, **kwargs)
        self.storage_options = dict(storage_options or {})
        self.async_mode = async_mode
        self.writer_settings = writer_settings or WriterSettings()
        self.reader_settings = reader_settings or ReaderSettings()
        self.retry = retry
        self.trust_checkpoint = trust_checkpoint
        self.checkpoint_io = FsspecCheckpointIO(
            self.storage_options, async_mode=async_mode, retry=retry, trust_checkpoint=trust_checkpoint
        )
        self._save_in_flight: Future[Any] | None = None
        self._url_in_flight = ""
        self._save_group: dist.ProcessGroup | None = None

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` at the URL ``filepath``: sharded (every rank), or one file (rank 0)."""
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported: "
                "give storage_options to the strategy itself"
            )
        url = self.broadcast(os.fspath(filepath))
        self.wait()
        if not self._save_distributed_checkpoint:
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint, url)
            return
        where = locate(url, self.storage_options, self.retry)
        shards = {"state_dict": checkpoint.pop("state_dict")}
        shards.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        if self.is_global_zero:
            write_file(child(where, META_FILE), _torch_bytes(checkpoint))
        writer = FsspecStorageWriter(
            url, self.storage_options, overwrite=True, retry=self.retry, **self.writer_settings.as_kwargs()
        )
        if self.async_mode == ASYNC_DISABLED:
            unwrapped(lambda: dcp.save(shards, storage_writer=writer), f"saving {where.url}")
        else:
            if self._save_group is None:
                # The background thread's collectives need a group of their own: on the default
                # one they would interleave with training's (FSDP's all-gathers) and hang.
                self._save_group = dist.new_group(backend="gloo")
            response = dcp.async_save(shards, storage_writer=writer, process_group=self._save_group)
            self._save_in_flight = response if isinstance(response, Future) else response.upload_completion
            self._url_in_flight = where.url

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is written; raise its error."""
        future, self._save_in_flight = self._save_in_flight, None
        if future is not None:
            unwrapped(future.result, f"saving {self._url_in_flight}")

    def load_checkpoint(self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None) -> dict[str, Any]:
        """Load the sharded checkpoint at ``checkpoint_path`` into the model and optimizers.

        Returns Lightning's non-tensor state (``meta.pt``) for the Trainer to restore.

        Raises:
            CheckpointNotFoundError: there is no sharded checkpoint (no ``.metadata``) there.
            CheckpointMismatchError, CorruptCheckpointError, StorageError: see the reader.
        """
        self.wait()
        url = self.broadcast(os.fspath(checkpoint_path))
        where = locate(url, self.storage_options, self.retry)
        if not is_dcp_checkpoint(where):
            raise CheckpointNotFoundError(
                f"no sharded checkpoint at {where.url} (no .metadata): "
                f"{type(self).__name__} resumes from a folder it saved with save_distributed_checkpoint=True"
            )
        assert self.model is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        optimizers = {f"optimizer_{i}": optimizer for i, optimizer in enumerate(self.optimizers)}
        shards: dict[str, Any] = {"state_dict": get_model_state_dict(self.model)}
        shards.update({key: get_optimizer_state_dict(self.model, opt) for key, opt in optimizers.items()})
        reader = FsspecStorageReader(
            url, self.storage_options, retry=self.retry, trust_checkpoint=self.trust_checkpoint,
            **self.reader_settings.as_kwargs(),
        )  # fmt: skip
        planner = SafeLoadPlanner(allow_partial_load=not strict, trust_checkpoint=self.trust_checkpoint)
        unwrapped(
            lambda: dcp.load(shards, storage_reader=reader, planner=planner), f"loading {where.url}", reader=reader
        )
        self.model.load_state_dict(shards["state_dict"], strict=strict)
        for key, optimizer in optimizers.items():
            options = StateDictOptions(cpu_offload=True)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=shards[key], options=options)
        safe = not self.trust_checkpoint if weights_only is None else weights_only
        metadata: dict[str, Any] = _torch_load(read_file(child(where, META_FILE)), safe)
        return metadata

    def teardown(self) -> None:
        """Wait for a save in flight, then tear down as Lightning does."""
        self.wait()
        super().teardown()


def _check_async_mode(async_mode: str) -> None:
    if async_mode not in (ASYNC_DISABLED, ASYNC_THREAD):
        raise ValueError(f"async_mode={async_mode!r} is not supported; choose {ASYNC_DISABLED!r} or {ASYNC_THREAD!r}")
