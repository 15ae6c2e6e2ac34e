"""Ray Train workers saving to, and resuming from, the run's storage path through dcp_fsspec.

:class:`RayTrainCheckpointer` is a :class:`~dcp_fsspec.Checkpointer` built inside
``train_loop_per_worker`` at ``{storage_path}/{name}/dcp`` (``RunConfig``'s; any store Ray can
reach and fsspec can too: a local or shared folder, ``s3://``, ``gs://``, ``az://``, or any
fsspec filesystem given to Ray as ``pyarrow.fs.PyFileSystem(FSSpecHandler(fs))``). Every rank
writes its own shards with our storage writer; once the iteration is committed, it is reported
to Ray with ``checkpoint_upload_mode=NO_UPLOAD``, so Ray records the folder where it is instead
of copying it (ray#52762). Ray keeps the list of checkpoints and applies
``CheckpointConfig(num_to_keep=…)`` to it (it always keeps the latest), and
``ray.train.get_checkpoint()`` is what a restarted run (the same ``RunConfig`` name and storage
path) resumes from.
"""

from __future__ import annotations

import dataclasses
import posixpath
from typing import Any

from dcp_fsspec.integrations._files import require

require("ray.train", "ray", "dcp_fsspec.integrations.ray")

import pyarrow.fs  # noqa: E402  (a dependency of ray[train])
import ray.train

from dcp_fsspec.checkpoint import Checkpointer
from dcp_fsspec.checkpoint.commit.layout import format_iteration, parse_iteration
from dcp_fsspec.checkpoint.options import CheckpointerOptions, ResumeOptions
from dcp_fsspec.errors import CheckpointNotFoundError, InvalidURLError

__all__ = ["RayTrainCheckpointer"]

# pyarrow's native filesystems (what Ray makes of an ``s3://``/``gs://``/``abfs://`` storage
# path) → the fsspec scheme of the same store. pyarrow's paths on them are "bucket/key".
_FSSPEC_SCHEMES = {"local": "", "s3": "s3://", "gcs": "gs://", "abfs": "az://"}


def _fsspec_url(filesystem: pyarrow.fs.FileSystem, path: str) -> str:
    """The fsspec URL of ``path`` on a Ray storage ``filesystem`` (a ``pyarrow.fs.FileSystem``).

    Raises:
        InvalidURLError: a pyarrow filesystem with no fsspec counterpart here (e.g. HDFS).
    """
    if isinstance(filesystem, pyarrow.fs.PyFileSystem) and isinstance(
        filesystem.handler, pyarrow.fs.FSSpecHandler
    ):
        url: str = filesystem.handler.fs.unstrip_protocol(path)
        return url
    scheme = _FSSPEC_SCHEMES.get(filesystem.type_name)
    if scheme is None:
        raise InvalidURLError(
            f"Ray Train's storage path {path!r} is on a {filesystem.type_name!r} pyarrow filesystem, which "
            f"dcp_fsspec cannot reach: give RunConfig(storage_filesystem=pyarrow.fs.PyFileSystem("
            f"pyarrow.fs.FSSpecHandler(<an fsspec filesystem>)))"
        )
    return scheme + path


# The Checkpointer's options Ray decides, and what to do instead of setting each.
_DECIDED_BY_RAY = {
    "async_mode": "save synchronously: Ray records a checkpoint as it is when reported",
    "local_tier": "save to the run's storage path: Ray records a checkpoint as it is when reported",
    "keep_last_n": "set Ray's CheckpointConfig(num_to_keep=...), the retention",
    "resume": "pass load_path to RayTrainCheckpointer",
    "incremental": (
        "save whole iterations: Ray's num_to_keep deletes a checkpoint's folder whole, without asking, and "
        "an incremental iteration refers to records in older ones. For incremental saves, use a plain "
        "Checkpointer(incremental=True, keep_last_n=...), whose retention keeps what kept iterations refer to"
    ),
}


class RayTrainCheckpointer:
    """Saves a Ray Train worker's state under the run's storage path and reports it to Ray.

    Build it in ``train_loop_per_worker`` on every worker (after Ray has set up the process
    group), call :meth:`load` once, then :meth:`save_and_report` where the loop would call
    ``ray.train.report`` with a checkpoint. Saves are synchronous: Ray records a
    ``NO_UPLOAD`` checkpoint as it is when reported, so it must be committed by then.

    Ray is the source of truth for resuming: a restarted run loads the iteration
    ``ray.train.get_checkpoint()`` names, even if a later one was committed but never reported
    (the worker died in between); saving that later iteration again replaces it.

    Args:
        storage_options: fsspec options for the run's storage path (endpoint, credentials):
            Ray's own ``storage_filesystem`` cannot be read back for them, and a worker is a
            separate process, so pass them explicitly rather than through the driver's
            environment.
        folder: the folder under the run's directory that holds the iterations.
        load_path: where a run that has no checkpoint of its own starts from (Ray Train v2's
            replacement for ``resume_from_checkpoint``): another run's ``result.checkpoint``,
            or the URL of an iteration folder; read with ``storage_options``.
        checkpointer_options: the :class:`~dcp_fsspec.Checkpointer`'s other options
            (``writer_settings``, ``reader_settings``, ``retry``, ``verify_before_commit``, …).
            Ray decides the rest: saves are synchronous and replace an iteration saved again,
            ``load_path`` is the resume option, and Ray's ``num_to_keep`` is the retention.
            ``incremental`` is refused: Ray deletes a checkpoint's folder whole, and a later
            incremental iteration would refer to records in it.

    Raises:
        UsageError: ``checkpointer_options`` sets an option Ray decides (it names it).
        RuntimeError: not in a Ray Train worker (Ray's own error).
        InvalidURLError: the run's storage filesystem has no fsspec counterpart.
    """

    def __init__(
        self,
        storage_options: dict[str, Any] | None = None,
        *,
        folder: str = "dcp",
        load_path: str | ray.train.Checkpoint | None = None,
        checkpointer_options: CheckpointerOptions | None = None,
    ) -> None:
        options = checkpointer_options or CheckpointerOptions()
        options.require_default("RayTrainCheckpointer", _DECIDED_BY_RAY)
        context = ray.train.get_context()
        storage = context.get_storage()
        self._filesystem = storage.storage_filesystem
        self._path = posixpath.join(storage.experiment_fs_path, folder)
        self._rank = context.get_world_rank()
        if isinstance(load_path, ray.train.Checkpoint):
            load_path = _fsspec_url(load_path.filesystem, load_path.path)
        resume = ResumeOptions(load_path=load_path, load_training_state=True)
        options = dataclasses.replace(options, resume=resume, overwrite=True)
        self.checkpointer = Checkpointer(
            _fsspec_url(self._filesystem, self._path), storage_options, **options.as_kwargs()
        )

    @property
    def url(self) -> str:
        """The fsspec URL the iterations go to (``{run directory}/{folder}``)."""
        return self.checkpointer.url

    def load(self, **state: Any) -> int:
        """Restore every keyword in place and return the iteration to continue from.

        The iteration ``ray.train.get_checkpoint()`` names (a restored run), else ``load_path``,
        else nothing: 0, a fresh start.

        Raises:
            CheckpointNotFoundError: Ray's checkpoint is not an iteration of this folder (it was
                reported by other code, or with another ``folder``).
            As :meth:`dcp_fsspec.Checkpointer.load`.
        """
        reported = ray.train.get_checkpoint()
        if reported is None:
            return self.checkpointer.load(**state)
        iteration = parse_iteration(reported.path)
        if iteration is None or posixpath.dirname(reported.path.rstrip("/")) != self._path:
            raise CheckpointNotFoundError(
                f"Ray's checkpoint {_fsspec_url(reported.filesystem, reported.path)} is not an iteration folder of "
                f"{self.url}: give RayTrainCheckpointer the folder= that saved it"
            )
        return self.checkpointer.load(iteration, **state)

    def save_and_report(self, iteration: int, metrics: dict[str, Any], **state: Any) -> None:
        """Save every keyword as ``iteration``, commit it, and report it to Ray with ``metrics``.

        Every worker calls it (it is a collective, like ``ray.train.report``). Rank 0 reports
        the checkpoint, the others only the metrics, as Ray registers a checkpoint any rank gives.

        Raises:
            As :meth:`dcp_fsspec.Checkpointer.save`; nothing is reported if the save fails.
        """
        self.checkpointer.save(iteration, **state)
        checkpoint = None
        if self._rank == 0:
            path = posixpath.join(self._path, format_iteration(iteration))
            checkpoint = ray.train.Checkpoint(path=path, filesystem=self._filesystem)
        ray.train.report(
            metrics, checkpoint=checkpoint, checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD
        )

    def finalize(self) -> None:
        """Release the checkpointer's resources (see :meth:`dcp_fsspec.Checkpointer.finalize`)."""
        self.checkpointer.finalize()
