"""Lightning (Trainer and Fabric) checkpoints on any fsspec URL, written and read by dcp_fsspec.

Three pieces, used together or apart:

- :class:`FsspecCheckpointIO`, a ``CheckpointIO`` for Lightning's single-file ``.ckpt`` (single
  device, DDP): the file is uploaded complete-or-absent with your ``storage_options`` and read
  back the same way. Wrap it in Lightning's ``AsyncCheckpointIO`` to save in the background.
- :class:`FsspecModelParallelStrategy`, Lightning's ``ModelParallelStrategy`` (FSDP2/TP) whose
  sharded checkpoints go through :class:`~dcp_fsspec.FsspecStorageWriter` and
  :class:`~dcp_fsspec.FsspecStorageReader`, synchronously or with ``dcp.async_save``. The folder
  keeps Lightning's layout (DCP files plus ``meta.pt``), so Lightning's own strategy reads it too.
- :class:`FsspecFabricModelParallelStrategy`, the same for Fabric's ``fabric.save``/``fabric.load``.
  Fabric's single-device and DDP strategies take :class:`FsspecCheckpointIO` as a plugin as is.

``ModelCheckpoint(dirpath="s3://…", save_top_k=k)`` keeps its meaning: Lightning decides what to
keep and calls ``remove_checkpoint``, which deletes through the same storage options.
``ModelCheckpoint`` lists ``dirpath`` with fsspec's default options, so give the store's
endpoint and credentials to it through the environment (``AWS_ENDPOINT_URL``, …) as well.
"""

from __future__ import annotations

import io
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from dcp_fsspec.integrations._files import (
    blocking,
    child,
    is_dcp_checkpoint,
    locate,
    read_file,
    remove,
    require,
    unwrapped,
    write_file,
)

require("lightning.pytorch", "lightning", "dcp_fsspec.integrations.lightning")

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from dcp_fsspec.checkpoint.checkpointer import ASYNC_DISABLED
from dcp_fsspec.errors import CheckpointMismatchError, CheckpointNotFoundError, UsageError
from dcp_fsspec.storage.format.safe_entries import SafeLoadPlanner
from dcp_fsspec.storage.read.reader import FsspecStorageReader
from dcp_fsspec.storage.settings import ReaderSettings, WriterSettings
from dcp_fsspec.storage.transport.retry import DEFAULT_RETRY, RetryPolicy
from dcp_fsspec.storage.write.writer import FsspecStorageWriter

__all__ = ["FsspecCheckpointIO", "FsspecFabricModelParallelStrategy", "FsspecModelParallelStrategy"]

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


class _ShardedStrategy:
    """The options both strategies (Trainer's and Fabric's) add to Lightning's own, and waiting for
    their asynchronous save; put it before the Lightning strategy in the bases."""

    def __init__(
        self,
        *args: Any,
        storage_options: dict[str, Any] | None = None,
        async_mode: str = ASYNC_DISABLED,
        writer_settings: WriterSettings | None = None,
        reader_settings: ReaderSettings | None = None,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._shards = _ShardedStorage(
            type(self).__name__, storage_options, async_mode, writer_settings, reader_settings, retry
        )

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is written; raise its error."""
        self._shards.wait()


class FsspecModelParallelStrategy(_ShardedStrategy, ModelParallelStrategy):
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
        writer_settings: the tuning of our writer.
        reader_settings: the tuning of our reader. Its ``trust_checkpoint=True`` loads
            non-tensor entries and ``meta.pt`` in full (runs any code they hold): only for
            checkpoints you wrote. Default: ``weights_only`` loading.
        retry: how storage calls are retried.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        shards = self._shards
        self.checkpoint_io = FsspecCheckpointIO(
            shards.storage_options,
            async_mode=shards.async_mode,
            retry=shards.retry,
            trust_checkpoint=shards.reader_settings.trust_checkpoint,
        )

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
        shards = {"state_dict": checkpoint.pop("state_dict")}
        shards.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        self._shards.save(url, shards, checkpoint, self.is_global_zero)

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the sharded checkpoint at ``checkpoint_path`` into the model and optimizers.

        Returns Lightning's non-tensor state (``meta.pt``) for the Trainer to restore.

        Raises:
            CheckpointNotFoundError: there is no sharded checkpoint (no ``.metadata``) there.
            CheckpointMismatchError, CorruptCheckpointError, StorageError: see the reader.
        """
        self.wait()
        url = self.broadcast(os.fspath(checkpoint_path))
        assert self.model is not None and self.lightning_module is not None
        optimizers = {f"optimizer_{i}": optimizer for i, optimizer in enumerate(self.optimizers)}
        strict = self.lightning_module.strict_loading
        return self._shards.load(url, "state_dict", self.model, optimizers, strict, weights_only)

    def teardown(self) -> None:
        """Wait for a save in flight, then tear down as Lightning does."""
        self.wait()
        super().teardown()


class FsspecFabricModelParallelStrategy(_ShardedStrategy, FabricModelParallelStrategy):
    """Lightning Fabric's ``ModelParallelStrategy`` (FSDP2/TP) with ``fabric.save``/``fabric.load``
    on any fsspec URL.

    ``Fabric(strategy=FsspecFabricModelParallelStrategy(parallelize_fn, storage_options=opts))``.
    A save writes every rank's shards of the one model and its optimizers with
    :class:`~dcp_fsspec.FsspecStorageWriter`, and the rest of ``state`` (rank 0) as ``meta.pt``,
    in the layout of Fabric's own strategy; a load reads them back into the objects in ``state``
    (entries that have ``load_state_dict`` are restored through it) and returns what ``state``
    did not ask for. Only sharded checkpoints: for single-file ones on one device or DDP, give
    Fabric a :class:`FsspecCheckpointIO` instead. Fabric never tears its strategy down, so with
    ``async_mode="async"`` call :meth:`wait` (or ``teardown``) before the process ends.

    Args:
        *args, **kwargs: Fabric's ``ModelParallelStrategy``'s own (``parallelize_fn``,
            ``data_parallel_size``, …); ``save_distributed_checkpoint`` must stay ``True``.
        storage_options, async_mode, writer_settings, reader_settings, retry:
            as for :class:`FsspecModelParallelStrategy`.

    Raises:
        UsageError: ``save_distributed_checkpoint=False``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self._save_distributed_checkpoint:
            raise UsageError(
                f"{type(self).__name__} saves sharded checkpoints only: drop save_distributed_checkpoint=False"
            )

    def save_checkpoint(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save ``state`` (one model, its optimizers, anything else) as a sharded checkpoint at the
        URL ``path`` (``fabric.save`` calls this on every rank)."""
        if storage_options is not None or filter is not None:
            raise UsageError(
                f"{type(self).__name__}.save_checkpoint(storage_options=..., filter=...) is not supported: "
                "give storage_options to the strategy itself, and save the whole state"
            )
        url = self.broadcast(os.fspath(path))
        model_key, model, optimizers = _split_state(state, url)
        options = StateDictOptions(cpu_offload=True)
        shards: dict[str, Any] = {model_key: get_model_state_dict(model, options=options)}
        shards.update(
            {key: get_optimizer_state_dict(model, opt, options=options) for key, opt in optimizers.items()}
        )
        meta = {
            key: obj.state_dict() if _is_stateful(obj) else obj
            for key, obj in state.items()
            if key != model_key and key not in optimizers
        }
        self._shards.save(url, shards, meta, self.is_global_zero)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        state: Any | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore the objects in ``state`` from the sharded checkpoint at the URL ``path``;
        return the saved entries ``state`` did not name.

        Raises:
            UsageError: ``state`` is not a dict holding the model.
            CheckpointMismatchError: ``strict`` and an entry of ``state`` is not in the checkpoint.
            CheckpointNotFoundError, CorruptCheckpointError, StorageError: see the reader.
        """
        url = self.broadcast(os.fspath(path))
        if not isinstance(state, dict):
            raise UsageError(
                f"{type(self).__name__} loads {url} into a dict of objects: pass state={{'model': model, ...}}"
            )
        model_key, model, optimizers = _split_state(state, url)
        meta = self._shards.load(url, model_key, model, optimizers, strict, weights_only)
        wanted = [key for key in state if key != model_key and key not in optimizers]
        missing = [key for key in wanted if key not in meta]
        if strict and missing:
            raise CheckpointMismatchError(
                f"{url} has no entries {missing}: load with strict=False to leave them as they are"
            )
        for key in (key for key in wanted if key in meta):
            if _is_stateful(state[key]):
                state[key].load_state_dict(meta.pop(key))
            else:
                state[key] = meta.pop(key)
        return meta

    def teardown(self) -> None:
        """Wait for a save in flight, then tear down as Fabric's strategy does."""
        self.wait()
        super().teardown()


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _split_state(
    state: dict[str, Any], url: str
) -> tuple[str, torch.nn.Module, dict[str, torch.optim.Optimizer]]:
    """The model's key, the model, and the optimizers by key, in a Fabric ``state`` dict."""
    models = [key for key, obj in state.items() if isinstance(obj, torch.nn.Module)]
    if len(models) != 1:
        raise UsageError(
            f"a sharded checkpoint at {url} holds exactly one model, found {len(models)} ({models}): "
            "save each model to its own URL"
        )
    optimizers = {key: obj for key, obj in state.items() if isinstance(obj, torch.optim.Optimizer)}
    return models[0], state[models[0]], optimizers


class _ShardedStorage:
    """The sharded checkpoints of both Lightning strategies (Trainer's and Fabric's): DCP shards
    through our writer and reader, a ``meta.pt`` beside them, and the one asynchronous save in
    flight. The strategies only turn their own state into ``shards`` and ``meta``."""

    def __init__(
        self,
        owner: str,
        storage_options: dict[str, Any] | None,
        async_mode: str,
        writer_settings: WriterSettings | None,
        reader_settings: ReaderSettings | None,
        retry: RetryPolicy | None,
    ) -> None:
        _check_async_mode(async_mode)
        self.owner = owner  # the strategy's class name, for errors
        self.storage_options = dict(storage_options or {})
        self.async_mode = async_mode
        self.writer_settings = writer_settings or WriterSettings()
        self.reader_settings = reader_settings or ReaderSettings()
        self.retry = retry
        self._save_in_flight: Future[Any] | None = None
        self._url_in_flight = ""
        self._save_group: dist.ProcessGroup | None = None

    def save(self, url: str, shards: dict[str, Any], meta: dict[str, Any], is_global_zero: bool) -> None:
        """Write ``shards`` (every rank) and ``meta`` (rank 0, first: ``.metadata``, written last
        by DCP, marks the folder complete) to the folder ``url``; wait for the previous save first."""
        self.wait()
        where = locate(url, self.storage_options, self.retry)
        if is_global_zero:
            write_file(child(where, META_FILE), _torch_bytes(meta))
        writer = FsspecStorageWriter(
            url, self.storage_options, settings=self.writer_settings, retry=self.retry, overwrite=True
        )
        if self.async_mode == ASYNC_DISABLED:
            blocking(lambda: dcp.save(shards, storage_writer=writer), f"saving {where.url}")
            return
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

    def load(
        self,
        url: str,
        model_key: str,
        model: torch.nn.Module,
        optimizers: dict[str, torch.optim.Optimizer],
        strict: bool,
        weights_only: bool | None,
    ) -> dict[str, Any]:
        """Load the folder ``url`` into ``model`` (saved under ``model_key``) and ``optimizers``
        (under their keys); return its ``meta.pt``, loaded safely unless it is trusted.

        Raises:
            CheckpointNotFoundError: there is no sharded checkpoint (no ``.metadata``) there.
            CheckpointMismatchError, CorruptCheckpointError, StorageError: see the reader.
        """
        self.wait()
        where = locate(url, self.storage_options, self.retry)
        if not is_dcp_checkpoint(where):
            raise CheckpointNotFoundError(
                f"no sharded checkpoint at {where.url} (no .metadata): "
                f"{self.owner} resumes from a folder it saved with save_distributed_checkpoint=True"
            )
        shards: dict[str, Any] = {model_key: get_model_state_dict(model)}
        shards.update({key: get_optimizer_state_dict(model, opt) for key, opt in optimizers.items()})
        reader = FsspecStorageReader(
            url, self.storage_options, settings=self.reader_settings, retry=self.retry
        )
        trusted = self.reader_settings.trust_checkpoint
        planner = SafeLoadPlanner(allow_partial_load=not strict, trust_checkpoint=trusted)
        blocking(
            lambda: dcp.load(shards, storage_reader=reader, planner=planner),
            f"loading {where.url}",
            reader=reader,
        )
        model.load_state_dict(shards[model_key], strict=strict)
        for key, optimizer in optimizers.items():
            options = StateDictOptions(cpu_offload=True)
            set_optimizer_state_dict(model, optimizer, optim_state_dict=shards[key], options=options)
        safe = not trusted if weights_only is None else weights_only
        meta: dict[str, Any] = _torch_load(read_file(child(where, META_FILE)), safe)
        return meta


def _check_async_mode(async_mode: str) -> None:
    if async_mode not in (ASYNC_DISABLED, ASYNC_THREAD):
        raise ValueError(
            f"async_mode={async_mode!r} is not supported; choose {ASYNC_DISABLED!r} or {ASYNC_THREAD!r}"
        )
