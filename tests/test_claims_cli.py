"""README claims about the command line that had no test: S3 reached with valid
``--storage-options`` and credentials from the environment, ``cp`` giving the destination the
source's options, ``cp --json``, and exit 5 for a missing fsspec driver.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from dcp_fsspec import Checkpointer, cli
from tests.conftest import Backend

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _endpoint_only(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> str:
    """--storage-options naming the endpoint only: the keys come from the environment (the
    s3_backend fixture puts them there), the endpoint no longer does."""
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    return json.dumps({"client_kwargs": backend.storage_options["client_kwargs"]})


def _saved(backend: Backend, *iterations: int) -> None:
    with Checkpointer(backend.url, backend.storage_options) as ckpt:
        for iteration in iterations:
            ckpt.save(iteration, model={"w": torch.full((8,), float(iteration))})


def test_ls_reaches_s3_with_storage_options_and_the_credentials_in_the_environment(
    capsys: pytest.CaptureFixture[str], s3_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved(s3_backend, 1, 2)
    options = _endpoint_only(s3_backend, monkeypatch)
    code, out, err = _cli(capsys, "ls", s3_backend.url, "--storage-options", options, "--json")
    assert code == 0, err
    listing = json.loads(out)
    assert s3_backend.url in json.dumps(listing) and "iter_000000002" in json.dumps(listing)


def test_cp_between_two_s3_urls_gives_the_destination_the_sources_options_and_reports_json(
    capsys: pytest.CaptureFixture[str], s3_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --dst-storage-options, a destination of the same scheme gets --storage-options."""
    _saved(s3_backend, 1, 2)
    target = s3_backend.sub("copy")
    options = _endpoint_only(s3_backend, monkeypatch)
    code, out, err = _cli(capsys, "cp", s3_backend.url, target, "--storage-options", options, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert (
        report["src"] == s3_backend.url
        and report["dst"] == target
        and report["files"] > 0
        and report["bytes"] > 0
    )
    back = {"w": torch.zeros(8)}
    with Checkpointer(target, s3_backend.storage_options) as ckpt:
        assert ckpt.committed_iterations() == [1, 2]
        assert ckpt.load(model=back) == 2
    assert torch.equal(back["w"], torch.full((8,), 2.0))


def test_a_missing_fsspec_driver_exits_5_naming_the_package(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # import gcsfs now fails, as when not installed
    registered = sys.modules["fsspec.registry"]._registry  # the classes fsspec already imported
    for scheme in ("gs", "gcs"):
        monkeypatch.delitem(registered, scheme, raising=False)
    code, out, err = _cli(capsys, "ls", "gs://some-bucket/run")
    assert code == 5, (out, err)
    assert "gcsfs" in err and "gs://some-bucket/run" in err
    assert len(err.strip().splitlines()) == 1
