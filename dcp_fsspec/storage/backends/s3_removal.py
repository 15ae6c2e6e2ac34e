"""S3 removals in bulk: listings, DeleteObjects and aborts of unfinished multipart uploads.

Each request goes through the backend's retry policy, with at most :data:`REQUESTS_AT_ONCE` in
flight. A key the server refuses to delete raises, naming it: s3fs's own bulk ``rm`` drops those.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from dcp_fsspec.errors import DcpFsspecError, StorageError
from dcp_fsspec.storage.backends.base import Backend

logger = logging.getLogger(__name__)
T = TypeVar("T")

# S3's DeleteObjects takes at most this many keys a request.
DELETE_BATCH = 1000
# A removal of more paths than this lists their common folder once, rather than each of them.
LIST_EACH_UP_TO = 8
# Listings and deletions of a removal in flight at once.
REQUESTS_AT_ONCE = 16


class S3Removal:
    """The requests of one removal under a backend's bucket, run on its filesystem's loop."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.fs = backend.fs

    async def trees(self, paths: Sequence[str], within: str) -> None:
        """Delete each of ``paths`` (all under ``within``) with every key under it, and abort the
        unfinished uploads under them: two round trips, the listings at once, then the deletes
        and aborts at once (one listing of ``within``'s uploads for all)."""
        keys = [self.fs.split_path(p)[1] for p in paths]  # a path may be a file itself
        uploads = self.uploads_under(within, paths)
        if len(paths) > LIST_EACH_UP_TO:
            under = tuple(key.rstrip("/") + "/" for key in keys)
            listed, pending = await asyncio.gather(self.list_keys(within), uploads)
            keys += [key for key in listed if key.startswith(under)]
        else:
            *lists, pending = await asyncio.gather(_bounded([self.list_keys(p) for p in paths]), uploads)
            keys += [key for listed in lists[0] for key in listed]
        await asyncio.gather(self.delete_keys(keys, within), self.abort_uploads(within, pending))

    async def list_keys(self, folder: str) -> list[str]:
        """Every key under ``folder``, one request per 1,000, fresh (no cache)."""
        bucket, prefix, _ = self.fs.split_path(folder.rstrip("/") + "/")
        keys: list[str] = []
        token: dict[str, str] = {}
        while True:
            page = await self._request("list_objects_v2", folder, Bucket=bucket, Prefix=prefix, **token)
            keys += [item["Key"] for item in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return keys
            token = {"ContinuationToken": page["NextContinuationToken"]}

    async def delete_keys(self, keys: Sequence[str], within: str) -> None:
        """Delete ``keys`` of ``within``'s bucket; a key the server refused raises, naming it."""
        bucket = self.fs.split_path(within)[0]
        unique = sorted(set(keys))
        batches = [unique[i : i + DELETE_BATCH] for i in range(0, len(unique), DELETE_BATCH)]

        async def delete(batch: list[str]) -> None:
            objects = {"Objects": [{"Key": key} for key in batch], "Quiet": True}
            answer = await self._request("delete_objects", within, Bucket=bucket, Delete=objects)
            errors = answer.get("Errors") or []
            if errors:  # s3fs's own bulk rm drops these silently
                first = errors[0]
                url = self.backend.url_of(f"{bucket}/{first.get('Key')}")
                raise StorageError(
                    f"cannot delete {url}: {first.get('Code')} {first.get('Message')} ({len(errors)} key(s) "
                    "refused); check that the credentials may delete there"
                )

        await _bounded([delete(batch) for batch in batches])

    async def uploads_under(self, within: str, folders: Sequence[str]) -> list[dict[str, str]]:
        """The unfinished multipart uploads under any of ``folders`` (best effort: none, logged)."""
        bucket, prefix, _ = self.fs.split_path(within.rstrip("/") + "/")
        under = tuple(self.fs.split_path(f.rstrip("/") + "/")[1] for f in folders)
        try:
            listing = await self._request("list_multipart_uploads", within, Bucket=bucket, Prefix=prefix)
        except (OSError, DcpFsspecError) as e:
            logger.warning(
                "could not list the unfinished uploads under %s: %s", self.backend.url_of(within), e
            )
            return []
        return [u for u in listing.get("Uploads", []) if u["Key"].startswith(under)]

    async def abort_uploads(self, within: str, uploads: Sequence[dict[str, str]]) -> None:
        """Abort ``uploads`` (from :meth:`uploads_under`; best effort, logged)."""
        bucket = self.fs.split_path(within)[0]
        try:
            await _bounded(
                [
                    self._request(
                        "abort_multipart_upload", within, Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]
                    )
                    for u in uploads
                ]
            )
        except (OSError, DcpFsspecError) as e:
            logger.warning(
                "could not abort the unfinished uploads under %s: %s", self.backend.url_of(within), e
            )

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        return await self.backend.retry.call_async(
            lambda: self.fs._call_s3(method, **kwargs), url=self.backend.url_of(path)
        )


async def _bounded(coros: Sequence[Coroutine[Any, Any, T]], limit: int = REQUESTS_AT_ONCE) -> list[T]:
    """Await ``coros``, at most ``limit`` at once, in order; the first failure raises."""
    gate = asyncio.Semaphore(limit)

    async def gated(coro: Coroutine[Any, Any, T]) -> T:
        async with gate:
            return await coro

    return list(await asyncio.gather(*(gated(c) for c in coros)))
