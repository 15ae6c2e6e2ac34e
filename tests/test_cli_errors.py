"""How ``dcp-fsspec`` reports what goes wrong."""

from __future__ import annotations

from dcp_fsspec import errors
from dcp_fsspec.tools import _cli


def test_usage_error_lives_with_every_other_exception_class() -> None:
    assert issubclass(errors.UsageError, errors.DcpFsspecError) and issubclass(errors.UsageError, ValueError)
    assert _cli.UsageError is errors.UsageError
    assert "UsageError" in (errors.__doc__ or "")
