"""Turning a user's URL (or plain path) into an fsspec filesystem and a path on it.

This is the one place that talks to fsspec's URL registry, so every layer above reports a bad
scheme or a missing driver the same way, and joins paths with ``posixpath`` rather than
``os.path`` (URLs use ``/`` on every platform).

It also keeps credentials out of sight: a password in a URL's userinfo
(``sftp://user:pw@host/…``) reaches the fsspec driver, but every URL a :class:`Location` gives
back (``url``, ``url_of``, and so DCP's ``checkpoint_id``) is :func:`redact_url`'s form,
``user:***@host``, the only form that messages, logs, events, CLI output and ``.metadata`` see.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any
from urllib.parse import unquote

import fsspec
from fsspec.registry import known_implementations, registry

from dcp_fsspec.errors import InvalidURLError, MissingDriverError
from dcp_fsspec.storage.backends import DRIVER_PACKAGES, Backend, backend_for, filesystem_for
from dcp_fsspec.storage.transport.retry import DEFAULT_RETRY, NO_RETRY, RetryPolicy

REDACTED = "***"
# scheme://userinfo@ — the userinfo ends at the last "@" before the path, so a password holding
# an unescaped "@" is still hidden whole.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/?#@:]*):(?P<password>[^/?#]*)@")
# Real userinfo of the URLs this process resolved, by their redacted form: a redacted URL that
# comes back to resolve() (``url_of`` handed to a new writer or reader) connects as the original.
_CREDENTIALS: dict[str, str] = {}


def redact_url(url: str | os.PathLike[str]) -> str:
    """``url`` with the password of every ``scheme://user:password@`` replaced by ``***``.

    Works on chained URLs (``simplecache::sftp://u:pw@host/x``) and on any text that holds URLs,
    so messages can pass through it whole. A URL without a password comes back unchanged.
    """
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", os.fspath(url))


def redact_text(text: str, urls: Iterable[str] = ()) -> str:
    """``text`` (a message, a traceback) with every URL password redacted, and every password of
    ``urls`` and of the URLs this process resolved replaced by ``***`` wherever it appears: a
    driver may quote a URL's parts without its scheme (s3fs: ``Invalid bucket name
    "key:secret@bucket"``), which :func:`redact_url` cannot tell from other text.
    """
    secrets = {m["password"] for url in urls for m in _USERINFO.finditer(url)}
    secrets |= {m["password"] for full in _CREDENTIALS.values() for m in _USERINFO.finditer(full)}
    secrets |= {unquote(secret) for secret in secrets}  # as a driver sees it, %-escapes decoded
    text = redact_url(text)
    for secret in sorted(secrets - {"", REDACTED}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text


def _remember_credentials(url: str) -> str:
    """Record the userinfo of ``url`` under its redacted form; return the redacted URL."""
    for m in _USERINFO.finditer(url):
        if m["password"] != REDACTED:
            _CREDENTIALS[f"{m['scheme']}{m['user']}:{REDACTED}@"] = m.group(0)
    return redact_url(url)


def _restore_credentials(url: str) -> str:
    """The URL a redacted ``url`` stood for, where this process resolved it (else ``url``)."""
    return _USERINFO.sub(lambda m: _CREDENTIALS.get(m.group(0), m.group(0)), url)


@dataclass(frozen=True)
class Location:
    """A filesystem and a scheme-less root path on it, the URL the user gave with any password
    redacted (``url``), how calls retry, and (``backend``) what the store can do.

    ``secret_url`` is the URL as given, credentials included, for a process that must connect
    again by itself (the background saver); it never goes into a message, a log or a file.
    """

    fs: fsspec.AbstractFileSystem
    path: str
    url: str
    retry: RetryPolicy = DEFAULT_RETRY
    secret_url: str = field(default="", repr=False, compare=False)

    def join(self, *names: str) -> str:
        """The path of ``names`` below the root (always ``/``-separated).

        A name that starts with ``..`` (a reference into a sibling checkpoint, checked where it
        was read: :mod:`~dcp_fsspec.storage.format.references`) is resolved, as object stores know no ``..``.
        """
        path = posixpath.join(self.path, *names)
        return posixpath.normpath(path) if names and names[0].startswith("../") else path

    def at(self, path: str) -> Location:
        """Another path on this filesystem, as a Location of its own (same driver and retries)."""
        return Location(self.fs, path, self.url_of(path), self.retry)

    @cached_property
    def backend(self) -> Backend:
        """What this store can do and how (:mod:`~dcp_fsspec.storage.backends`), chosen once from the filesystem."""
        return backend_for(self.fs, self.retry, self.url_of)

    def url_of(self, path: str) -> str:
        """The full URL of a path on this filesystem, for messages (in the form the user wrote,
        any password redacted); :func:`resolve` in this process connects it with the password."""
        if path == self.path or path.startswith(self.path.rstrip("/") + "/"):
            return self.url.rstrip("/") + path[len(self.path.rstrip("/")) :]
        return self.backend.plain_url(path)

    @property
    def answers_locally(self) -> bool:
        """See :class:`~dcp_fsspec.storage.backends.base.Backend`: no round trip to hide behind threads."""
        return self.backend.answers_locally


def normalize_url(url: str | os.PathLike[str]) -> str:
    """Return ``url`` with a scheme kept as is, or a local path made absolute with ``~`` expanded.

    Ranks may run in different working directories, so a relative path is resolved once, here,
    rather than differently in every process.
    """
    text = os.fspath(url)
    if not isinstance(text, str) or not text.strip():
        raise InvalidURLError(
            f"checkpoint URL {url!r} is empty; pass a local path or a URL like s3://bucket/ckpt"
        )
    if "://" in text or "::" in text:
        _refuse_empty_segments(text)
        return text.rstrip("/") if not text.endswith("://") else text
    return os.path.abspath(os.path.expanduser(text))


def _refuse_empty_segments(url: str) -> None:
    """A ``//`` inside a URL's path names another key prefix on object stores (``s3://b/a//c``
    is not ``s3://b/a/c``), which listings and retention then miss: refuse it, naming the fix."""
    fixed = []
    for part in url.split("::"):
        scheme, sep, rest = part.partition("://")
        fixed.append(scheme + sep + re.sub("/{2,}", "/", rest) if sep else part)
    suggestion = "::".join(fixed)
    if suggestion != url:
        raise InvalidURLError(
            f"checkpoint URL {redact_url(url)!r} has an empty path segment ('//'), which object stores keep "
            f"as part of the key; did you mean {redact_url(suggestion)!r}?"
        )


def scheme_of(url: str) -> str:
    """The first protocol of a (possibly chained) URL; ``file`` for plain paths."""
    head = url.split("::", 1)[0]
    return head.split("://", 1)[0] if "://" in head else "file"


def is_known_scheme(url: str) -> bool:
    """Whether fsspec knows a driver for every protocol of ``url`` (installed or not)."""
    for part in url.split("::"):
        proto = part.split("://", 1)[0] if "://" in part else "file"
        if proto not in known_implementations and proto not in registry:
            return False
    return True


def is_checkpoint_url(url: object) -> bool:
    """Whether ``url`` is a local path or a URL whose every scheme fsspec knows (DCP's check)."""
    try:
        return is_known_scheme(normalize_url(url))  # type: ignore[arg-type]
    except (InvalidURLError, TypeError):
        return False


def resolve(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    *,
    retry: RetryPolicy | None = DEFAULT_RETRY,
) -> Location:
    """Resolve ``url`` to a :class:`Location`.

    Args:
        url: any fsspec URL (``s3://bucket/run``, ``memory://x``, ``simplecache::s3://…``) or a
            local path (relative paths and ``~`` are resolved against this process).
        storage_options: passed to the fsspec filesystem's constructor (credentials, endpoint);
            ``transport="obstore"`` reads and writes s3:// through obstore instead of s3fs.
        fs: a ready filesystem to use instead of building one from the URL's scheme.
        retry: how storage calls on it are retried (:mod:`~dcp_fsspec.storage.transport.retry`); ``None``: not at all beyond
            the driver's own retries.

    A password in the URL goes to the driver; the Location's ``url`` shows it as ``***``. A URL
    already redacted by a Location of this process connects with the password it stood for.

    Raises:
        InvalidURLError: the scheme is unknown to fsspec, or the URL is empty.
        MissingDriverError: the scheme is known but its driver package is not installed.
    """
    if storage_options is not None and not isinstance(storage_options, dict):
        raise InvalidURLError(
            f"storage_options for {redact_url(str(url))!r} must be a dict, got {type(storage_options).__name__}"
        )
    text = _restore_credentials(normalize_url(url))
    shown = _remember_credentials(text)
    retry = retry or NO_RETRY
    if fs is not None:
        path = fs._strip_protocol(text).rstrip("/") or "/"
        return Location(fs=fs, path=path, url=shown, retry=retry, secret_url=text)
    if not is_known_scheme(text):
        raise InvalidURLError(
            f"checkpoint URL {shown!r} has scheme {scheme_of(text)!r}, which fsspec does not know; "
            "use a local path or one of fsspec's schemes (s3://, gs://, az://, memory://, file://, …)"
        )
    try:
        filesystem, path = filesystem_for(text, storage_options or {}, shown)
    except (MissingDriverError, InvalidURLError):
        raise
    except ImportError as e:
        package = DRIVER_PACKAGES.get(scheme_of(text), "the fsspec driver for this scheme")
        raise MissingDriverError(
            f"cannot open {shown!r}: the driver for {scheme_of(text)}:// is not installed; "
            f"run `pip install {package}`"
        ) from e
    except (TypeError, ValueError) as e:
        raise InvalidURLError(
            f"cannot open {shown!r} with storage_options {sorted(storage_options or {})}: {redact_url(str(e))}"
        ) from e
    return Location(fs=filesystem, path=path.rstrip("/") or "/", url=shown, retry=retry, secret_url=text)


class UrlBound:
    """What the storage writer and reader share: the checkpoint's location, and moving it.

    ``reset(checkpoint_id)`` in DCP points an existing writer/reader at another URL; it is
    resolved with the same storage options, filesystem and retry policy as the first.
    """

    location: Location

    def _bind(
        self,
        path: str | os.PathLike[str],
        storage_options: dict[str, Any] | None,
        fs: fsspec.AbstractFileSystem | None,
        retry: Any,
    ) -> None:
        self.location = resolve(path, storage_options, fs, retry=retry)
        self.storage_options = dict(storage_options or {})
        self._fs_override = fs

    def _rebind(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        if checkpoint_id:
            self.location = resolve(
                checkpoint_id, self.storage_options, self._fs_override, retry=self.location.retry
            )

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint's URL, any password redacted: DCP stores it in ``.metadata``."""
        return self.location.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a local path or a URL whose scheme fsspec knows."""
        return is_checkpoint_url(checkpoint_id)
