"""A training process for the async crash test: ``python -m tests.async_child URL OPTIONS_JSON``.

It commits iteration 1 synchronously, then starts an asynchronous save of iteration 2 (a state
large enough that writing it takes a while), prints the background process's pid, and waits
to be SIGKILLed by the test.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from dcp_fsspec import Checkpointer

STEP1 = {"w": torch.arange(1000.0)}


def big_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(16 * 1024 * 1024, generator=gen) for i in range(4)}  # 256 MiB


def main() -> None:
    url, options = sys.argv[1], json.loads(sys.argv[2])
    with Checkpointer(url, options) as sync:
        sync.save(1, trainer=STEP1)
    ckpt = Checkpointer(url, options, async_mode="async_with_pinned_mem")
    ckpt.save(2, trainer=big_state())
    print(f"SAVING {ckpt._background.pid}", flush=True)  # type: ignore[union-attr]
    time.sleep(600)


if __name__ == "__main__":
    main()
