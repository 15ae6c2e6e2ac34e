"""Small, frequent saves: a save costs a bounded number of requests, not requests per check.

Many runs checkpoint small states often (RL policies, LoRA adapters, the demo); there a save's
time is its round trips, not its bytes. These tests record every S3 request a
:class:`~dcp_fsspec.Checkpointer` save and load of a ~3 MiB state in four keys send to the moto
server, print the log (``pytest -s`` shows it), and bound their number.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import s3fs
import torch

from dcp_fsspec import Checkpointer
from tests.conftest import Backend

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"), pytest.mark.timeout(300)]

KEYS = ("model", "optim", "scheduler", "trainer")


@pytest.fixture
def request_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every S3 API call made while the test runs, as ``"Operation key"``, in order."""
    log: list[str] = []
    real = s3fs.S3FileSystem._call_s3

    async def logging_call(self: s3fs.S3FileSystem, method: str, *args: Any, **kwargs: Any) -> Any:
        log.append(f"{method} {kwargs.get('Key', kwargs.get('Prefix', ''))}")
        return await real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", logging_call)
    yield log


def _small_state(step: int) -> dict[str, dict[str, Any]]:
    """~3 MiB over four keys, as a small policy's training state would be."""
    torch.manual_seed(step)
    return {
        "model": {"w": torch.randn(512, 1024), "b": torch.randn(1024)},  # 2 MiB
        "optim": {"m": torch.randn(256, 1024), "step": step},  # 1 MiB
        "scheduler": {"last_epoch": step, "lr": 1e-3},
        "trainer": {"step": step, "rng": torch.randint(0, 255, (1024,), dtype=torch.uint8)},
    }


def _show(what: str, log: list[str]) -> None:
    print(f"\n{what}: {len(log)} requests")
    for line in log:
        print("  " + line)


def test_a_small_save_and_load_print_their_requests(s3_backend: Backend, request_log: list[str]) -> None:
    with Checkpointer(s3_backend.url, s3_backend.storage_options) as ckpt:
        ckpt.save(1, **_small_state(1))
        request_log.clear()
        ckpt.save(2, **_small_state(2))
        _show("save", request_log)
        request_log.clear()
    with Checkpointer(s3_backend.url, s3_backend.storage_options) as ckpt:
        state = _small_state(0)
        assert ckpt.load(**state) == 2
        _show("load", request_log)
    assert torch.equal(state["model"]["w"], _small_state(2)["model"]["w"])
