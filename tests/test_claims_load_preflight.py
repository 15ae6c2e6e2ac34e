"""A load that fails changes nothing, on every backend the guarantees table promises it for.

``tests/test_load_preflight.py`` checks each kind of damage on local disk and S3; here each kind
runs on every backend: a truncated data file, a deleted one (through ``load_path``, where only
the preflight sees it), a damaged ``.metadata`` and a state that does not fit, each in the
second key, so that a load applying keys one by one would already have changed the first.
"""

from __future__ import annotations

import pytest
import torch

from dcp_fsspec import CheckpointMismatchError, CorruptCheckpointError, DcpFsspecError
from tests.conftest import Backend
from tests.test_load_preflight import (
    _assert_untouched,
    _checkpointer,
    _damage,
    _data_files,
    _live,
    _save_two_keys,
    _snapshot,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

FAILURES = {
    "a truncated data file": ("save_dirname", CorruptCheckpointError),
    "a deleted data file": ("load_path", CorruptCheckpointError),
    "a damaged .metadata": (
        "load_path",
        CorruptCheckpointError,
    ),  # save_dirname: the commit record check sees it first
    "a state that does not fit": ("save_dirname", CheckpointMismatchError),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_load_that_fails_in_the_second_key_leaves_the_first_untouched_on_every_backend(
    backend: Backend, failure: str
) -> None:
    """Guarantee row: 'a load that fails on a missing or truncated data file, a damaged .metadata or a state that does not fit changes nothing' (local, memory, S3, GCS, Azure, SFTP)"""
    via, error = FAILURES[failure]
    _save_two_keys(backend)
    fs, files = _data_files(backend, "iter_000000001", "trainer")
    model, trainer = _live(7.0)
    if failure == "a truncated data file":
        _damage(fs, files[0], "truncate")
    elif failure == "a deleted data file":
        _damage(fs, files[0], "delete")
    elif failure == "a damaged .metadata":
        metadata = fs._strip_protocol(backend.sub("iter_000000001", "trainer", ".metadata"))
        fs.pipe_file(metadata, fs.cat_file(metadata)[:-40])
        fs.invalidate_cache()
    else:
        trainer["table"] = torch.full((33,), 7.0)
    before = _snapshot(model, trainer)
    with _checkpointer(backend, via) as ckpt, pytest.raises(DcpFsspecError) as raised:
        ckpt.load(model=model, trainer=trainer)
    assert isinstance(raised.value, error), raised.value
    assert backend.url in str(raised.value), raised.value
    _assert_untouched(model, trainer, before)
    assert trainer["step"] == 7
