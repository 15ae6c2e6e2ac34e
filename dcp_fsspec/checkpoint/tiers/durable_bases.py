"""Which references of a drained iteration its durable copy may keep as they are.

A local iteration of an incremental run refers to files of older local iterations. Its durable
copy keeps such a reference where ``save_dirname`` holds that file of the same save:

1. the iteration there is referable (committed, or retired with its files kept);
2. its key is a checkpoint (``.metadata``) holding the file, at the local file's size;
3. the key's ``.content_hashes.json`` is the local one's (it names the save); per node, the
   copy this rank uploaded under its own name.

The drain copies the records of every other reference in (:mod:`~dcp_fsspec.storage.checkpoint_files.self_contained`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable

from dcp_fsspec.checkpoint.commit import layout
from dcp_fsspec.checkpoint.commit.commit_record import referable
from dcp_fsspec.errors import CorruptCheckpointError
from dcp_fsspec.storage.checkpoint_files.self_contained import folder_sizes
from dcp_fsspec.storage.format.names import CONTENT_HASHES_NAME, METADATA_NAME
from dcp_fsspec.storage.transport.urls import Location


class DurableBases:
    """Answers :meth:`holds` for the files one drain refers to, each folder asked about once.

    Args:
        local: the local tier (this rank's own, per node).
        durable: the ``save_dirname`` location.
        rename: the durable name of a local file (per node: the rank's), relative to the roots.
    """

    def __init__(
        self, local: Location, durable: Location, rename: Callable[[str], str] | None = None
    ) -> None:
        self._local = local
        self._durable = durable
        self._rename = rename or (lambda name: name)
        self._referable: dict[int, bool] = {}
        self._folders: dict[str, tuple[dict[str, int], dict[str, int]] | None] = {}

    def holds(self, path: str) -> bool:
        """Whether ``save_dirname`` holds the local file at ``path`` (a referenced file), same save.

        Raises:
            StorageError: the backend failed.
        """
        root = self._local.path.rstrip("/") + "/"
        name = path[len(root) :] if path.startswith(root) else ""
        parts = name.split("/")
        iteration = layout.parse_iteration(parts[0]) if len(parts) == 3 else None
        if iteration is None or not self._is_referable(iteration):
            return False
        folder = posixpath.dirname(name)
        if folder not in self._folders:
            self._folders[folder] = self._same_save(folder)
        sizes = self._folders[folder]
        if sizes is None:
            return False
        local_sizes, durable_sizes = sizes
        size = local_sizes.get(path)
        return size is not None and durable_sizes.get(self._durable.join(self._rename(name))) == size

    def _is_referable(self, iteration: int) -> bool:
        if iteration not in self._referable:
            try:
                self._referable[iteration] = referable(self._durable, iteration)
            except CorruptCheckpointError:  # a record we did not write: copy the records in
                self._referable[iteration] = False
        return self._referable[iteration]

    def _same_save(self, folder: str) -> tuple[dict[str, int], dict[str, int]] | None:
        """Both tiers' listings of a key folder, if the durable one is a checkpoint of the local one's save."""
        local_path, durable_path = self._local.join(folder), self._durable.join(folder)
        durable_sizes = folder_sizes(self._durable, [durable_path])
        if posixpath.join(durable_path, METADATA_NAME) not in durable_sizes:
            return None
        # Per node, each rank's hashes went up under a name of their own (``rename``).
        own_hashes = posixpath.join(folder, CONTENT_HASHES_NAME)
        hashes = [
            self._local.backend.read_versioned(self._local.join(own_hashes)).data,
            self._durable.backend.read_versioned(self._durable.join(self._rename(own_hashes))).data,
        ]
        if hashes[0] is None or hashes[0] != hashes[1]:
            return None
        return folder_sizes(self._local, [local_path]), durable_sizes
