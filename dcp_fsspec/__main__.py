"""``python -m dcp_fsspec``: the command line (see :mod:`dcp_fsspec.cli`)."""

from __future__ import annotations

from dcp_fsspec.cli import main

raise SystemExit(main())
