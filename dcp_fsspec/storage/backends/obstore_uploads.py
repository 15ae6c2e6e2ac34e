"""Uploads through obstore: one PUT up to a size threshold, else a multipart upload.

Until the file passes the threshold its buffers are held as views of the caller's memory
(tensor memory, record headers), sent in one PUT on commit, retried by the save's policy.
Past it, obstore's writer copies them into parts it sends several at once; the save's byte
budget bounds those parts. obstore retries each part itself: no caller can resend one part.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import obstore

from dcp_fsspec.storage.backends.obstore_filesystem import ObstoreFileSystem, as_os_error, tried_async
from dcp_fsspec.storage.backends.uploads import MIN_PART_SIZE, ByteBudget, FileUpload
from dcp_fsspec.storage.transport.concurrency import store_limit
from dcp_fsspec.storage.transport.retry import RetryPolicy

# Parts of one file in flight at once.
PARTS_AT_ONCE = 8


class ObstoreUpload(FileUpload):
    """One whole file: published by commit, absent after abort."""

    def __init__(
        self,
        fs: ObstoreFileSystem,
        path: str,
        *,
        url: str,
        part_size: int,
        multipart_threshold: int,
        budget: ByteBudget,
        retry: RetryPolicy,
    ) -> None:
        super().__init__(fs, path)
        self._store, self._key = fs.store(path)
        self._parts_store = fs.parts_store(fs._split_path(path)[0])
        self._url = url
        self._part_size = max(part_size, MIN_PART_SIZE)
        self._threshold = max(multipart_threshold, self._part_size)
        self._budget = budget
        self._retry = retry
        self._pending: list[memoryview] = []
        self._writer: Any = None
        self._held = 0

    def write(self, buffers: Iterable[bytes | memoryview]) -> None:
        for buf in buffers:
            view = memoryview(buf).cast("B")
            self.size += view.nbytes
            if self._writer is not None:
                self._write_part(view)
                continue
            self._pending.append(view)
            if self.size > self._threshold:
                self._start_multipart()

    def _start_multipart(self) -> None:
        self._held = self._part_size * (PARTS_AT_ONCE + 1)
        self._budget.acquire(self._held)
        self._writer = obstore.open_writer(
            self._parts_store, self._key, buffer_size=self._part_size, max_concurrency=PARTS_AT_ONCE
        )
        pending, self._pending = self._pending, []
        for view in pending:
            self._write_part(view)

    def _write_part(self, view: memoryview) -> None:
        try:
            self._writer.write(view)
        except obstore.exceptions.BaseError as e:
            raise as_os_error(e) from e

    def commit(self) -> None:
        try:
            if self._writer is not None:
                self._writer.close()
            else:
                self._put_whole()
        except obstore.exceptions.BaseError as e:
            raise as_os_error(e) from e
        finally:
            self._release()
        self.fs.invalidate_cache(self.path)

    def _put_whole(self) -> None:
        """One PUT on the filesystem's loop, retried under the store's limit (shared with the
        reads), so a throttled PUT lowers the requests in flight as on s3fs."""
        body, self._pending = self._pending or [memoryview(b"")], []

        async def put() -> Any:
            return await tried_async(
                lambda: obstore.put_async(self._store, self._key, body, use_multipart=False)
            )

        self._budget.acquire(self.size)
        try:
            sending = self._retry.call_async(put, url=self._url, kind="PUT", limit=store_limit(self.fs))
            asyncio.run_coroutine_threadsafe(sending, self.fs.loop).result()
        finally:
            self._budget.release(self.size)

    def abort(self) -> None:
        self._pending = []
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:  # leaving the writer's block with an error aborts the multipart upload
                writer.__exit__(RuntimeError, RuntimeError("aborted"), None)
            except Exception:  # noqa: BLE001 - the original error matters more; S3 expires it
                pass
        self._release()

    def _release(self) -> None:
        if self._held:
            self._budget.release(self._held)
            self._held = 0
